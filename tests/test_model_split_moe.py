"""Mixture-of-experts and MLA families: split, they generate exactly what the unsplit model does.

Tiny random models of qwen3_moe, mixtral, glm4_moe, deepseek_v3 and gpt_oss, float and quantized
(tests/tiny_models.py MOE_FAMILIES), built with mlx-lm's own classes and saved in its format.
Two processes each load_split one rank's part over tcp, the emulated RDMA device and MLX's
ring, decode 32 greedy tokens and compare with the unsplit model decoded here; a 4-rank ring
run does the same. Cutting, reading and refusing run in-process with stand-in groups.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import tiny_models
from mlx_ds4tp.checkpoint.parts import SafetensorsParts
from mlx_ds4tp.model_split import load_split, split_model
from mlx_ds4tp.split import layers as _split_layers, plans as _split_plans
from splitutil import run_ranks, transports, unsplit_references
from tiny_models import RankOnly

FAMILIES = list(tiny_models.MOE_FAMILIES)
# The bound: logits of the split model within 2e-3 of the unsplit model's, relative to
# the largest logit (float32 sums in another order, quantized weights cut on group boundaries).
LOGITS_RTOL = 2e-3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-models")
    return {name: tiny_models.build(name, root) for name in FAMILIES}


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, dict]:
    return unsplit_references(model_dirs)


@pytest.fixture(scope="module", params=transports())
def pair(request, model_dirs, tmp_path_factory) -> dict[str, list]:
    return run_ranks(request.param, model_dirs, tmp_path_factory.mktemp(f"moe-{request.param}"))


def _load_whole(path: Path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


# ---------------------------------------------------------------------------------------------
# Two ranks generate what one model generates
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_split_generates_the_unsplit_tokens(pair, references, family):
    ref = references[family]
    assert len(ref["tokens"]) == tiny_models.MAX_TOKENS
    for rank, result in enumerate(pair[family]):
        assert result["tokens"].tolist() == ref["tokens"], f"rank {rank} greedy tokens differ"
        assert result["streamed"].tolist() == ref["streamed"], f"rank {rank} stream_generate differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_split_logits_match_the_unsplit_logits(pair, references, family):
    want = references[family]["logits"]
    for rank, result in enumerate(pair[family]):
        err = np.abs(result["logits"] - want).max() / np.abs(want).max()
        assert err <= LOGITS_RTOL, f"rank {rank}: logits differ by {err:.2e} relative"


@pytest.mark.parametrize("family", FAMILIES)
def test_both_ranks_hold_identical_logits(pair, family):
    rank0, rank1 = pair[family]
    assert np.array_equal(rank0["logits"], rank1["logits"])


def test_four_ranks_on_the_ring_generate_the_unsplit_tokens(tmp_path):
    """More than two ranks over mx.distributed, where every count divides by 4."""
    config, _ = tiny_models.MOE_FAMILIES["qwen3_moe"]
    config = {**config, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16}
    path = tiny_models.save_random_model(tmp_path / "qwen3_moe-4way", config)
    ref = unsplit_references({path.name: path})[path.name]
    results = run_ranks("ring", {path.name: path}, tmp_path, ranks=4)[path.name]
    for rank, result in enumerate(results):
        assert result["tokens"].tolist() == ref["tokens"], f"rank {rank} of 4: greedy tokens differ"
        assert np.array_equal(result["logits"], results[0]["logits"]), f"rank {rank} of 4: logits differ from rank 0"
    err = np.abs(results[0]["logits"] - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert err <= LOGITS_RTOL


# ---------------------------------------------------------------------------------------------
# One gate per attention, one per MoE block, one gather per token
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_per_token(model_dirs, family, counted):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_ds4tp.collectives.backend import cut_only_group

    model = split_model(_load_whole(model_dirs[family]), cut_only_group(0, 2))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 6, 7]]), cache=cache))
    layers = len(model.model.layers)
    for step in range(3):
        counted["sums"] = counted["gathers"] = 0
        mx.eval(model(mx.array([[8 + step]]), cache=cache))
        assert counted["sums"] <= 2 * layers + 1, f"{counted['sums']} all_sum calls for one token of {layers} layers"
        assert counted["gathers"] == 1


# ---------------------------------------------------------------------------------------------
# What each rank holds, and reading it from disk
# ---------------------------------------------------------------------------------------------


def test_qwen3_moe_experts_are_cut_by_their_intermediate_features(model_dirs):
    path = model_dirs["qwen3_moe"]
    whole = dict(tree_flatten(_load_whole(path).parameters()))
    model = split_model(_load_whole(path), RankOnly(1))
    moe, dense = model.model.layers[0].mlp, model.model.layers[1].mlp
    # mlx-lm's plan: the block sums its experts' partials once (its sharding_group).
    assert moe.sharding_group is not None and isinstance(dense.down_proj, nn.ShardedToAllLinear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.AllToShardedLinear)
    gate = whole["model.layers.0.mlp.switch_mlp.gate_proj.weight"]  # [experts, out, in]
    down = whole["model.layers.0.mlp.switch_mlp.down_proj.weight"]
    assert mx.array_equal(moe.switch_mlp.gate_proj.weight, gate[:, gate.shape[1] // 2 :])
    assert mx.array_equal(moe.switch_mlp.down_proj.weight, down[..., down.shape[2] // 2 :])
    assert mx.array_equal(moe.gate.weight, whole["model.layers.0.mlp.gate.weight"])  # router whole


def test_gpt_oss_sinks_and_expert_biases(model_dirs):
    path = model_dirs["gpt_oss"]
    whole = dict(tree_flatten(_load_whole(path).parameters()))
    sinks, down_bias = whole["model.layers.0.self_attn.sinks"], whole["model.layers.0.mlp.experts.down_proj.bias"]
    for rank in (0, 1):
        layer = split_model(_load_whole(path), RankOnly(rank)).model.layers[0]
        assert layer.self_attn.num_attention_heads == 2 and layer.self_attn.num_key_value_heads == 1
        assert mx.array_equal(layer.self_attn.sinks, sinks[2 * rank : 2 * rank + 2])
        # Summed over the ranks by one gate: mlx-lm's plan gives each rank 1/N of the expert biases.
        assert mx.array_equal(layer.mlp.experts.down_proj.bias, down_bias / 2)


def test_mla_cuts_heads_and_keeps_the_latent_projections_whole(model_dirs):
    path = model_dirs["deepseek_v3"]
    whole = dict(tree_flatten(_load_whole(path).parameters()))
    attn = split_model(_load_whole(path), RankOnly(1)).model.layers[0].self_attn
    assert attn.num_heads == 2
    embed_q = whole["model.layers.0.self_attn.embed_q.weight"]  # [heads, out, in]
    assert mx.array_equal(attn.embed_q.weight, embed_q[2:])
    assert mx.array_equal(attn.kv_a_proj_with_mqa.weight, whole["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    assert mx.array_equal(attn.q_a_proj.weight, whole["model.layers.0.self_attn.q_a_proj.weight"])


def _no_in_memory_cuts(monkeypatch):
    """Our plans' cuts and mlx-lm's (load_split logs any array it had to read whole) all read
    from the file."""
    from mlx_ds4tp.split import apply

    def refuse(a, start, stop):
        raise AssertionError(f"an array of shape {a.shape} was cut in memory instead of read from disk")

    def refuse_log(message):
        assert "read whole" not in message, message

    monkeypatch.setattr(_split_layers, "_keep_rows", refuse)
    monkeypatch.setattr(apply, "log", refuse_log)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rank", [0, 1])
def test_reading_parts_from_disk_equals_cutting_in_memory(model_dirs, family, rank, monkeypatch):
    path = model_dirs[family]
    in_memory = dict(tree_flatten(load_split(path, RankOnly(rank), lazy=False)[0].parameters()))
    _no_in_memory_cuts(monkeypatch)  # every part of an mlx-lm checkpoint is read from the file
    from_disk = dict(tree_flatten(load_split(path, RankOnly(rank))[0].parameters()))
    assert from_disk.keys() == in_memory.keys()
    for key in from_disk:
        assert from_disk[key].dtype == in_memory[key].dtype and mx.array_equal(from_disk[key], in_memory[key]), key


def _save_per_expert(src: Path, dst: Path, expert_keys) -> None:
    """src's checkpoint in the original Hugging Face layout: each expert under its own keys."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    weights = {}
    for file in src.glob("model*.safetensors"):
        weights.update(mx.load(str(file)))
    out = {}
    for key, value in weights.items():
        stacked = next(((s, one) for s, one in expert_keys if s in key), None)
        if stacked is None:
            out[key] = value
            continue
        for e in range(value.shape[0]):
            out[key.replace(stacked[0], stacked[1].format(e=e))] = value[e]
    mx.save_safetensors(str(dst / "model.safetensors"), out)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral-q8", "deepseek_v3-q4"])
@pytest.mark.parametrize("rank", [0, 1])
def test_experts_saved_one_by_one_are_stacked_from_this_ranks_parts(model_dirs, tmp_path, family, rank, monkeypatch):
    src = model_dirs[family]
    dst = tmp_path / f"{family}-hf"
    expert_keys = _split_plans.saved_layout(type(_load_whole(src)).__module__)["expert_keys"]
    _save_per_expert(src, dst, expert_keys)
    want = dict(tree_flatten(load_split(src, RankOnly(rank))[0].parameters()))

    reads = []
    original = SafetensorsParts._part_runs

    def spy(self, key, axis, runs, shape=None):
        part = original(self, key, axis, runs, shape)
        reads.append((key, int(np.prod(part[0])), self.tensors[key][2]))
        return part

    monkeypatch.setattr(SafetensorsParts, "_part_runs", spy)
    _no_in_memory_cuts(monkeypatch)
    got = dict(tree_flatten(load_split(dst, RankOnly(rank))[0].parameters()))
    assert got.keys() == want.keys()
    for key in got:
        assert mx.array_equal(got[key], want[key]), key
    one_by_one = [(k, n, shape) for k, n, shape in reads if ".experts." in k]
    assert one_by_one, "no expert was read from its own keys"
    for key, items, shape in one_by_one:  # half of each expert, never the whole expert
        assert 2 * items == int(np.prod(shape)), key


def _save_gpt_oss_original(src: Path, dst: Path) -> None:
    """src's mxfp4 gpt-oss in the released checkpoints' layout: gate and up fused with their rows
    interleaved, expert weights as mxfp4 bytes [..., groups, 16], the quantization in
    quantization_config (as mlx-lm's sanitize() and loader expect them)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json", "config.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization")
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(config))
    weights = {}
    for file in src.glob("model*.safetensors"):
        weights.update(mx.load(str(file)))

    def as_blocks(w):  # uint32 [..., in / 8] -> uint8 [..., in / 32, 16]
        b = w.view(mx.uint8)
        return b.reshape(*b.shape[:-1], b.shape[-1] // 16, 16)

    def interleave(gate, up, axis):
        return mx.stack([gate, up], axis=axis + 1).reshape(
            *gate.shape[:axis], 2 * gate.shape[axis], *gate.shape[axis + 1 :])

    out = {}
    for key, value in weights.items():
        if ".experts.up_proj." in key:
            continue
        if ".experts.gate_proj." in key:
            array = key.rsplit(".", 1)[1]
            up = weights[key.replace("gate_proj", "up_proj")]
            fused = interleave(value, up, 1)  # rows: axis 1 of [experts, out, ...]
            base = key.replace("gate_proj." + array, "gate_up_proj")
            out[f"{base}_{'blocks' if array == 'weight' else array}"] = as_blocks(fused) if array == "weight" else fused
        elif ".experts.down_proj." in key:
            array = key.rsplit(".", 1)[1]
            base = key.replace("down_proj." + array, "down_proj")
            out[f"{base}_{'blocks' if array == 'weight' else array}"] = as_blocks(value) if array == "weight" else value
        else:
            out[key] = value
    mx.save_safetensors(str(dst / "model.safetensors"), out)


@pytest.mark.parametrize("rank", [0, 1])
def test_gpt_oss_original_layout_reads_this_ranks_rows_of_the_fused_experts(model_dirs, tmp_path, rank, monkeypatch):
    src = model_dirs["gpt_oss-mxfp4"]
    dst = tmp_path / "gpt_oss-original"
    _save_gpt_oss_original(src, dst)
    want = dict(tree_flatten(load_split(src, RankOnly(rank))[0].parameters()))
    _no_in_memory_cuts(monkeypatch)
    got = dict(tree_flatten(load_split(dst, RankOnly(rank))[0].parameters()))
    assert got.keys() == want.keys()
    for key in got:
        assert got[key].dtype == want[key].dtype and mx.array_equal(got[key], want[key]), key


# ---------------------------------------------------------------------------------------------
# Models that cannot be split say why, and stay whole
# ---------------------------------------------------------------------------------------------


def _qwen3_moe(**overrides):
    from mlx_lm.models import qwen3_moe

    config = {**tiny_models.MOE_FAMILIES["qwen3_moe"][0], **overrides}
    return qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))


def _assert_whole(model):
    assert not any(isinstance(m, _split_layers.SHARDED + (nn.AllToShardedLinear, nn.ShardedToAllLinear)
                              + _split_plans.summed_blocks()) for m in model.modules())
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    fresh = type(model)(model.args)
    assert shapes == {k: v.shape for k, v in tree_flatten(fresh.parameters())} or any(
        isinstance(m, nn.QuantizedLinear) for m in model.modules())


def test_expert_width_that_does_not_divide_is_refused():
    model = _qwen3_moe(moe_intermediate_size=65)
    with pytest.raises(ValueError, match=r"mlx-lm's qwen3_moe plan cannot split "
                                         r"model.layers.0.mlp.switch_mlp.gate_proj across 2 ranks .*65.*"
                                         r"use a model whose head counts and layer widths are multiples of 2"):
        split_model(model, RankOnly(0))
    _assert_whole(model)


def test_expert_quantization_group_that_straddles_the_cut_is_refused():
    import mlx.nn as nn

    model = _qwen3_moe()
    nn.quantize(model, group_size=64, bits=4)
    with pytest.raises(ValueError, match=r"cannot split model.layers.0.mlp.switch_mlp.down_proj across 2 "
                                         r"ranks .*quantized with group_size=64, quantize with a group size"):
        split_model(model, RankOnly(0))
    _assert_whole(model)


def test_more_ranks_than_kv_heads_are_refused_naming_the_count():
    # Three ranks split even as the nearest cut the counts allow (the vocabulary at any row:
    # its 512 rows need not divide by 3), but 2 KV heads cannot give each of 3 ranks one.
    model = _qwen3_moe()
    with pytest.raises(ValueError, match=r"split even across 3 ranks: .* fewer whole units than the 3 ranks.*"
                                         r"model.layers.0.self_attn.n_kv_heads=2.*run it on 2 ranks"):
        split_model(model, RankOnly(0, size=3))
    _assert_whole(model)


def _mixtral():
    from mlx_lm.models import mixtral

    return mixtral.Model(mixtral.ModelArgs.from_dict(tiny_models.MOE_FAMILIES["mixtral"][0]))


def test_unsupported_family_lists_the_supported_ones():
    from mlx_lm.models import gemma

    args = gemma.ModelArgs(model_type="gemma", hidden_size=64, num_hidden_layers=1,
                           intermediate_size=128, num_attention_heads=2, head_dim=32,
                           rms_norm_eps=1e-5, vocab_size=256, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"supported families: .*deepseek_v3.*glm4_moe.*gpt_oss.*qwen3_moe.*"
                                         r"\(mlx-lm's plans\); mixtral, llama4, qwen3_next, .*\(ours\)"):
        split_model(gemma.Model(args), RankOnly(0))


def test_load_split_of_a_moe_reads_only_its_half(tmp_path):
    """Peak RSS of a rank loading its half of a qwen3_moe vs a process loading it whole (~87M params)."""
    import os
    import subprocess
    import sys

    from mlx_ds4tp.synthetic.tiny_model import MoeSizes, save_qwen3_moe
    from splitutil import CHILD

    sizes = MoeSizes(layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64, experts=16,
                     experts_per_token=2, expert_intermediate=768, vocab=8192)
    path = save_qwen3_moe(tmp_path / "rss-moe", sizes)

    def peak(mode: str) -> dict:
        run = subprocess.run(
            [sys.executable, str(CHILD), "rss", "--mode", mode, str(path)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert run.returncode == 0, run.stderr[-4000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    whole, part = peak("whole"), peak("split")
    ratio = part["peak_kb"] / whole["peak_kb"]
    print(f"\npeak RSS: whole {whole['peak_kb'] / 1024:.0f} MiB, one rank's half "
          f"{part['peak_kb'] / 1024:.0f} MiB: ratio {ratio:.3f}", file=sys.stderr)
    assert ratio <= 0.65, f"a rank's peak RSS is {ratio:.3f} of the whole model's (target <= 0.65)"


@pytest.mark.parametrize("family,ring", [("qwen3_moe-q4", True), ("mixtral", False)])
def test_model_bench_runs_moe_models(procs, model_dirs, family, ring):
    """`ds4tp bench --model` on a mixture of experts: our pair's tokens equal the single
    process's; mlx-lm's ring contender runs where mlx-lm has shard() (not mixtral)."""
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--json", "--transport", "tcp", "--model",
                     str(model_dirs[family]), "--max-tokens", "6", "--rounds", "1"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-4000:]
    got = {r["name"]: r for r in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))}
    names = ("single", "tp2-tcp") + (("mlx-lm-ring",) if ring else ())
    for name in names:
        assert got[name]["tok_s"] > 0 and got[name]["tokens_match"] is True, got[name]
    assert ("mlx-lm-ring" in got) == ring
    assert got["tp2-compute-ceiling"]["tok_s"] > 0
