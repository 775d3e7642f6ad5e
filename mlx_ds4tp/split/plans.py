"""Which layer of each mlx-lm model family is cut which way: one short plan per family.

A plan names, for each kind of transformer block, every layer that holds weights (dotted paths
inside the block) and what happens to it:

    COLUMN  output features cut, wrapped (ColumnParallelLinear): q/k/v, a dense MLP's gate/up
    ROW     input features cut, then a gate (RowParallelLinear): o_proj, a dense MLP's down_proj
    OUT     output features cut in place, no gate: an expert stack's gate/up, a shared expert's
    IN      input features cut in place, bias added by rank 0 only: an expert stack's down_proj
    HEADS   head axis cut in place: MLA's per-head embed_q / unembed_out, gpt-oss's sinks
    GATED   the whole block wrapped with one gate after it (GatedBlock): a mixture of experts,
            whose routed and shared experts are summed locally before it
    WHOLE   replicated on every rank: routers, MLA's latent projections

Blocks are told apart by the class of their feed-forward module (dense layers and MoE layers
of one model differ there). Paths a model lacks are skipped (MLA has q_proj or q_a_proj/q_b_proj
by configuration); a weight-holding layer the plan does not name is refused, so a change in
mlx-lm's module shows up as an error, not as a silently unsplit layer. Adding a family is one
entry in FAMILIES.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

COLUMN, ROW, OUT, IN, HEADS, GATED, WHOLE = "column", "row", "out", "in", "heads", "gated", "whole"

GLU = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """The split of one mlx-lm model module."""

    names: str  # model_type values it serves, for messages and the README
    head_counts: tuple[str, ...]  # self_attn attributes counting heads: divided by the ranks
    blocks: Mapping[str, Mapping[str, str]]  # class of block.<ffn> -> {dotted path: cut}
    ffn: str = "mlp"  # the block's feed-forward attribute
    # (stacked key fragment, one expert's key fragment with {e}) as original Hugging Face
    # checkpoints save experts one by one; mlx-lm's sanitize() stacks them while loading.
    expert_keys: tuple[tuple[str, str], ...] = field(default=())
    # (key ending as mlx-lm loads it, key ending as saved, row offset, row step): the loaded
    # array is rows offset::step of a saved one (gpt-oss's fused gate_up_proj, mxfp4 blocks).
    fused_keys: tuple[tuple[str, str, int, int], ...] = field(default=())


def attention(*, column=("q_proj", "k_proj", "v_proj"), row=("o_proj",), heads=(), whole=()) -> dict:
    """The attention part of a block plan (self_attn.*)."""
    plan = {f"self_attn.{p}": COLUMN for p in column}
    plan.update({f"self_attn.{p}": ROW for p in row})
    plan.update({f"self_attn.{p}": HEADS for p in heads})
    plan.update({f"self_attn.{p}": WHOLE for p in whole})
    return plan


def dense(at: str = "mlp", names: tuple[str, str, str] = GLU) -> dict:
    """A dense gated MLP: gate/up column parallel, down row parallel with its gate."""
    gate, up, down = names
    return {f"{at}.{gate}": COLUMN, f"{at}.{up}": COLUMN, f"{at}.{down}": ROW}


def moe(at: str, *, experts: str = "switch_mlp", router: str = "gate", shared: Optional[str] = None) -> dict:
    """A mixture of experts: every expert (and shared expert) cut by its intermediate features
    in place, the router whole, one gate after the block."""
    gate, up, down = GLU
    plan = {at: GATED, f"{at}.{router}": WHOLE}
    for part in (experts,) + ((shared,) if shared else ()):
        plan.update({f"{at}.{part}.{gate}": OUT, f"{at}.{part}.{up}": OUT, f"{at}.{part}.{down}": IN})
    return plan


def stacked_experts(names: tuple[str, str, str] = GLU, at: str = "switch_mlp") -> tuple[tuple[str, str], ...]:
    """Key fragments of a SwitchGLU stack and of one expert's own projections (names as saved)."""
    return tuple((f"{at}.{stacked}.", f"experts.{{e}}.{saved}.") for stacked, saved in zip(GLU, names))


LLAMA_ATTENTION = attention()
# MLA (DeepSeek V3, Kimi K2): queries are cut by head (q_proj, or q_b_proj after the low-rank
# q_a_proj); the latent projections are shared by all heads and stay whole; the per-head
# absorbed key/value projections (mlx-lm's embed_q / unembed_out) are cut by head.
MLA_ATTENTION = attention(
    column=("q_proj", "q_b_proj"), heads=("embed_q", "unembed_out"),
    whole=("q_a_proj", "kv_a_proj_with_mqa"),
)

# Families whose mlx-lm module has no Model.shard(): our own plans. Every module that has one
# is split by mlx-lm's own plan (split/mlx_lm_plan.py) with our vocabulary split on top; our
# hand-written plans for those (llama, qwen2, qwen3, qwen3_moe, glm4_moe, deepseek_v3, gpt_oss)
# gave the same cuts and the same gate count, so they went.
FAMILIES: dict[str, Family] = {
    "mlx_lm.models.mixtral": Family(
        "mixtral", ("num_heads", "num_key_value_heads"),
        {"MixtralSparseMoeBlock": LLAMA_ATTENTION | moe("block_sparse_moe")},
        ffn="block_sparse_moe", expert_keys=stacked_experts(("w1", "w3", "w2")),
    ),
}

# How original Hugging Face checkpoints save what mlx-lm's sanitize() rewrites, for the families
# split by mlx-lm's plan: experts one by one (most MoE modules stack them into switch_mlp), and
# gpt-oss's fused gate_up with mxfp4 blocks saved as bytes.
_GPT_OSS_FUSED = tuple(
    (f"experts.{proj}.{array}", f"experts.{saved}_{suffix}", offset, step)
    for proj, saved, offset, step in (("gate_proj", "gate_up_proj", 0, 2),
                                      ("up_proj", "gate_up_proj", 1, 2),
                                      ("down_proj", "down_proj", 0, 1))
    for array, suffix in (("weight", "blocks"), ("scales", "scales"), ("bias", "bias"))
)
_SAVED_LAYOUTS = {"mlx_lm.models.gpt_oss": {"fused_keys": _GPT_OSS_FUSED}}


def mlx_lm_family(module: str) -> Family:
    """The entry of a family split by its mlx-lm module's own plan: no blocks of ours, only
    how its original checkpoints are saved."""
    layout = {"expert_keys": stacked_experts(), **_SAVED_LAYOUTS.get(module, {})}
    return Family(module.rsplit(".", 1)[-1], (), {}, **layout)


def mlx_lm_plan_modules() -> list[str]:
    """The installed mlx-lm's model modules that define Model.shard(group)."""
    import mlx_lm.models

    found = []
    for file in sorted(Path(mlx_lm.models.__path__[0]).glob("*.py")):
        if "    def shard(" in file.read_text(errors="replace"):
            found.append(file.stem)
    return found


def supported() -> str:
    """The supported model modules, for error messages and the README."""
    ours = ", ".join(f.names for f in FAMILIES.values())
    return f"{', '.join(mlx_lm_plan_modules())} (mlx-lm's plans); {ours} (ours)"


__all__ = ["COLUMN", "FAMILIES", "Family", "GATED", "HEADS", "IN", "OUT", "ROW", "WHOLE", "mlx_lm_family",
           "mlx_lm_plan_modules", "supported"]
