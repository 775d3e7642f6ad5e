"""mlx_ds4tp.model_split: a 50/50 split generates exactly what the unsplit model generates.

Tiny random models of every supported family (tests/tiny_models.py) are saved in mlx-lm's
format; two processes (tests/split_child.py) each load_split one rank's part over a real group
and decode greedily; their tokens and logits are compared with the unsplit model's, decoded in
this process. Splitting and loading checks run in-process with a stand-in group: cutting
weights never talks to the peer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import tiny_models
from mlx_ds4tp.checkpoint import tensor_runs as _tensor_runs
from mlx_ds4tp.model_split import (
    SafetensorsParts,
    VocabParallelEmbedding,
    VocabParallelHead,
    load_split,
    split_model,
)
from splitutil import CHILD, run_ranks, transports, unsplit_references
from tiny_models import RankOnly

# Summation order differs between one matmul and two half matmuls plus a gate; float32 logits
# of these models agree to a few 1e-6.
LOGITS_ATOL = 1e-4


# ---------------------------------------------------------------------------------------------
# Fixtures: the models on disk, the unsplit reference, one pair run per transport
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split-models")
    return {name: tiny_models.build(name, root) for name in tiny_models.FAMILIES}


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, dict]:
    return unsplit_references(model_dirs)


@pytest.fixture(scope="module", params=transports())
def pair(request, model_dirs, tmp_path_factory) -> dict[str, list]:
    return run_ranks(request.param, model_dirs, tmp_path_factory.mktemp(f"pair-{request.param}"))


# ---------------------------------------------------------------------------------------------
# Two ranks generate what one model generates
# ---------------------------------------------------------------------------------------------

FAMILIES = list(tiny_models.FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_split_generates_the_unsplit_tokens(pair, references, family):
    ref = references[family]
    for rank, result in enumerate(pair[family]):
        assert result["tokens"].tolist() == ref["tokens"], f"rank {rank} greedy tokens differ"
        assert result["streamed"].tolist() == ref["streamed"], f"rank {rank} stream_generate differs"
    assert len(ref["tokens"]) == tiny_models.MAX_TOKENS


@pytest.mark.parametrize("family", FAMILIES)
def test_split_logits_match_the_unsplit_logits(pair, references, family):
    for rank, result in enumerate(pair[family]):
        err = np.abs(result["logits"] - references[family]["logits"]).max()
        assert err < LOGITS_ATOL, f"rank {rank}: logits differ by up to {err}"


@pytest.mark.parametrize("family", FAMILIES)
def test_both_ranks_hold_identical_logits(pair, family):
    rank0, rank1 = pair[family]
    assert np.array_equal(rank0["logits"], rank1["logits"])


def test_all_sum_gate_in_user_code(pair):
    """AllSumGate dropped into hand-written code: each rank's partial in, the total out."""
    rank0, rank1 = pair["gate"]
    np.testing.assert_array_equal(rank0["out"], rank0["partial"] + rank1["partial"])
    np.testing.assert_array_equal(rank0["out"], rank1["out"])


# ---------------------------------------------------------------------------------------------
# Cutting and loading (in-process)
# ---------------------------------------------------------------------------------------------


def _load_whole(path: Path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_split_layers_hold_their_half(model_dirs, family):
    path = model_dirs[family]
    whole = dict(tree_flatten(_load_whole(path).parameters()))
    model = split_model(_load_whole(path), RankOnly(1))
    attn = model.model.layers[0].self_attn
    config, _ = tiny_models.FAMILIES[family]
    assert attn.n_heads == config["num_attention_heads"] // 2
    assert attn.n_kv_heads == config["num_key_value_heads"] // 2
    # mlx-lm's own plan cuts the blocks; ours cuts the vocabulary on top.
    assert isinstance(attn.q_proj, (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear))
    assert isinstance(attn.o_proj, (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear))
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    if not config["tie_word_embeddings"]:
        assert isinstance(model.lm_head, VocabParallelHead)

    # Rank 1 holds the second half: rows of column-parallel weights, columns of row-parallel.
    q = whole["model.layers.0.self_attn.q_proj.weight"]
    assert mx.array_equal(attn.q_proj.weight, q[q.shape[0] // 2 :])
    down = whole["model.layers.0.mlp.down_proj.weight"]
    assert mx.array_equal(model.model.layers[0].mlp.down_proj.weight, down[:, down.shape[1] // 2 :])
    # Row-parallel biases stay whole, added once after the gate.
    if config.get("mlp_bias"):
        assert mx.array_equal(model.model.layers[0].mlp.down_proj.bias,
                              whole["model.layers.0.mlp.down_proj.bias"])
    # Column-parallel biases are cut with their outputs (qwen2's q/k/v).
    if "model.layers.0.self_attn.q_proj.bias" in whole:
        qb = whole["model.layers.0.self_attn.q_proj.bias"]
        assert mx.array_equal(attn.q_proj.bias, qb[qb.shape[0] // 2 :])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rank", [0, 1])
def test_reading_parts_from_disk_equals_cutting_in_memory(model_dirs, family, rank):
    path = model_dirs[family]
    from_disk = load_split(path, RankOnly(rank))[0]
    in_memory = load_split(path, RankOnly(rank), lazy=False)[0]
    a, b = dict(tree_flatten(from_disk.parameters())), dict(tree_flatten(in_memory.parameters()))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and mx.array_equal(a[key], b[key]), key


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32])
def test_safetensors_parts_along_both_axes(tmp_path, monkeypatch, dtype):
    # Small read chunks so the column cut takes several steps and a ragged last one.
    monkeypatch.setattr(_tensor_runs, "READ_CHUNK_BYTES", 150)
    mx.random.seed(1)
    tensors = {
        "matrix": (mx.random.normal((20, 12)) * 100).astype(dtype),  # 3 or 6 rows a chunk, then 2
        "cube": (mx.random.normal((4, 3, 8)) * 100).astype(dtype),
        "vector": (mx.random.normal((8,)) * 100).astype(dtype),
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    for size in (2, 4):
        for rank in range(size):
            parts = SafetensorsParts(tmp_path, rank, size)
            for key, whole in tensors.items():
                for axis in (0, -1) if whole.ndim > 1 else (0,):
                    got = parts(key, whole, axis)
                    want = mx.split(whole, size, axis=axis)[rank]
                    assert got.dtype == dtype and mx.array_equal(got, want), (key, axis, rank, size)
    # Anything that does not match the file is left to the in-memory cut.
    parts = SafetensorsParts(tmp_path, 0, 2)
    assert parts("missing", tensors["matrix"], 0) is None
    assert parts("matrix", tensors["matrix"].T, 0) is None


def test_load_split_reads_only_its_half(tmp_path):
    """Peak RSS of a rank loading its half vs a process loading the whole model (~88M params)."""
    from mlx_ds4tp.synthetic.tiny_model import LlamaSizes, save_llama

    sizes = LlamaSizes(layers=6, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=8192)
    path = save_llama(tmp_path / "rss-model", sizes)

    def peak(mode: str) -> dict:
        run = subprocess.run(
            [sys.executable, str(CHILD), "rss", "--mode", mode, str(path)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert run.returncode == 0, run.stderr[-4000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    whole, part = peak("whole"), peak("split")
    ratio = part["peak_kb"] / whole["peak_kb"]
    growth = (part["peak_kb"] - part["baseline_kb"]) / (whole["peak_kb"] - whole["baseline_kb"])
    print(
        f"\npeak RSS: whole model {whole['peak_kb'] / 1024:.0f} MiB, one rank's half "
        f"{part['peak_kb'] / 1024:.0f} MiB: ratio {ratio:.3f} (growth over the "
        f"{whole['baseline_kb'] / 1024:.0f} MiB import baseline: {growth:.3f})",
        file=sys.stderr,
    )
    assert ratio <= 0.65, f"a rank's peak RSS is {ratio:.3f} of the whole model's (target <= 0.65)"


# ---------------------------------------------------------------------------------------------
# Models that cannot be split say why, and stay whole
# ---------------------------------------------------------------------------------------------


def _llama(**overrides):
    from mlx_lm.models import llama

    config = {**tiny_models.FAMILIES["llama"][0], **overrides}
    return llama.Model(llama.ModelArgs.from_dict(config))


def _assert_whole(model):
    assert isinstance(model.model.layers[0].self_attn.q_proj, (nn.Linear, nn.QuantizedLinear))
    assert isinstance(model.model.embed_tokens, (nn.Embedding, nn.QuantizedEmbedding))


def test_odd_kv_heads_are_refused():
    model = _llama(num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.n_kv_heads=1 .*cannot be split "
                                         r"across 2 ranks .*use a model whose head counts .* are multiples of 2"):
        split_model(model, RankOnly(0))
    _assert_whole(model)


def test_odd_heads_are_refused():
    model = _llama(hidden_size=96, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.n_heads=3 .*cannot be split across 2 ranks"):
        split_model(model, RankOnly(0))
    _assert_whole(model)


def test_quantization_group_that_straddles_the_cut_is_refused():
    # o_proj has 4 heads x 48 = 192 inputs: 96 per rank, not a multiple of group_size 64.
    model = _llama(hidden_size=192, num_attention_heads=4, num_key_value_heads=2)
    nn.quantize(model, group_size=64, bits=4)
    with pytest.raises(ValueError, match=r"cannot split model.layers.0.self_attn.o_proj across 2 ranks "
                                         r".*quantized with group_size=64, quantize with a group size"):
        split_model(model, RankOnly(0))
    _assert_whole(model)


def test_odd_vocabulary_is_refused():
    model = _llama(vocab_size=511)
    with pytest.raises(ValueError, match=r"model.embed_tokens: 511 output features cannot be split"):
        split_model(model, RankOnly(0))
    _assert_whole(model)


def test_unsupported_family_is_refused():
    from mlx_lm.models import gemma

    args = gemma.ModelArgs(model_type="gemma", hidden_size=64, num_hidden_layers=1,
                           intermediate_size=128, num_attention_heads=2, head_dim=32,
                           rms_norm_eps=1e-5, vocab_size=256, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"model_type='gemma' .* supported families: .*llama.*qwen3_moe.*"
                                         r"\(mlx-lm's plans\); mixtral, llama4, "
                                         r"qwen3_next, dots1, .*kimi_linear \(ours\)"):
        split_model(gemma.Model(args), RankOnly(0))


def test_splitting_twice_is_refused():
    model = split_model(_llama(), RankOnly(0))
    with pytest.raises(ValueError, match=r"already split"):
        split_model(model, RankOnly(0))


def test_load_split_of_a_missing_directory_names_it(tmp_path):
    # mlx-lm would take the missing path for a Hugging Face repo id and try to download it.
    with pytest.raises(FileNotFoundError, match=r"no config.json"):
        load_split(tmp_path / "nowhere", RankOnly(0))


class CountingCollective(RankOnly):
    """A collective of the user's own."""

    def all_sum(self, x):
        return x

    def all_gather(self, x):
        return x


def test_a_collective_of_the_users_own_is_refused():
    # The plans' layers call mx.distributed themselves: the object's all_sum would be bypassed.
    model = _llama()
    with pytest.raises(TypeError, match=r"CountingCollective is not an mx.distributed.Group; the split "
                                        r"plans run their gates through mx.distributed"):
        split_model(model, CountingCollective(0))
    _assert_whole(model)


def test_a_group_without_collectives_is_refused_at_the_first_gate():
    model = split_model(_llama(), RankOnly(0))  # cutting needs only rank() and size()
    with pytest.raises(TypeError, match=r"has no all_sum\(x\) method; pass the group from mlx_ds4tp.init"):
        model(mx.array([[1, 2]]))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_prefill_fills_the_same_cache_as_the_unsplit_model(tmp_path, family):
    """lockstep.fill_cache evaluates only the cache, chunk by chunk, as mlx-lm prefills: the
    cache holds exactly what the unsplit model puts there. (Which gates that evaluation runs
    over a real pair, the last block's and the logits gather left out on both ranks:
    tests/test_backend.py.)"""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_ds4tp.lockstep.compute import fill_cache

    path = tiny_models.build(family, tmp_path)
    whole = _load_whole(path)
    split = split_model(_load_whole(path), mx.distributed.init())  # a group of one
    tokens = list(range(3, 40))
    whole_cache, split_cache = make_prompt_cache(whole), make_prompt_cache(split)
    fill_cache(whole, tokens, whole_cache, step=16)
    fill_cache(split, tokens, split_cache, step=16)
    for mine, ref in zip(split_cache, whole_cache):
        for (_, a), (_, b) in zip(tree_flatten(mine.state), tree_flatten(ref.state)):
            if isinstance(a, mx.array):
                assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()
            else:
                assert a == b
