"""mlx_ds4tp.split.share and split/units.py: an uneven split (3:1, 2:1) generates what one model does.

Tiny models whose head counts (12 KV heads) and MLP and expert widths (12 groups of 32 columns)
divide into 3 and 4 units: a dense pair (llama, qwen3) and a MoE pair (qwen3_moe, deepseek_v3 with
MLA). Two processes each load_split their share over a real group (TCP, the emulated RDMA device)
and decode greedily: the unsplit model's tokens, logits within 1e-4 relative, identical on both
ranks; each rank holds weights in proportion to its share. In-process: the share's parsing and
errors, each rank's counts, its parts read from the file equal to its parts cut in memory, and the
nearest share when the counts cannot give the one asked for. With 4 KV heads beside 12 groups of MLP
columns, 2:1 cuts the attention 3:1 and the columns and vocabulary 2:1: still the unsplit tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import tiny_models
from mlx_ds4tp.collectives.backend import cut_only_group
from mlx_ds4tp.model_split import load_split
from mlx_ds4tp.split import apply as _apply, units as _units
from mlx_ds4tp.split.share import SplitShare, UnitCut, nearest_cuts
from mlx_ds4tp.synthetic.tiny_model import PRESETS, llama_config, save_random_model
from splitutil import CHILD, run_ranks, transports, unsplit_references

_TWELVE = {"hidden_size": 192, "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 16,
           "intermediate_size": 384, "vocab_size": 500, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 2048, "tie_word_embeddings": False}
CONFIGS = {
    "llama": {**_TWELVE, "model_type": "llama", "num_hidden_layers": 2, "attention_bias": True,
              "mlp_bias": True, "tie_word_embeddings": True},
    "qwen3": {**_TWELVE, "model_type": "qwen3", "num_hidden_layers": 2},
    "qwen3_moe": {**_TWELVE, "model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                  "moe_intermediate_size": 384, "norm_topk_prob": True},
    "deepseek_v3": {**_TWELVE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "moe_intermediate_size": 384,
                    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
                    "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 16,
                    "qk_nope_head_dim": 16, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1},
}
SHARES = {"3:1": (3, 1), "2:1": (2, 1)}
LOGITS_RTOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("share-models")
    return {name: save_random_model(root / name, config) for name, config in CONFIGS.items()}


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, dict]:
    return unsplit_references(model_dirs)


# ---------------------------------------------------------------------------------------------
# The share
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, parts", [("even", ()), ("3:1", (3, 1)), ("6:2", (3, 1)), ("2:2", ()),
                                         (" 2:1 ", (2, 1)), ("1:3", (1, 3))])
def test_a_share_parses_to_its_lowest_terms(text, parts):
    share = SplitShare.parse(text)
    assert share.parts == parts and not share.auto
    assert share.is_even == (parts == ())


def test_auto_parses_but_load_split_refuses_it_unresolved(model_dirs):
    assert SplitShare.parse("auto").auto
    with pytest.raises(ValueError, match=r"split='auto' is resolved at the hello"):
        load_split(model_dirs["llama"], cut_only_group(0, 2), split="auto")


@pytest.mark.parametrize("text, message", [
    ("3", r"split='3' is not a share; write even, auto, or A:B"),
    ("a:b", r"split='a:b' is not a share"),
    ("3:1.5", r"split='3:1.5' is not a share"),
    ("3:0", r"split='3:0' leaves a rank with nothing"),
    ("0:1", r"split='0:1' leaves a rank with nothing"),
    ("-1:2", r"split='-1:2' leaves a rank with nothing"),
])
def test_a_bad_share_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        SplitShare.parse(text)


def test_a_share_needs_one_part_per_rank(model_dirs):
    with pytest.raises(ValueError, match=r"split=3:2:1 names 3 parts for a group of 2 ranks"):
        load_split(model_dirs["llama"], cut_only_group(0, 2), split="3:2:1")


def test_the_vocabulary_is_cut_in_proportion_at_any_row():
    assert UnitCut((3, 1)).bounds(500) == (0, 375, 500)
    assert UnitCut((2, 1)).bounds(500) == (0, 333, 500)
    assert UnitCut((1, 1)).bounds(512) == (0, 256, 512)


def test_the_nearest_cuts_come_first():
    share = SplitShare.parse("3:1")
    assert nearest_cuts(share, 2, 8)[0] == UnitCut((3, 1))
    # Nearest in step time: 5:1 overloads the faster rank by 1.11x, 2:1 the slower by 1.33x.
    assert nearest_cuts(share, 2, 6)[:2] == [UnitCut((5, 1)), UnitCut((2, 1))]
    # Equal steps (2:1 on eighths: 5:3 and 3:1 both 1.125x): the nearer first.
    assert nearest_cuts(SplitShare.parse("2:1"), 2, 8)[:2] == [UnitCut((5, 3)), UnitCut((3, 1))]
    # 15:7 on eighths: 3:1 (1.10x) before the nearer 5:3 (1.18x).
    assert nearest_cuts(SplitShare.parse("15:7"), 2, 8)[0] == UnitCut((3, 1))
    assert nearest_cuts(share, 2, 2) == [UnitCut((1, 1))]
    assert nearest_cuts(SplitShare.parse("2:1"), 2, 12)[0] == UnitCut((2, 1))


# ---------------------------------------------------------------------------------------------
# Cutting and reading (in-process)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", SHARES)
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_its_share_of_every_count(model_dirs, split, rank):
    units = SHARES[split][rank]
    whole = sum(SHARES[split])
    model, _ = load_split(model_dirs["qwen3_moe"], cut_only_group(rank, 2), split=split)
    attn = model.model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv_heads) == (12 * units // whole,) * 2
    # each rank's query heads with their KV heads: q and k/v keep the same heads
    assert attn.q_proj.weight.shape[0] == attn.k_proj.weight.shape[0] == 16 * 12 * units // whole
    assert model.model.layers[0].mlp.switch_mlp.gate_proj.weight.shape == (8, 384 * units // whole, 192)
    assert model.model.layers[1].mlp.down_proj.weight.shape == (192, 384 * units // whole)
    bounds = UnitCut(SHARES[split]).bounds(500)
    assert model.model.embed_tokens.embedding.weight.shape[0] == bounds[rank + 1] - bounds[rank]


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_its_share_from_the_file(model_dirs, family, rank, monkeypatch):
    path = model_dirs[family]
    in_memory = dict(tree_flatten(load_split(path, cut_only_group(rank, 2), split="3:1", lazy=False)[0].parameters()))
    messages = []
    monkeypatch.setattr(_apply, "log", messages.append)
    from_disk = dict(tree_flatten(load_split(path, cut_only_group(rank, 2), split="3:1")[0].parameters()))
    assert not [m for m in messages if "read whole" in m], messages
    assert f"rank {rank} keeps {SHARES['3:1'][rank]} of 4 units of every split count (split 3:1)" in messages
    assert from_disk.keys() == in_memory.keys()
    for key in from_disk:
        assert from_disk[key].dtype == in_memory[key].dtype and mx.array_equal(from_disk[key], in_memory[key]), key


def test_counts_that_cannot_give_the_share_give_the_nearest_that_can(tmp_path, monkeypatch):
    """tiny llama: 2 KV heads, so only 1:1 cuts them whole, while its 256 MLP columns (8 groups
    of 32) take 3:1 (split/columns.py); logged naming the counts. Where no count gives more than
    1:1 (64 MLP columns), the whole model splits 1:1, logged."""
    path = tiny_models.build("llama", tmp_path)
    messages = []
    monkeypatch.setattr(_units, "log", messages.append)
    for rank, rows in enumerate((192, 64)):
        model, _ = load_split(path, cut_only_group(rank, 2), split="3:1")
        layer = model.model.layers[0]
        assert layer.self_attn.n_kv_heads == 1 and layer.self_attn.k_proj.weight.shape[0] == 32
        assert layer.mlp.gate_proj.weight.shape[0] == layer.mlp.down_proj.weight.shape[1] == rows
    assert any("attention's counts take 1:1" in m and "n_kv_heads=2" in m and "vocabulary take 3:1" in m
               for m in messages), messages
    narrow = save_random_model(tmp_path / "narrow", {**tiny_models.FAMILIES["llama"][0], "intermediate_size": 64})
    messages.clear()
    model, _ = load_split(narrow, cut_only_group(0, 2), split="3:1")
    assert model.model.layers[0].mlp.gate_proj.weight.shape[0] == 32
    assert any("split 3:1: no share but 1:1" in m and "n_kv_heads=2" in m for m in messages), messages


def test_a_quantized_model_cuts_in_whole_groups(tmp_path):
    """llama-q4 with group_size 32 and 12 KV heads of 32: 384 columns are 12 groups, 3:1 keeps 9 and 3
    (with heads of 16, o_proj's 192 inputs are 6 groups: only 2:1 cuts them whole)."""
    config = {**CONFIGS["llama"], "head_dim": 32}
    path = save_random_model(tmp_path / "llama-q4", config, quantization={"group_size": 32, "bits": 4})
    for rank, units in enumerate(SHARES["3:1"]):
        model, _ = load_split(path, cut_only_group(rank, 2), split="3:1")
        mlp = model.model.layers[0].mlp
        assert mlp.down_proj.scales.shape == (192, 3 * units)
        assert mlp.gate_proj.weight.shape[0] == 96 * units


# ---------------------------------------------------------------------------------------------
# Two ranks generate what one model generates
# ---------------------------------------------------------------------------------------------

PAIRS = [(split, transport) for transport in ("tcp", "rdma") if transport in transports() for split in SHARES]


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{s}-{t}" for s, t in PAIRS])
def pair(request, model_dirs, tmp_path_factory) -> tuple[str, dict[str, list]]:
    split, transport = request.param
    out = tmp_path_factory.mktemp(f"share-{split.replace(':', '_')}-{transport}")
    return split, run_ranks(transport, model_dirs, out, split=split)


@pytest.mark.parametrize("family", CONFIGS)
def test_an_uneven_pair_generates_the_unsplit_tokens(pair, references, family):
    split, results = pair
    ref = references[family]
    for rank, result in enumerate(results[family]):
        assert result["tokens"].tolist() == ref["tokens"], f"{family} at {split}: rank {rank}'s tokens differ"
        assert result["streamed"].tolist() == ref["streamed"], f"{family} at {split}: rank {rank}'s stream differs"
    rank0, rank1 = results[family]
    assert np.array_equal(rank0["logits"], rank1["logits"]), f"{family} at {split}: the ranks' logits differ"
    err = float(np.abs(rank0["logits"] - ref["logits"]).max() / np.abs(ref["logits"]).max())
    assert err <= LOGITS_RTOL, f"{family} at {split}: logits differ by {err:.2e} relative"


@pytest.mark.parametrize("family", CONFIGS)
def test_each_rank_holds_weights_in_proportion_to_its_share(pair, family):
    split, results = pair
    held = [int(r["weight_bytes"]) for r in results[family]]
    first, second = SHARES[split]
    # The norms, routers and MLA latents stay whole on both ranks: the split part follows the share.
    replicated = (held[0] * second - held[1] * first) / (second - first)
    ratio = (held[0] - replicated) / (held[1] - replicated)
    assert abs(ratio - first / second) < 0.02 * first / second, f"{family} at {split}: parts {held}"
    assert held[0] > held[1]


# 4 KV heads (quarters) beside 12 groups of MLP and expert columns (thirds): at 2:1 the attention
# takes 3:1, the MLP's and experts' columns and the vocabulary 2:1 (split/columns.py).
MIXED = {"llama": {**CONFIGS["llama"], "num_key_value_heads": 4},
         "qwen3_moe": {**CONFIGS["qwen3_moe"], "num_key_value_heads": 4},
         "deepseek_v3": {**CONFIGS["deepseek_v3"], "num_attention_heads": 4}}


def test_the_mlp_columns_take_a_finer_share_than_the_heads(tmp_path):
    paths = {family: save_random_model(tmp_path / family, config) for family, config in MIXED.items()}
    # Quantized: down_proj's packed inputs and its scales recut in whole groups of 32.
    paths["llama-q4"] = save_random_model(tmp_path / "llama-q4", MIXED["llama"],
                                          quantization={"group_size": 32, "bits": 4})
    for rank, (kv_heads, columns, rows) in enumerate(((3, 256, 333), (1, 128, 167))):
        model, _ = load_split(paths["llama"], cut_only_group(rank, 2), split="2:1")
        layer = model.model.layers[0]
        assert layer.self_attn.n_kv_heads == kv_heads and layer.self_attn.k_proj.weight.shape[0] == 16 * kv_heads
        assert layer.mlp.gate_proj.weight.shape[0] == layer.mlp.down_proj.weight.shape[1] == columns
        assert model.model.embed_tokens.embedding.weight.shape[0] == rows
        quantized, _ = load_split(paths["llama-q4"], cut_only_group(rank, 2), split="2:1")
        assert quantized.model.layers[0].mlp.down_proj.scales.shape == (192, columns // 32)
    refs = unsplit_references(paths)
    for transport in ("tcp", "rdma"):
        if transport not in transports():
            continue
        out = tmp_path / f"out-{transport}"
        out.mkdir()
        results = run_ranks(transport, paths, out, split="2:1")
        for family in paths:
            rank0, rank1 = results[family]
            for rank, result in enumerate(results[family]):
                assert result["tokens"].tolist() == refs[family]["tokens"], \
                    f"{family} over {transport}: rank {rank}'s tokens differ"
            assert np.array_equal(rank0["logits"], rank1["logits"]), \
                f"{family} over {transport}: the ranks' logits differ"
            err = float(np.abs(rank0["logits"] - refs[family]["logits"]).max() / np.abs(refs[family]["logits"]).max())
            assert err <= LOGITS_RTOL, f"{family} over {transport}: logits differ by {err:.2e} relative"
            held = [int(r["weight_bytes"]) for r in results[family]]
            # Float parts near 2:1; the 4-bit model's whole biases and norms weigh more beside its parts.
            assert held[0] > (1.5 if family == "llama-q4" else 1.8) * held[1], f"{family}: parts {held}"


# ---------------------------------------------------------------------------------------------
# Peak memory follows the share (the 156M llama, float32)
# ---------------------------------------------------------------------------------------------


def _peak_kb(mode: str, path: Path, rank: int = 0, split: str = "even") -> int:
    run = subprocess.run([sys.executable, str(CHILD), "rss", "--mode", mode, "--rank", str(rank),
                          "--split", split, str(path)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["peak_kb"]


@pytest.mark.slow
def test_at_3_to_1_each_rank_peaks_in_proportion(tmp_path):
    """The issue's bounds for the 156M llama at 3:1: rank 0 at most 0.90x the whole model's peak
    in one process, rank 1 at most 0.45x, rank 0 at least 0.30x of the whole above rank 1."""
    path = save_random_model(tmp_path / "llama-150m", llama_config(PRESETS["150m"]))
    whole = _peak_kb("whole", path)
    first, second = (_peak_kb("split", path, rank, "3:1") for rank in (0, 1))
    print(f"\n156M llama peak RSS: whole {whole / 1024:.0f} MiB, rank 0 {first / 1024:.0f} MiB, "
          f"rank 1 {second / 1024:.0f} MiB", file=sys.stderr)
    assert first <= 0.90 * whole and second <= 0.45 * whole, (whole, first, second)
    assert first - second >= 0.30 * whole, (whole, first, second)
