"""Our own split plans, for the mlx-lm modules that have no `Model.shard(group)` of their own.

Each plan is a short function in MLX's own vocabulary (`shard_linear`, `shard_inplace`), the
one mlx-lm's plans use, so ours go through exactly the same path as theirs (split/apply.py).
Every block is cut the Megatron way: q/k/v and gate/up projections keep this rank's output
features (its heads, its channels), o and down projections its input features and sum the ranks'
partials; a mixture of experts cuts every expert (and shared expert) by its intermediate features
in place, keeps the router whole, and sums once after the block. A family whose mlx-lm module
has a shard() is split by it (our plans for those went: the same cuts, the same gate count).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

GLU = ("gate_proj", "up_proj", "down_proj")
ShardFn = Callable[[nn.Module, Any], None]


def _divide(module: nn.Module, counts: tuple[str, ...], size: int) -> None:
    # A count that does not divide is refused before this runs (split/derive.py's twin).
    for name in counts:
        setattr(module, name, getattr(module, name) // size)


def _attention(attn: nn.Module, group: Any, counts: tuple[str, ...],
               column: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")) -> None:
    for name in column:
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    _divide(attn, counts, group.size())


def _dense(mlp: nn.Module, group: Any) -> None:
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def _in_place(glu: nn.Module, group: Any) -> None:
    """An expert stack or a shared expert cut by its intermediate features, no sum of its own."""
    shard_inplace(glu.gate_proj, "all-to-sharded", group=group)
    shard_inplace(glu.up_proj, "all-to-sharded", group=group)
    shard_inplace(glu.down_proj, "sharded-to-all", group=group)
    if "bias" in glu.down_proj:
        # Added after each rank's partial product, so summed once per rank by the block's sum.
        glu.down_proj.bias = glu.down_proj.bias / group.size()


_SUMMED: dict[type, type] = {}


def _summed_class(cls: type) -> type:
    if cls not in _SUMMED:
        def call_and_sum(self, *args, **kwargs):
            return mx.distributed.all_sum(cls.__call__(self, *args, **kwargs), group=self.__dict__["_sum_group"])

        _SUMMED[cls] = type(f"Summed{cls.__name__}", (cls,), {"__call__": call_and_sum, "__module__": __name__})
    return _SUMMED[cls]


def sum_after(block: nn.Module, group: Any) -> None:
    """Make `block`, whose output is now this rank's partial sum, sum it over the group.

    mlx-lm's newer MoE blocks do this themselves (`sharding_group`); older ones (mixtral,
    llama4) do not. The block's class is swapped for a subclass rather than the block wrapped:
    a wrapper would move every parameter under a new name, and the names are the checkpoint's
    keys, by which each rank reads its bytes."""
    object.__setattr__(block, "_sum_group", group)
    block.__class__ = _summed_class(type(block))


def summed_blocks() -> tuple[type, ...]:
    """The classes sum_after made so far (a model holding one is already split)."""
    return tuple(_SUMMED.values())


def shard_mixtral(model: nn.Module, group: Any) -> None:
    for layer in model.model.layers:
        _attention(layer.self_attn, group, ("num_heads", "num_key_value_heads"))
        _in_place(layer.block_sparse_moe.switch_mlp, group)
        sum_after(layer.block_sparse_moe, group)


def shard_llama4(model: nn.Module, group: Any) -> None:
    """Llama 4's text model (the vision tower is not loaded by mlx-lm): MoE layers with a
    shared expert beside dense ones."""
    for layer in model.layers:
        _attention(layer.self_attn, group, ("n_heads", "n_kv_heads"))
        ffn = layer.feed_forward
        if hasattr(ffn, "experts"):
            _in_place(ffn.experts, group)
            _in_place(ffn.shared_expert, group)
            sum_after(ffn, group)
        else:
            _dense(ffn, group)


def shard_qwen3_next(model: nn.Module, group: Any) -> None:
    """Qwen3-Next: gated delta-net layers cut by key head beside gated full-attention layers;
    MoE blocks with a gated shared expert (they sum themselves: mlx-lm's sharding_group)."""
    size = group.size()
    for layer in model.model.layers:
        if layer.is_linear:
            net = layer.linear_attn
            # in_proj_qkvz and in_proj_ba are laid out key head by key head (q, k, v, z of one
            # head, then the next): a rank's heads are one run of rows. The convolution's
            # channels are all q, then all k, then all v: one run of each.
            net.in_proj_qkvz = shard_linear(net.in_proj_qkvz, "all-to-sharded", group=group)
            net.in_proj_ba = shard_linear(net.in_proj_ba, "all-to-sharded", group=group)
            key_dim = net.key_dim
            shard_inplace(net.conv1d, lambda path, w, key_dim=key_dim: (0, [key_dim, 2 * key_dim]), group=group)
            net.conv1d.groups //= size
            net.dt_bias = _heads(net.dt_bias, group)
            net.A_log = _heads(net.A_log, group)
            net.out_proj = shard_linear(net.out_proj, "sharded-to-all", group=group)
            _divide(net, ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"), size)
        else:
            # q_proj holds each head's queries and its output gate side by side.
            _attention(layer.self_attn, group, ("num_attention_heads", "num_key_value_heads"))
        if hasattr(layer.mlp, "switch_mlp"):
            layer.mlp.sharding_group = group
            _in_place(layer.mlp.switch_mlp, group)
            _in_place(layer.mlp.shared_expert, group)
        else:
            _dense(layer.mlp, group)


def _moe_or_dense(mlp: nn.Module, group: Any, experts: str = "switch_mlp", shared: str = "shared_experts") -> None:
    """A MoE block (routed expert stack and, where it has one, a shared expert, cut in place, one
    sum after the block; the router whole) or a dense GLU MLP."""
    if experts not in mlp:
        _dense(mlp, group)
        return
    _in_place(mlp[experts], group)
    if isinstance(mlp.get(shared), nn.Module):
        _in_place(mlp[shared], group)
    sum_after(mlp, group)


def _heads(array: mx.array, group: Any, axis: int = 0) -> mx.array:
    """This rank's run of a per-head array."""
    return mx.contiguous(mx.split(array, group.size(), axis=axis)[group.rank()])


def shard_dots1(model: nn.Module, group: Any) -> None:
    """dots.llm1: dense layers (first_k_dense_replace) then MoE blocks with a shared expert;
    q/k RMSNorms are per head."""
    for layer in model.model.layers:
        _attention(layer.self_attn, group, ("n_heads", "n_kv_heads"))
        _moe_or_dense(layer.mlp, group, experts="experts")


def shard_ernie4_5_moe(model: nn.Module, group: Any) -> None:
    """ERNIE 4.5 MoE: dense layers outside [moe_layer_start_index, moe_layer_end_index], MoE
    blocks with shared experts; use_bias puts biases on every projection (an expert's or the
    shared expert's down bias is divided by _in_place, the dense ones added after the sum)."""
    for layer in model.model.layers:
        _attention(layer.self_attn, group, ("n_heads", "n_kv_heads"))
        _moe_or_dense(layer.mlp, group)


def shard_hunyuan(model: nn.Module, group: Any) -> None:
    """Hunyuan (MoE): cross-layer attention (use_cla) leaves every other layer without k/v
    projections, reusing the previous layer's keys and values, which are this rank's KV heads
    there too; MoE blocks with a shared MLP (use_mixed_mlp_moe)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        kv = ("k_proj", "v_proj") if "k_proj" in attn else ()
        _attention(attn, group, ("n_heads", "n_kv_heads"), column=("q_proj", *kv))
        _moe_or_dense(layer.mlp, group, shared="shared_mlp")


def shard_bailing_moe(model: nn.Module, group: Any) -> None:
    """Ling / Bailing MoE: fused query_key_value (all queries, then all keys, then all values:
    each rank its run of each), dense layers (first_k_dense_replace) then MoE blocks with
    shared experts."""
    for layer in model.model.layers:
        attn = layer.attention
        q, kv = attn.num_attention_heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
        attn.query_key_value = shard_linear(attn.query_key_value, "all-to-sharded",
                                            segments=[q, q + kv], group=group)
        attn.dense = shard_linear(attn.dense, "sharded-to-all", group=group)
        _divide(attn, ("num_attention_heads", "num_key_value_heads"), group.size())
        _moe_or_dense(layer.mlp, group)


def shard_qwen3_vl_moe(model: nn.Module, group: Any) -> None:
    """Qwen3-VL MoE: mlx-lm builds only its language model, a qwen3_moe Model (the vision tower
    is dropped by sanitize), split by mlx-lm's own qwen3_moe plan."""
    model.language_model.shard(group)


def shard_mimo_v2_flash(model: nn.Module, group: Any) -> None:
    """MiMo-V2-Flash: sliding-window layers (their own head counts and head dims) beside full
    attention ones, each with per-head attention sinks; MoE blocks with shared experts beside
    dense layers."""
    for layer in model.model.layers:
        attn = layer.self_attn
        _attention(attn, group, ("n_heads", "n_kv_heads"))
        if attn.attention_sink_bias is not None:
            attn.attention_sink_bias = _heads(attn.attention_sink_bias, group)
        _moe_or_dense(layer.mlp, group)


def shard_kimi_linear(model: nn.Module, group: Any) -> None:
    """Kimi Linear: Kimi delta-attention layers cut by head beside MLA layers (cut by head as
    mlx-lm's deepseek_v3 plan does); MoE blocks with shared experts beside dense layers."""
    size = group.size()
    for layer in model.model.layers:
        attn = layer.self_attn
        if layer.is_linear:
            # q/k/v, the forget gate's f_b, the output gate's g_b and beta are laid out head by
            # head; f_a and g_a (hidden -> head_dim, the low-rank halves) stay whole.
            for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj"):
                setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
            for name in ("q_conv", "k_conv", "v_conv"):
                conv = getattr(attn, name).conv  # depthwise: weight [channels, kernel, 1]
                shard_inplace(conv, lambda path, w: 0, group=group)
                conv.groups //= size
            attn.A_log = _heads(attn.A_log, group, axis=2)  # [1, 1, heads, 1]
            attn.dt_bias = _heads(attn.dt_bias, group)  # [heads * head_dim]
            attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
            _divide(attn, ("num_heads", "projection_dim"), size)
        else:
            # The latent (kv_a_proj_with_mqa, its norm) is shared by every head: whole.
            attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
            attn.embed_q.apply(lambda w: _heads(w, group))
            attn.unembed_out.apply(lambda w: _heads(w, group))
            attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
            _divide(attn, ("num_heads",), size)
        _moe_or_dense(layer.mlp, group)


OWN_PLANS: dict[str, ShardFn] = {
    "mlx_lm.models.mixtral": shard_mixtral,
    "mlx_lm.models.llama4": shard_llama4,
    "mlx_lm.models.qwen3_next": shard_qwen3_next,
    "mlx_lm.models.dots1": shard_dots1,
    "mlx_lm.models.ernie4_5_moe": shard_ernie4_5_moe,
    "mlx_lm.models.hunyuan": shard_hunyuan,
    "mlx_lm.models.bailing_moe": shard_bailing_moe,
    "mlx_lm.models.qwen3_vl_moe": shard_qwen3_vl_moe,
    "mlx_lm.models.mimo_v2_flash": shard_mimo_v2_flash,
    "mlx_lm.models.kimi_linear": shard_kimi_linear,
}


def stacked_experts(names: tuple[str, str, str] = GLU, at: str = "switch_mlp") -> tuple[tuple[str, str], ...]:
    """Key fragments of a SwitchGLU stack and of one expert's own projections (names as saved)."""
    return tuple((f"{at}.{stacked}.", f"experts.{{e}}.{saved}.") for stacked, saved in zip(GLU, names))


# How original Hugging Face checkpoints save what mlx-lm's sanitize() rewrites: experts one by
# one (most MoE modules stack them into switch_mlp), and gpt-oss's fused gate_up with mxfp4
# blocks saved as bytes: (key ending as loaded, key ending as saved, row offset, row step).
_GPT_OSS_FUSED = tuple(
    (f"experts.{proj}.{array}", f"experts.{saved}_{suffix}", offset, step)
    for proj, saved, offset, step in (("gate_proj", "gate_up_proj", 0, 2),
                                      ("up_proj", "gate_up_proj", 1, 2),
                                      ("down_proj", "down_proj", 0, 1))
    for array, suffix in (("weight", "blocks"), ("scales", "scales"), ("bias", "bias"))
)
_SAVED_LAYOUTS: dict[str, dict[str, tuple]] = {
    "mlx_lm.models.mixtral": {"expert_keys": stacked_experts(("w1", "w3", "w2"))},
    "mlx_lm.models.dots1": {"expert_keys": stacked_experts(at="experts")},
    "mlx_lm.models.gpt_oss": {"fused_keys": _GPT_OSS_FUSED},
}


def saved_layout(module: str) -> dict[str, tuple]:
    """SafetensorsParts' expert_keys and fused_keys for a model module."""
    return {"expert_keys": stacked_experts(), "fused_keys": (), **_SAVED_LAYOUTS.get(module, {})}


def mlx_lm_plan_modules() -> list[str]:
    """The installed mlx-lm's model modules whose Model has shard(group): its own, or its
    parent's (`from .deepseek_v32 import Model as ...`), read from the sources without
    importing every module."""
    import re

    import mlx_lm.models

    sources = {f.stem: f.read_text(errors="replace") for f in Path(mlx_lm.models.__path__[0]).glob("*.py")}
    found = {name for name, text in sources.items() if "    def shard(" in text}
    parent = re.compile(r"^from \.(\w+) import Model\b", re.MULTILINE)
    grew = True
    while grew:
        grew = False
        for name, text in sources.items():
            if name not in found and any(p in found for p in parent.findall(text)):
                found.add(name)
                grew = True
    return sorted(found)


def supported() -> str:
    """The supported model modules, for error messages and docs/families.md."""
    ours = ", ".join(m.rsplit(".", 1)[-1] for m in OWN_PLANS)
    return f"{', '.join(mlx_lm_plan_modules())} (mlx-lm's plans); {ours} (ours)"


def plan_of(model: nn.Module) -> ShardFn:
    """The plan that splits `model`: ours where its module has none, else mlx-lm's own;
    ValueError listing the supported modules."""
    module = type(model).__module__
    if module in OWN_PLANS:
        return OWN_PLANS[module]
    if callable(getattr(type(model), "shard", None)):
        return lambda m, group: m.shard(group)
    raise ValueError(
        f"model_type={getattr(model, 'model_type', '?')!r} ({module}) is not supported by "
        f"split_model; supported families: {supported()}"
    )


__all__ = ["OWN_PLANS", "mlx_lm_plan_modules", "plan_of", "saved_layout", "summed_blocks", "supported"]
