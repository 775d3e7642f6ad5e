"""Every family the split supports beyond the first eight, each in a tiny random checkpoint.

mlx-lm's own plans (Model.shard) for the modules that have one, ours (split/plans.py) for
llama4 and qwen3_next; the configs (tests/family_configs_*.py) are built from each module's own
ModelArgs and exercise its structure: dense and MoE layers, shared experts, latent and sparse
attention, linear-attention layers, sliding windows. For each: two processes over TCP generate
the unsplit model's greedy tokens with logits identical on both ranks and within 2e-3 of the
unsplit model's; a token costs at most 2L+1 all_sums and one gather; load_split reads every cut
array's part from the file, equal to cutting it in memory. A sample also runs over the emulated
RDMA device, and one family over MLX's ring with 4 ranks. (llama, qwen2, qwen3, qwen3_moe,
glm4_moe, deepseek_v3, gpt_oss and mixtral: tests/test_model_split.py and test_model_split_moe.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import family_configs_a
import family_configs_b
import family_configs_own
from mlx_ds4tp.collectives.backend import cut_only_group
from mlx_ds4tp.model_split import load_split
from mlx_ds4tp.split import apply as _apply
from mlx_ds4tp.split.plans import mlx_lm_plan_modules
from mlx_ds4tp.synthetic.tiny_model import save_random_model
from splitutil import run_ranks, transports, unsplit_references

CONFIGS = {**family_configs_a.CONFIGS, **family_configs_b.CONFIGS,
           **{k: v for k, v in family_configs_own.CONFIGS.items() if k != "mixtral"}}
# mlx-lm's muse_spark runs its attention through Metal kernels only (mlx_lm/kernels): off a
# Mac it can be cut and read, not run.
METAL_ONLY = {"muse_spark"}
RUNS_HERE = [f for f in CONFIGS if f not in METAL_ONLY or mx.metal.is_available()]
FAMILIES = list(CONFIGS)
TOKENS = 16  # the bound: 16 greedy tokens equal the unsplit model's
LOGITS_RTOL = 2e-3
RDMA_SAMPLE = ["qwen3_5_moe", "qwen3_next", "deepseek_v32", "minimax"]
# all_sums a layer costs where mlx-lm's plan runs more than attention's and the MLP's two:
GATES_PER_LAYER = {
    # its q/k RMSNorm spans every head, so the squared norms (one float a row) are summed too
    "minimax": 3,
    # each layer holds two attentions and two dense MLPs beside one MoE
    "longcat_flash": 5,
    "longcat_flash_ngram": 5,
    # the model runs its layers twice (loop_num=2)
    "iquestloopcoder": 4,
}


def _module(config: dict) -> str:
    """The mlx-lm module a config's model_type loads (solar_open's Model is glm4_moe's)."""
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(config["model_type"], config["model_type"])


def test_every_module_with_a_plan_has_a_tiny_checkpoint_here():
    covered = {_module(config) for config, _ in CONFIGS.values()}
    covered |= {"llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "mixtral"}
    missing = sorted(set(mlx_lm_plan_modules()) - covered)
    assert not missing, f"mlx-lm modules with Model.shard() and no test checkpoint: {missing}"


def _save(path: Path, config: dict, quantization) -> Path:
    save_random_model(path, config, quantization=quantization)
    if config["model_type"] == "muse_spark":
        # mlx-lm 0.32.2's muse_spark chat-template module has no apply_chat_template of its own,
        # so its tokenizer loads only with a template in the checkpoint, as released ones have.
        config_file = path / "tokenizer_config.json"
        tokenizer_config = json.loads(config_file.read_text())
        tokenizer_config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        config_file.write_text(json.dumps(tokenizer_config))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: _save(root / name, config, quant) for name, (config, quant) in CONFIGS.items()}


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, dict]:
    return unsplit_references({name: model_dirs[name] for name in RUNS_HERE})


@pytest.fixture(scope="module")
def over_tcp(model_dirs, tmp_path_factory) -> dict[str, list]:
    return run_ranks("tcp", {name: model_dirs[name] for name in RUNS_HERE},
                     tmp_path_factory.mktemp("families-tcp"))


def _runs_here(family: str, model_dirs: dict[str, Path]) -> bool:
    """True if the family runs on this machine; off a Mac, a Metal-only family's split model is
    checked to fail saying so (what this machine can do), and False."""
    if family in RUNS_HERE:
        return True
    model, _ = load_split(model_dirs[family], cut_only_group(0, 2))
    with pytest.raises(RuntimeError, match=r"No Metal back-end"):
        mx.eval(model(mx.array([[5, 6, 7]])))
    return False


def _check_pair(results: list, ref: dict, label: str) -> None:
    for rank, result in enumerate(results):
        assert result["tokens"].tolist()[:TOKENS] == ref["tokens"][:TOKENS], \
            f"{label}: rank {rank}'s greedy tokens differ"
        assert np.array_equal(result["logits"], results[0]["logits"]), \
            f"{label}: rank {rank}'s logits differ from rank 0's"
    got, want = results[0]["logits"][:TOKENS], ref["logits"][:TOKENS]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= LOGITS_RTOL, f"{label}: logits differ by {err:.2e} relative"


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_over_tcp_generate_the_unsplit_tokens(family, model_dirs, request):
    if not _runs_here(family, model_dirs):
        return
    over_tcp, references = request.getfixturevalue("over_tcp"), request.getfixturevalue("references")
    _check_pair(over_tcp[family], references[family], f"{family} over tcp")


@pytest.mark.skipif("rdma" not in transports(), reason="the emulated RDMA device needs mlx_ds4tp._verbs")
def test_a_sample_over_the_emulated_rdma_device(model_dirs, references, tmp_path):
    sample = {name: model_dirs[name] for name in RDMA_SAMPLE}
    results = run_ranks("rdma", sample, tmp_path)
    for name in sample:
        _check_pair(results[name], references[name], f"{name} over rdma")


def test_four_ranks_of_mlx_ring(tmp_path):
    """qwen3_next with every count divisible by 4, over MLX's own ring (transport="mlx")."""
    config, _ = family_configs_own.CONFIGS["qwen3_next"]
    config = {**config, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
              "linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16}
    path = save_random_model(tmp_path / "qwen3_next-4", config)
    ref = unsplit_references({"qwen3_next-4": path})["qwen3_next-4"]
    out = tmp_path / "out"
    out.mkdir()
    results = run_ranks("ring", {"qwen3_next-4": path}, out, ranks=4)["qwen3_next-4"]
    _check_pair(results, ref, "qwen3_next over 4 ranks of the ring")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_token_costs_at_most_two_sums_a_layer_plus_one_and_one_gather(model_dirs, family, counted):
    from mlx_lm.models.cache import make_prompt_cache

    if not _runs_here(family, model_dirs):
        return
    model, _ = load_split(model_dirs[family], cut_only_group(0, 2))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 6, 7]]), cache=cache))
    layers, per_layer = len(model.layers), GATES_PER_LAYER.get(family, 2)
    for step in range(2):
        counted["sums"] = counted["gathers"] = 0
        mx.eval(model(mx.array([[8 + step]]), cache=cache))
        assert counted["sums"] <= per_layer * layers + 1, f"{counted['sums']} all_sums for one token of {layers} layers"
        assert counted["gathers"] == 1, f"{counted['gathers']} gathers for one token"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_its_parts_from_the_file(model_dirs, family, rank, monkeypatch):
    path = model_dirs[family]
    in_memory = dict(tree_flatten(load_split(path, cut_only_group(rank, 2), lazy=False)[0].parameters()))
    messages = []
    monkeypatch.setattr(_apply, "log", messages.append)
    from_disk = dict(tree_flatten(load_split(path, cut_only_group(rank, 2))[0].parameters()))
    assert not [m for m in messages if "read whole" in m], messages
    assert from_disk.keys() == in_memory.keys()
    for key in from_disk:
        assert from_disk[key].dtype == in_memory[key].dtype and mx.array_equal(from_disk[key], in_memory[key]), key


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_next", "qwen3_moe"])
def test_a_rank_loading_its_part_peaks_near_half_the_whole(tmp_path, kind):
    """Peak RSS of load_split's rank against mlx_lm.load of the whole model, for an MLA family,
    a linear-attention hybrid and a plain MoE (3 layers, about 0.7 GB float32 each; the closing
    note's ~1 GB checkpoints are memory_configs.configs(4))."""
    import json
    import os
    import subprocess
    import sys

    import memory_configs
    from splitutil import CHILD

    path = save_random_model(tmp_path / kind, memory_configs.configs(layers=3)[kind])

    def peak(mode: str) -> int:
        run = subprocess.run([sys.executable, str(CHILD), "rss", "--mode", mode, str(path)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert run.returncode == 0, run.stderr[-4000:]
        return json.loads(run.stdout.strip().splitlines()[-1])["peak_kb"]

    whole, part = peak("whole"), peak("split")
    ratio = part / whole
    print(f"\n{kind}: peak RSS whole {whole / 1024:.0f} MiB, one rank {part / 1024:.0f} MiB: {ratio:.3f}",
          file=sys.stderr)
    # The import baseline (about 80 MiB) weighs more at this size than at 1 GB (0.56-0.58 there).
    assert ratio <= 0.65, f"a rank's peak RSS is {ratio:.3f} of the whole model's"


# ---------------------------------------------------------------------------------------------
# An uneven share (split/units.py): every family takes 3:1 where its counts allow
# ---------------------------------------------------------------------------------------------

# Counts that divide into 4 units (KV heads, key heads, 4 groups of 32 MLP and expert columns).
QUARTERS = {
    "qwen3_next": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "linear_num_value_heads": 8,
                   "linear_num_key_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "intermediate_size": 128, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
    "mixtral": {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rank", [0, 1])
def test_every_family_takes_3_to_1_or_the_nearest_share_its_counts_allow(model_dirs, family, rank, monkeypatch):
    """These checkpoints' counts (2 KV heads, 64 MLP columns) allow only 1:1: logged naming the
    counts, and each rank still reads its parts from the file."""
    from mlx_ds4tp.split import units

    messages = []
    monkeypatch.setattr(_apply, "log", messages.append)
    monkeypatch.setattr(units, "log", messages.append)
    load_split(model_dirs[family], cut_only_group(rank, 2), split="3:1")
    assert not [m for m in messages if "read whole" in m], messages
    assert [m for m in messages if "split 3:1" in m and ("1:1" in m or "keeps" in m)], messages


def test_our_plans_split_3_to_1(tmp_path):
    """qwen3_next (gated delta-net key heads, their convolution's segments) and mixtral, with
    counts that divide into 4, over TCP at 3:1: the unsplit tokens on both ranks."""
    paths = {}
    for family, counts in QUARTERS.items():
        config, _ = family_configs_own.CONFIGS[family]
        paths[family] = save_random_model(tmp_path / family, {**config, **counts})
    refs = unsplit_references(paths)
    out = tmp_path / "out"
    out.mkdir()
    results = run_ranks("tcp", paths, out, split="3:1")
    for family in paths:
        _check_pair(results[family], refs[family], f"{family} at 3:1")
        held = [int(r["weight_bytes"]) for r in results[family]]
        assert held[0] > 2 * held[1], f"{family} at 3:1 holds {held}"


def test_a_plan_that_computes_with_the_group_size_splits_evenly(tmp_path, monkeypatch):
    """minimax's q/k norm divides by the group's size, which only 1:1 keeps right: logged."""
    from mlx_ds4tp.split import units

    config, _ = family_configs_b.CONFIGS["minimax"]
    path = save_random_model(tmp_path / "minimax", {**config, "num_attention_heads": 8, "num_key_value_heads": 4,
                                                    "head_dim": 16, "intermediate_size": 128})
    messages = []
    monkeypatch.setattr(units, "log", messages.append)
    model, _ = load_split(path, cut_only_group(0, 2), split="3:1")
    assert model.model.layers[0].self_attn.num_key_value_heads == 2
    assert any("can only split evenly" in m and "ShardedRMSNorm" in m for m in messages), messages
