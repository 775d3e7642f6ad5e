"""The split for N ranks (N = 3, 4): `even` as the nearest cut the counts allow, A:B:C[:D] in whole
units, `auto` from N ranks' figures, the errors, each rank's bytes.

In one process, with no transport: each rank's part is loaded with load_split(..., cut_only_group(r,
N)) and the N parts decode together in tests/localranks.py, which reduces every all_sum and
all_gather in rank order. A dense llama with 8 KV heads (3:3:2 at N = 3 even), qwen3_moe and
deepseek_v3 (MLA heads, routed and shared experts) with 8 heads and 8 groups of 32 expert columns,
4-bit llama and qwen3_moe (in whole quantization groups), and our own plans (qwen3_next's gated
delta-net, mixtral) with counts in quarters: the unsplit model's greedy tokens, logits within 1e-4
relative, identical on every rank. Each rank reads its parts from the safetensors file, equal to
its parts cut in memory. The 156M llama's proportions at N = 4 even: each rank holds at most 0.40x
of the whole model's bytes (and, marked slow, of its peak resident memory above the baseline).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

import family_configs_a
import family_configs_b
import family_configs_own
import tiny_models
from localranks import LocalRanks
from mlx_ds4tp.collectives.backend import cut_only_group
from mlx_ds4tp.link.hello import RankFigures
from mlx_ds4tp.model_split import load_split
from mlx_ds4tp.split import apply as _apply, units as _units
from mlx_ds4tp.split.auto import ModelNeed, choose_share, choose_share_among
from mlx_ds4tp.split.errors import ShareRefusedError
from mlx_ds4tp.split.share import EVEN, SplitShare, UnitCut, nearest_cuts
from mlx_ds4tp.synthetic.tiny_model import PRESETS, LlamaSizes, llama_config, save_random_model
from splitutil import our_meshes, run_ranks, transports

LOGITS_RTOL = 1e-4
TOKENS = 16

_EIGHT = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
          "intermediate_size": 256, "vocab_size": 500, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 2048, "tie_word_embeddings": False}
# 8 KV heads (or MLA heads) and 256 MLP and expert columns (8 groups of 32): 3:3:2 at N = 3 even.
CONFIGS = {
    "llama": {**_EIGHT, "model_type": "llama", "num_hidden_layers": 2, "attention_bias": True,
              "mlp_bias": True, "tie_word_embeddings": True},
    "qwen3_moe": {**_EIGHT, "model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                  "moe_intermediate_size": 256, "norm_topk_prob": True},
    "deepseek_v3": {**_EIGHT, "model_type": "deepseek_v3", "num_hidden_layers": 3, "moe_intermediate_size": 256,
                    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
                    "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 16,
                    "qk_nope_head_dim": 16, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1},
}
# Our own plans, with counts in quarters (tests/test_split_families.py's QUARTERS).
OWN = {
    "qwen3_next": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "linear_num_value_heads": 8,
                   "linear_num_key_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "intermediate_size": 128, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
    "mixtral": {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128},
}
# 4-bit, group size 32: o_proj's 256 inputs and the experts' 256 columns are 8 groups.
QUANTIZED = {"llama-q4": {**CONFIGS["llama"], "hidden_size": 256, "head_dim": 32},
             "qwen3_moe-q4": {**CONFIGS["qwen3_moe"], "hidden_size": 256, "head_dim": 32}}
# (ranks, --split, the cut every count takes)
CASES = [(3, "even", (3, 3, 2)), (3, "2:1:1", (2, 1, 1)), (4, "even", (1, 1, 1, 1)), (4, "1:2:3:2", (1, 2, 3, 2))]
# (quarters cannot give 2:1:2:3 on four ranks: one unit each is the nearest)
OWN_CASES = [(3, "even", (2, 1, 1)), (3, "1:1:2", (1, 1, 2)), (4, "even", (1, 1, 1, 1)), (4, "2:1:2:3", (1, 1, 1, 1))]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nranks-models")
    dirs = {name: save_random_model(root / name, config) for name, config in CONFIGS.items()}
    for name, counts in OWN.items():
        dirs[name] = save_random_model(root / name, {**family_configs_own.CONFIGS[name][0], **counts})
    for name, config in QUANTIZED.items():
        dirs[name] = save_random_model(root / name, config, quantization={"group_size": 32, "bits": 4})
    return dirs


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, tuple[list[int], np.ndarray]]:
    out = {}
    for name, path in model_dirs.items():
        model, tokenizer = mlx_lm.load(str(path))
        out[name] = tiny_models.greedy_decode(model, tokenizer.encode(tiny_models.PROMPT), TOKENS)
    return out


def _parts(path: Path, size: int, split: str, **kwargs) -> list:
    return [load_split(path, cut_only_group(rank, size), split=split, **kwargs)[0] for rank in range(size)]


def _decode_together(models: list, prompt: list[int]) -> list:
    return LocalRanks(len(models)).run([lambda m=m: tiny_models.greedy_decode(m, prompt, TOKENS) for m in models])


def _check_ranks(results: list, ref: tuple, label: str) -> float:
    tokens, logits = ref
    for rank, (got_tokens, got_logits) in enumerate(results):
        assert got_tokens == tokens, f"{label}: rank {rank}'s greedy tokens differ"
        assert np.array_equal(got_logits, results[0][1]), f"{label}: rank {rank}'s logits differ from rank 0's"
    err = float(np.abs(results[0][1] - logits).max() / np.abs(logits).max())
    print(f"\n{label}: max relative logit error {err:.2e}", file=sys.stderr)
    assert err <= LOGITS_RTOL, f"{label}: logits differ by {err:.2e} relative"
    return err


def _heads_of(model) -> int:
    attn = model.model.layers[0].self_attn
    for name in ("n_kv_heads", "num_key_value_heads", "num_heads"):
        if hasattr(attn, name):
            return getattr(attn, name)
    raise AssertionError("no head count")


# ---------------------------------------------------------------------------------------------
# N ranks generate what one model generates
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size, split, cut", CASES, ids=[f"{n}-{s}" for n, s, _ in CASES])
@pytest.mark.parametrize("family", CONFIGS)
def test_n_ranks_generate_the_unsplit_tokens(model_dirs, references, family, size, split, cut):
    path = model_dirs[family]
    models = _parts(path, size, split)
    heads = [_heads_of(m) for m in models]
    assert heads == [8 * c // sum(cut) for c in cut], f"{family} at {split} on {size}: heads {heads}"
    prompt = mlx_lm.load(str(path))[1].encode(tiny_models.PROMPT)
    _check_ranks(_decode_together(models, prompt), references[family], f"{family} on {size} ranks at {split}")


@pytest.mark.parametrize("size, split, cut", OWN_CASES, ids=[f"{n}-{s}" for n, s, _ in OWN_CASES])
@pytest.mark.parametrize("family", OWN)
def test_our_own_plans_on_n_ranks(model_dirs, references, family, size, split, cut):
    path = model_dirs[family]
    models = _parts(path, size, split)
    kv = [m.model.layers[-1].self_attn.num_key_value_heads for m in models]  # a full-attention layer
    assert kv == [4 * c // sum(cut) for c in cut], f"{family} at {split} on {size}: KV heads {kv}"
    prompt = mlx_lm.load(str(path))[1].encode(tiny_models.PROMPT)
    _check_ranks(_decode_together(models, prompt), references[family], f"{family} on {size} ranks at {split}")


@pytest.mark.parametrize("size, split, cut", CASES[:3], ids=[f"{n}-{s}" for n, s, _ in CASES[:3]])
@pytest.mark.parametrize("family", QUANTIZED)
def test_quantized_models_on_n_ranks(model_dirs, references, family, size, split, cut):
    path = model_dirs[family]
    models = _parts(path, size, split)
    # o_proj's packed inputs and their scales in whole groups of 32 (one group a head here)
    assert [m.model.layers[0].self_attn.o_proj.scales.shape[1] for m in models] == [8 * c // sum(cut) for c in cut]
    prompt = mlx_lm.load(str(path))[1].encode(tiny_models.PROMPT)
    _check_ranks(_decode_together(models, prompt), references[family], f"{family} on {size} ranks at {split}")


def test_the_experts_split_n_ways(model_dirs):
    """qwen3_moe at 3:3:2: every expert's columns (and deepseek_v3's shared expert's) in whole
    groups of 32, each rank its run; the router whole on every rank."""
    for rank, units in enumerate((3, 3, 2)):
        model, _ = load_split(model_dirs["qwen3_moe"], cut_only_group(rank, 3))
        moe = model.model.layers[0].mlp
        assert moe.switch_mlp.gate_proj.weight.shape == (8, 32 * units, 128)
        assert moe.switch_mlp.down_proj.weight.shape == (8, 128, 32 * units)
        assert moe.gate.weight.shape == (8, 128)
        deepseek, _ = load_split(model_dirs["deepseek_v3"], cut_only_group(rank, 3))
        mlp = deepseek.model.layers[1].mlp
        assert mlp.switch_mlp.up_proj.weight.shape == (8, 32 * units, 128)
        assert mlp.shared_experts.gate_proj.weight.shape == (32 * units, 128)
        assert deepseek.model.layers[0].self_attn.num_heads == units


# ---------------------------------------------------------------------------------------------
# even says the shares it chose; each rank reads its own bytes
# ---------------------------------------------------------------------------------------------


def test_even_on_three_ranks_says_the_shares_it_chose(model_dirs, monkeypatch):
    messages = []
    monkeypatch.setattr(_units, "log", messages.append)
    monkeypatch.setattr(_apply, "log", messages.append)
    load_split(model_dirs["llama"], cut_only_group(2, 3))
    chose = [m for m in messages if m.startswith("split even across 3 ranks: using 3:3:2")]
    assert chose and "n_kv_heads=8" in chose[0] and "do not divide into 3" in chose[0], messages
    assert "rank 2 keeps 2 of 8 units of every split count (split 3:3:2)" in messages, messages


def test_even_on_four_ranks_that_divide_is_the_plans_own(model_dirs, monkeypatch):
    messages = []
    monkeypatch.setattr(_units, "log", messages.append)
    monkeypatch.setattr(_apply, "log", messages.append)
    model, _ = load_split(model_dirs["llama"], cut_only_group(3, 4))
    assert _heads_of(model) == 2
    assert not [m for m in messages if "split" in m and "using" in m], messages
    # 500 vocabulary rows on 4 ranks: 125 each, cut at any row.
    assert model.model.embed_tokens.embedding.weight.shape == (125, 128)


@pytest.mark.parametrize("split", ["even", "2:1:1"])
@pytest.mark.parametrize("family", [*CONFIGS, *OWN, *QUANTIZED])
def test_each_rank_reads_its_parts_from_the_file_at_three_ranks(model_dirs, family, split, monkeypatch):
    path = model_dirs[family]
    for rank in range(3):
        group = cut_only_group(rank, 3)
        in_memory = dict(tree_flatten(load_split(path, group, split=split, lazy=False)[0].parameters()))
        messages = []
        monkeypatch.setattr(_apply, "log", messages.append)
        from_disk = dict(tree_flatten(load_split(path, group, split=split)[0].parameters()))
        monkeypatch.undo()
        assert not [m for m in messages if "read whole" in m], messages
        assert from_disk.keys() == in_memory.keys()
        for key in from_disk:
            assert from_disk[key].dtype == in_memory[key].dtype and mx.array_equal(from_disk[key], in_memory[key]), \
                f"{family} rank {rank}: {key}"


FAMILY_CONFIGS = {**family_configs_a.CONFIGS, **family_configs_b.CONFIGS, **family_configs_own.CONFIGS}


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_every_family_at_three_ranks_splits_or_names_the_counts(family, tmp_path):
    """tests/family_configs_*'s checkpoints have 2 KV heads or 2 groups of 32 columns: three
    ranks cannot each have one, which every family says naming the counts and the ranks that fit."""
    config, quantization = FAMILY_CONFIGS[family]
    path = save_random_model(tmp_path / family, config, quantization=quantization)
    try:
        model, _ = load_split(path, cut_only_group(0, 3))
    except ValueError as refusal:
        assert "split even across 3 ranks: no cut of every count into whole units gives each of the 3 ranks a part" \
            in str(refusal) and "fewer whole units than the 3 ranks" in str(refusal), str(refusal)
        assert "run it on 2" in str(refusal), str(refusal)
        return
    whole, _ = mlx_lm.load(str(path))
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert held < sum(v.nbytes for _, v in tree_flatten(whole.parameters())), f"{family}: rank 0 holds the whole"


# ---------------------------------------------------------------------------------------------
# Bad shares are clear errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split, message", [
    ("3:1", r"split=3:1 names 2 parts for a group of 3 ranks; give one part per rank, rank 0's first "
            r"\(e\.g\. 2:1:1\), or even"),
    ("0:1:1", r"split='0:1:1' leaves a rank with nothing; every rank needs a part above zero"),
    ("a:b:c", r"split='a:b:c' is not a share; write even, auto, or A:B\[:C\.\.\.\] with one whole number per rank"),
    ("1:1:1:1:1:1:1:1:1", r"names 9 ranks; a group has at most 8"),
])
def test_a_bad_share_names_the_value_and_the_fix(model_dirs, split, message):
    with pytest.raises(ValueError, match=message):
        load_split(model_dirs["llama"], cut_only_group(0, 3), split=split)


@pytest.mark.parametrize("split", ["even", "2:1:1"])
def test_more_ranks_than_kv_heads_names_the_count_and_the_fix(tmp_path, split):
    two = save_random_model(tmp_path / "kv2", {**CONFIGS["llama"], "num_key_value_heads": 2})
    with pytest.raises(ValueError, match=rf"split {'even across 3 ranks' if split == 'even' else split}: no cut of "
                                         r"every count into whole units gives each of the 3 ranks a part .*"
                                         r"model.layers.0.self_attn.n_kv_heads=2.*run it on 2 ranks"):
        load_split(two, cut_only_group(1, 3), split=split)


def test_five_ranks_of_four_kv_heads_are_refused_naming_the_ranks_that_fit(tmp_path, model_dirs):
    four = save_random_model(tmp_path / "kv4", {**CONFIGS["llama"], "num_key_value_heads": 4})
    with pytest.raises(ValueError, match=r"fewer whole units than the 5 ranks.*n_kv_heads=4.*run it on 2 or 3 or 4 "
                                         r"ranks, which its counts allow"):
        load_split(four, cut_only_group(0, 5))
    # Eight KV heads on five ranks: 2:2:2:1:1, the nearest.
    assert [_heads_of(load_split(model_dirs["llama"], cut_only_group(r, 5))[0]) for r in range(5)] == [2, 2, 2, 1, 1]


def test_the_cli_checks_the_parts_against_the_ranks():
    from mlx_ds4tp.cli.split_args import add_split_arg, split_from_args

    parser = argparse.ArgumentParser()
    add_split_arg(parser)
    with pytest.raises(SystemExit, match=r"ds4tp run: --split 2:1:1 names 3 parts for 2 ranks; give one part "
                                         r"per rank, rank 0's first \(e\.g\. 2:1\)"):
        split_from_args(parser.parse_args(["--split", "2:1:1"]), "run")
    args = parser.parse_args(["--split", "2:1:1"])
    assert split_from_args(args, "run", 3).share == SplitShare((2, 1, 1))
    with pytest.raises(SystemExit, match=r"names 3 parts for 4 ranks.*e\.g\. 2:1:1:1"):
        split_from_args(args, "run", 4)
    # A worker that takes its leader's size (no --ranks) cannot check its parts: the leader's decide.
    assert split_from_args(args, "run", None).share == SplitShare((2, 1, 1))


# ---------------------------------------------------------------------------------------------
# The cuts, and auto for N ranks (pure arithmetic)
# ---------------------------------------------------------------------------------------------


def test_the_nearest_cuts_for_n_ranks():
    assert nearest_cuts(EVEN, 3, 8)[0] == UnitCut((3, 3, 2))
    assert nearest_cuts(EVEN, 4, 8)[0] == UnitCut((1, 1, 1, 1))
    assert nearest_cuts(EVEN, 3, 12)[0] == UnitCut((1, 1, 1))
    assert nearest_cuts(SplitShare.parse("2:1:1"), 3, 8)[0] == UnitCut((2, 1, 1))
    # 3:2:1 on quarters: 2:1:1 overloads rank 1 by 1.5x; eighths give 4:3:1 (1.33x) before it.
    assert nearest_cuts(SplitShare.parse("3:2:1"), 3, 8)[:2] == [UnitCut((4, 3, 1)), UnitCut((2, 1, 1))]
    assert nearest_cuts(EVEN, 3, 2) == []  # 2 units cannot give 3 ranks one each
    # Every rank under its cap: rank 2 may hold at most a tenth (9:9:2, a step of 1.35x, before 5:5:1 at 1.36x).
    assert nearest_cuts(EVEN, 3, 5040, caps=(1.0, 1.0, 0.1))[0] == UnitCut((9, 9, 2))


def _fig(memory: int, speed: int) -> RankFigures:
    return RankFigures(memory_bytes=memory, speed=speed)


GB = 10**9


def test_auto_takes_n_ranks_figures():
    big = 512 * GB
    assert choose_share_among([_fig(big, 200 * GB), _fig(big, 100 * GB), _fig(big, 100 * GB)],
                              ModelNeed(GB), granules=4) == SplitShare((2, 1, 1))
    assert choose_share_among([_fig(big, 100 * GB), _fig(big, 105 * GB), _fig(big, 108 * GB)], ModelNeed(GB)) == EVEN
    # 8 KV heads: the even cut is 3:3:2, and each rank's memory is checked on its part of it.
    assert choose_share_among([_fig(big, 100 * GB)] * 3, ModelNeed(GB), granules=8) == SplitShare((3, 3, 2))
    # Rank 2 holds at most a sixth of the model: the others take the rest.
    need = ModelNeed(60 * GB)
    small = int(need.total * 1.1 / 6) + (512 << 20)
    share = choose_share_among([_fig(big, 100 * GB), _fig(big, 100 * GB), _fig(small, 100 * GB)], need)
    assert share.parts[2] / sum(share.parts) <= 1 / 6 and share.parts[0] == share.parts[1], share
    with pytest.raises(ShareRefusedError, match=r"rank 0 may use 8.* rank 1 may use 6.* rank 2 may use 6"):
        choose_share_among([_fig(8 * 2**30, GB), _fig(6 * 2**30, GB), _fig(6 * 2**30, GB)], ModelNeed(40 * GB))
    with pytest.raises(ValueError, match=r"split auto: rank 2 reported no figures"):
        choose_share_among([_fig(big, GB), _fig(big, GB), _fig(0, 0)], ModelNeed(GB))


@pytest.mark.parametrize("speeds", [(100, 100), (200, 100), (210, 100), (100, 300), (819, 546), (170, 100)])
@pytest.mark.parametrize("granules", [1, 4, 8, 12, 5040])
def test_auto_for_a_pair_is_the_n_rank_arithmetic_at_two(speeds, granules):
    figures = [_fig(512 * GB, s * GB) for s in speeds]
    assert choose_share(*figures, ModelNeed(GB), granules=granules) == \
        choose_share_among(figures, ModelNeed(GB), granules=granules)


def test_model_cuts_for_n_ranks(model_dirs):
    from mlx_ds4tp.split.apply import ModelCuts

    cuts = ModelCuts(model_dirs["llama"])
    assert cuts.parts(EVEN, 3) == pytest.approx((3 / 8, 3 / 8, 2 / 8), abs=0.01)
    assert cuts.parts(EVEN, 4) == pytest.approx((0.25,) * 4, abs=0.01)
    assert cuts.parts(SplitShare((2, 1, 1)), 3) == pytest.approx((0.5, 0.25, 0.25), abs=0.01)
    assert cuts.kept(SplitShare((3, 1))) == pytest.approx(0.75, abs=0.01)


# ---------------------------------------------------------------------------------------------
# Each rank holds its share of the bytes (the 156M llama's proportions, N = 4 even)
# ---------------------------------------------------------------------------------------------


def test_four_ranks_each_hold_about_a_quarter(tmp_path):
    """The 150m preset (8 layers, 16 heads, 8 KV heads, untied 32000-row vocabulary) with its
    widths and vocabulary a quarter as large: each rank's parameter bytes at most 0.40x the
    whole model's (the norms stay whole on every rank)."""
    big = PRESETS["150m"]
    sizes = LlamaSizes(layers=big.layers, hidden=big.hidden // 4, heads=big.heads, kv_heads=big.kv_heads,
                       intermediate=big.intermediate // 4, vocab=big.vocab // 4)
    path = save_random_model(tmp_path / "llama-150m-quarter", llama_config(sizes))
    whole_model, _ = mlx_lm.load(str(path))
    whole = sum(v.nbytes for _, v in tree_flatten(whole_model.parameters()))
    del whole_model
    held = [sum(v.nbytes for _, v in tree_flatten(m.parameters())) for m in _parts(path, 4, "even")]
    fractions = [h / whole for h in held]
    print(f"\n150m-shaped llama at N=4 even: whole {whole / 2**20:.1f} MiB, each rank's part "
          + ", ".join(f"{f:.3f}" for f in fractions), file=sys.stderr)
    assert max(fractions) <= 0.40, fractions
    assert sum(held) >= whole  # nothing lost: the parts and the whole-on-every-rank norms


def _peak(mode: str, path: Path, rank: int = 0, size: int = 2) -> dict:
    import json
    import os
    import subprocess

    from splitutil import CHILD

    run = subprocess.run([sys.executable, str(CHILD), "rss", "--mode", mode, "--rank", str(rank), "--size", str(size),
                          str(path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_four_ranks_of_the_156m_llama_each_peak_near_a_quarter(tmp_path):
    """The 156M llama in float32 (640 MB) at N = 4 even, each rank loading its part in its own
    process: its peak resident memory above the import baseline at most 0.40x the whole model's
    (mlx_lm.load) above its baseline."""
    path = save_random_model(tmp_path / "llama-150m", llama_config(PRESETS["150m"]))
    whole = _peak("whole", path)
    whole_kb = whole["peak_kb"] - whole["baseline_kb"]
    parts = [_peak("split", path, rank, 4) for rank in range(4)]
    ratios = [(p["peak_kb"] - p["baseline_kb"]) / whole_kb for p in parts]
    print(f"\n156M llama at N=4 even: whole {whole_kb / 1024:.0f} MiB above the baseline "
          f"({whole['peak_kb'] / 1024:.0f} MiB peak); each rank "
          + ", ".join(f"{r:.3f}" for r in ratios)
          + f" of it ({', '.join(str(p['peak_kb'] // 1024) for p in parts)} MiB peak)", file=sys.stderr)
    assert max(ratios) <= 0.40, ratios


# ---------------------------------------------------------------------------------------------
# Over a real group of N processes (our mesh, where this tree has it: tp.init(size=N))
# ---------------------------------------------------------------------------------------------


MESH_TRANSPORTS = [t for t in ("tcp", "rdma") if t in transports()]


@pytest.mark.skipif(not our_meshes(), reason="our groups take two ranks here (no init(size=N))")
@pytest.mark.parametrize("size, split", [(3, "even"), (3, "2:1:1"), (4, "even")])
@pytest.mark.parametrize("transport", MESH_TRANSPORTS)
def test_n_processes_over_our_mesh(model_dirs, references, transport, size, split, tmp_path):
    """Each rank its own process over tcp or the emulated RDMA device: the unsplit tokens, logits
    within 1e-4, identical on every rank, each rank's weights in proportion to its share."""
    dirs = {family: model_dirs[family] for family in CONFIGS}
    results = run_ranks(transport, dirs, tmp_path, ranks=size, split=split)
    for family in dirs:
        tokens, logits = references[family]
        parts = results[family]
        for rank, part in enumerate(parts):
            assert part["tokens"].tolist()[:TOKENS] == tokens, f"{family} over {transport}: rank {rank}'s tokens"
            assert np.array_equal(part["logits"], parts[0]["logits"]), f"{family}: rank {rank}'s logits differ"
        err = float(np.abs(parts[0]["logits"][:TOKENS] - logits).max() / np.abs(logits).max())
        assert err <= LOGITS_RTOL, f"{family} on {size} ranks at {split} over {transport}: {err:.2e}"
