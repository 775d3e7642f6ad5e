"""Tensor-parallel split of mlx-lm models across 2 (or more) ranks, float or quantized: the
plans applied (behind the face mlx_ds4tp/model_split.py).

Families: llama, mistral, qwen2, qwen3 (dense); qwen3_moe, glm4_moe, deepseek_v3 / kimi_k2 (MLA),
gpt_oss, mixtral (mixtures of experts). Which layer is cut which way is a short plan per family
(split/plans.py). Every block is cut the Megatron way: q/k/v and gate/up projections
are column parallel (each rank keeps a part of the output features: its heads, its MLP channels),
o and down projections row parallel (each rank keeps the matching input features and produces a
partial sum), followed by the gate, which adds the partials. Mixtures of experts cut every expert
by its intermediate features (every rank holds every expert's part, so the work stays balanced
whatever the router picks), keep the router whole, and sum routed and shared experts locally
before one gate per block. The vocabulary is cut by rows, the logits' parts gathered. Per
generated token and rank: 2 * layers + 1 gates of one hidden vector each and one gather.

The ranks talk only through the collective seam (collectives/seam.py): our own group
(TCP, Thunderbolt RDMA), an mx.distributed.Group (ring, JACCL) or a collective of the user's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..collectives.backend import PairGroup
from ..collectives.seam import Collective, as_collective
from ..link.fingerprint import model_fingerprint
from ..checkpoint.parts import SafetensorsParts
from .layers import (
    CUTTABLE,
    SHARDED,
    ColumnParallelLinear,
    GatedBlock,
    ReadPart,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    check_cut,
    cut_array,
    cut_layer,
    rank_and_size,
)
from .derive import has_mlx_lm_plan
from .mlx_lm_plan import split_with_mlx_lm_plan
from .plans import COLUMN, FAMILIES, GATED, HEADS, IN, OUT, ROW, WHOLE, Family, mlx_lm_family, supported
from ..base.log import log

_WRAPPERS = {COLUMN: ColumnParallelLinear, ROW: RowParallelLinear}
_CUT_KIND = {COLUMN: "out", ROW: "in", OUT: "out", IN: "in", HEADS: "heads"}
# Around the blocks. lm_head is absent when the embedding is tied: then the cut embedding's
# as_linear is the vocabulary projection.
_VOCAB = (("model.embed_tokens", VocabParallelEmbedding), ("lm_head", VocabParallelHead))


class _Cut:
    """One planned change: the object at parent.name, what to do with it, and its dotted path."""

    def __init__(self, parent: Any, name: str, how: Any, where: str):
        self.parent, self.name, self.how, self.where = parent, name, how, where

    @property
    def target(self) -> Any:
        return getattr(self.parent, self.name)


def family_of(model: nn.Module) -> Family:
    """Our own split plan of `model`'s mlx-lm module, or the entry for mlx-lm's own plan (a
    Family with no blocks: its shard() cuts them); ValueError listing the supported ones."""
    family = FAMILIES.get(type(model).__module__)
    if family is not None:
        return family
    if has_mlx_lm_plan(model):
        return mlx_lm_family(type(model).__module__)
    raise ValueError(
        f"model_type={getattr(model, 'model_type', '?')!r} ({type(model).__module__}) is not "
        f"supported by split_model; supported families: {supported()}"
    )


def _resolve(root: Any, dotted: str) -> tuple[Any, str, Any]:
    *path, name = dotted.split(".")
    parent = root
    for part in path:
        parent = getattr(parent, part, None)
        if parent is None:
            return None, name, None
    return parent, name, getattr(parent, name, None)


def _check_heads(attn: nn.Module, names: tuple[str, ...], size: int, where: str) -> None:
    for label in names:
        value = getattr(attn, label)
        if value % size:
            count = "an even number of" if size == 2 else f"a multiple of {size}"
            kind = "KV heads" if "kv" in label or "key_value" in label else "attention heads"
            raise ValueError(
                f"{label}={value} cannot be split across {size} ranks; use a model with {count} "
                f"{kind}, or {'one Mac' if size == 2 else 'fewer ranks'} ({where}.self_attn)"
            )


def _block_cuts(family: Family, block: nn.Module, size: int, where: str) -> list[_Cut]:
    ffn = getattr(block, family.ffn)
    plan = family.blocks.get(type(ffn).__name__)
    if plan is None:
        raise ValueError(
            f"{where}.{family.ffn} is a {type(ffn).__name__}; the {family.names} plan knows "
            f"{', '.join(family.blocks)}: this mlx-lm version's module differs from the one the plan was written for"
        )
    _check_heads(block.self_attn, family.head_counts, size, where)
    cuts, planned, whole = [], set(), []
    for dotted, how in plan.items():
        parent, name, target = _resolve(block, dotted)
        if target is None:
            continue  # a layer this configuration does not have (MLA's q_proj vs q_a/q_b)
        planned.add(dotted)
        if how == WHOLE:
            whole.append(dotted + ".")
        elif how != GATED:
            check_cut(target, _CUT_KIND[how], size, f"{where}.{dotted}")
        cuts.append(_Cut(parent, name, how, f"{where}.{dotted}"))
    for path, module in block.named_modules():
        if isinstance(module, CUTTABLE) and path not in planned and not any(
            (path + ".").startswith(w) for w in whole
        ):
            raise ValueError(
                f"{where}.{path} ({type(module).__name__}) is not in the {family.names} split plan; "
                f"this mlx-lm version's module differs from the one the plan was written for"
            )
    # Cut inside a block before wrapping it with its gate.
    return [c for c in cuts if c.how != GATED] + [c for c in cuts if c.how == GATED]


_MLX_SHARDED = (nn.AllToShardedLinear, nn.ShardedToAllLinear,
                nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear)


def _refuse_split_twice(model: nn.Module) -> None:
    already = [type(m).__name__ for m in model.modules() if isinstance(m, SHARDED + _MLX_SHARDED)]
    if already:
        raise ValueError(f"the model is already split (it holds {already[0]} layers); split a model once")


def plan_split(model: nn.Module, size: int) -> list[_Cut]:
    """Every change split_model will make with one of our own plans, all checked; raises
    before anything is changed."""
    family = family_of(model)
    _refuse_split_twice(model)
    cuts = []
    for i, block in enumerate(model.model.layers):
        cuts += _block_cuts(family, block, size, f"model.layers.{i}")
    for dotted, cls in _VOCAB:
        parent, name, target = _resolve(model, dotted)
        if target is not None:
            check_cut(target, cls.cut_kind, size, dotted)
            cuts.append(_Cut(parent, name, cls, dotted))
    return cuts


def _apply(cut: _Cut, group: Collective, read_part: Optional[ReadPart]) -> None:
    how, target = cut.how, cut.target
    if how == WHOLE:
        return
    if how == GATED:
        setattr(cut.parent, cut.name, GatedBlock(target, group))
    elif isinstance(target, mx.array):  # gpt-oss's per-head attention sinks
        setattr(cut.parent, cut.name, cut_array(target, 0, group, cut.where, read_part))
    elif how in (OUT, IN, HEADS):
        cut_layer(target, _CUT_KIND[how], group, cut.where, read_part, bias_once=True)
    else:
        cls = _WRAPPERS.get(how, how)
        setattr(cut.parent, cut.name, cls(cut_layer(target, cls.cut_kind, group, cut.where, read_part), group))


def split_model(
    model: nn.Module,
    group: Any,
    *,
    read_part: Optional[ReadPart] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> nn.Module:
    """Split a loaded mlx-lm model in place across the group's ranks; returns the model.

    Arguments:
      model: a model from mlx_lm.load / mlx_lm.utils.load_model (lazy or evaluated), of a
        supported family (see mlx_ds4tp/_split_plans.py), float or quantized.
      group: who this rank is and how it reaches the others: the Group from mlx_ds4tp.init(...),
        an mx.distributed.Group, or an object of the user's own with rank(), size(),
        all_sum(x) and all_gather(x). Cutting needs only rank() and size().
      read_part: (load_split passes one) reads a part straight from the model's files instead of
        cutting the loaded array; default None cuts in memory.
      progress: progress(done, total, where) after each change (the CLI draws its bar with it).

    Every rank calls this with the same model. All cuts are checked before any is made, so an
    error leaves the model whole. Each part is evaluated as it is cut and the whole array
    dropped, so a lazily loaded model never holds more than its part plus one whole tensor.

    Raises:
      ValueError: the family is not supported (the message lists the supported ones), a count
        does not divide by the number of ranks (heads, KV heads, expert or MLP width, vocabulary,
        quantization group: the message names the layer, the values and the fix), a layer is
        not in the family's plan, or the model is already split.
      TypeError: `group` has no rank()/size(), or a layer is of a kind split_model cannot cut.
    """
    collective = as_collective(group)
    size = int(collective.size())
    family = family_of(model)
    if not family.blocks:
        _refuse_split_twice(model)
        split_with_mlx_lm_plan(model, group, collective, read_part=read_part, progress=progress)
        return model
    cuts = plan_split(model, size)
    for done, cut in enumerate(cuts, 1):
        _apply(cut, collective, read_part)
        if progress is not None:
            progress(done, len(cuts), cut.where)
    for block in model.model.layers:
        for label in family.head_counts:
            setattr(block.self_attn, label, getattr(block.self_attn, label) // size)
    return model


def agree_model(model_path: Path, group: Any) -> None:
    """For a pair of our own (transport tcp or rdma) whose hello carried no
    model fingerprint (init without identity, or an identity of the user's own
    without one): both ranks compare model_path's fingerprint before either
    reads a weight, and a difference is HelloMismatchError on both, naming both
    fingerprints. Both ranks reach this at the same point of load_split. A
    hello that carried fingerprints already agreed on them (a difference stops
    the hello), so nothing is read twice; MLX's groups have no channel for it."""
    if not isinstance(group, PairGroup):
        return
    pair = group.pair
    # Both hellos carry one or neither (one without is refused at the hello), so
    # both ranks take the same branch here.
    if pair.mine.fingerprint and pair.peer_hello.fingerprint:
        return
    pair.agree_fingerprint(model_fingerprint(model_path))


def load_split(
    path: Union[str, Path],
    group: Any,
    *,
    lazy: bool = True,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> tuple[nn.Module, Any]:
    """Load an mlx-lm model directory holding only this rank's part of the split weights.

    Arguments:
      path: a local mlx-lm model directory (config.json, *.safetensors, tokenizer files), as
        mlx_lm.convert or mlx_ds4tp.testing.tiny_model write it, or an original Hugging Face checkpoint
        of a supported family (experts saved one by one are stacked while reading).
      group: as for split_model.
      lazy: True (default): mlx-lm builds the model without reading the weights and each cut
        weight's part is read straight from the .safetensors files (for an expert stack, one
        range per expert), so a rank reads and holds about 1/size of the model. False: mlx-lm
        reads the whole model first and it is cut in memory (same result, the whole model's
        peak memory).
      progress: as for split_model.

    Returns (model, tokenizer), like mlx_lm.load.

    With a group of our own (transport tcp or rdma) whose hello carried no model fingerprint,
    both ranks compare the model's fingerprint first (agree_model).

    Raises:
      FileNotFoundError: `path` holds no config.json (mlx-lm would take it for a hub id).
      ValueError, TypeError: as split_model, before any weight is read.
      HelloMismatchError: the two ranks' models differ (both fingerprints named), before
        any weight is read.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    model_path = Path(path)
    # Checked here because mlx-lm takes a path that does not exist for a Hugging Face repo id
    # and would try to download it.
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_path} is not an mlx-lm model directory (no config.json in it); give the "
            f"directory mlx_lm.convert or mlx_ds4tp.testing.tiny_model wrote"
        )
    rank, size = rank_and_size(group)
    agree_model(model_path, group)
    model, config = load_model(model_path, lazy=lazy)
    # The reader's scratch buffers go with it as soon as the split is done (not kept through
    # the tokenizer's load, which would add them to this rank's peak).
    family = family_of(model)
    split_model(model, group, progress=progress,
                read_part=SafetensorsParts(model_path, rank, size, family.expert_keys, family.fused_keys)
                if lazy else None)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))

    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    log(f"rank {rank}/{size} holds its part of {model_path}: {nbytes / 2**20:.1f} MiB of weights")
    return model, tokenizer
