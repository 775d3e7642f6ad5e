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

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from splitutil import run_ranks, transports, unsplit_references

import family_configs_a
import family_configs_b
import family_configs_own
from mlx_ds4tp.collectives.backend import cut_only_group
from mlx_ds4tp.model_split import load_split, split_model
from mlx_ds4tp.split import apply as _apply
from mlx_ds4tp.split.plans import mlx_lm_plan_modules
from mlx_ds4tp.testing.tiny_model import save_random_model

CONFIGS = {**family_configs_a.CONFIGS, **family_configs_b.CONFIGS,
           **{k: v for k, v in family_configs_own.CONFIGS.items() if k != "mixtral"}}
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


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: save_random_model(root / name, config, quantization=quant)
            for name, (config, quant) in CONFIGS.items()}


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, dict]:
    return unsplit_references(model_dirs)


@pytest.fixture(scope="module")
def over_tcp(model_dirs, tmp_path_factory) -> dict[str, list]:
    return run_ranks("tcp", model_dirs, tmp_path_factory.mktemp("families-tcp"))


def _check_pair(results: list, ref: dict, label: str) -> None:
    for rank, result in enumerate(results):
        assert result["tokens"].tolist()[:TOKENS] == ref["tokens"][:TOKENS], f"{label}: rank {rank}'s greedy tokens differ"
        assert np.array_equal(result["logits"], results[0]["logits"]), f"{label}: rank {rank}'s logits differ from rank 0's"
    got, want = results[0]["logits"][:TOKENS], ref["logits"][:TOKENS]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= LOGITS_RTOL, f"{label}: logits differ by {err:.2e} relative"


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_over_tcp_generate_the_unsplit_tokens(over_tcp, references, family):
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


@pytest.fixture
def counted(monkeypatch):
    """mx.distributed.all_sum / all_gather counted as the graph is built; each hands this
    rank's input back (its 'peer' holding zeros), so the graph runs in one process."""
    calls = {"sums": 0, "gathers": 0}

    def all_sum(x, group=None, stream=None):
        calls["sums"] += 1
        return x

    def all_gather(x, group=None, stream=None):
        calls["gathers"] += 1
        return mx.concatenate([x, mx.zeros_like(x)], axis=0)

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    monkeypatch.setattr(mx.distributed, "all_gather", all_gather)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_a_token_costs_at_most_2L_plus_1_sums_and_one_gather(model_dirs, family, counted):
    from mlx_lm.models.cache import make_prompt_cache

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
