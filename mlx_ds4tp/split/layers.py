"""Cutting one layer's arrays, and the layers of a split model (the gates live here).

Three cuts, named by what each rank keeps:

- "out": a part of the output features (the rows of a Linear's weight, of an Embedding's
  vocabulary, of every expert in a SwitchLinear's [experts, out, in] stack). Its bias is cut too.
- "in": a part of the input features (the last axis of every weight). Each rank then computes a
  partial sum of the whole output; a bias must be added once, not once per rank.
- "heads": a part of the leading (head) axis of every array: MLA's per-head MultiLinear
  [heads, out, in], gpt-oss's per-head attention sinks.

Quantized layers store their weight packed along the input axis with one scale (and bias) per
group of `group_size` inputs, so all three arrays cut along the same axis as a float weight.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from ..collectives.seam import Collective, as_collective

_WEIGHT_ARRAYS = ("weight", "scales", "biases")
CUTTABLE = (
    nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding,
    SwitchLinear, QuantizedSwitchLinear, MultiLinear, QuantizedMultiLinear,
)
CUT_KINDS = ("out", "in", "heads")

# read_part(key, whole, axis) -> this rank's part of the array saved under `key`, read from disk,
# or None to cut `whole` in memory instead. `whole` is the layer's (usually still lazy) array.
ReadPart = Callable[[str, mx.array, int], Optional[mx.array]]


def rank_and_size(group: Any) -> tuple[int, int]:
    """(rank, size) of any group split_model accepts; TypeError naming it otherwise."""
    collective = as_collective(group)
    return int(collective.rank()), int(collective.size())


def _input_features(layer: nn.Module) -> int:
    bits = getattr(layer, "bits", None)
    if bits is not None and not isinstance(layer, (nn.Linear, nn.Embedding)):
        return layer["weight"].shape[-1] * 32 // bits
    return layer["weight"].shape[-1]


def _refuse_count(where: str, what: str, value: int, size: int) -> None:
    multiple = "an even number" if size == 2 else f"a multiple of {size}"
    raise ValueError(
        f"{where}: {value} {what} cannot be split evenly across {size} ranks; use a model whose "
        f"sizes are {multiple}, or {'one Mac' if size == 2 else 'a number of ranks that divides it'}"
    )


def check_cut(layer: Any, kind: str, size: int, where: str) -> None:
    """Raise, naming the values and the fix, if `layer` cannot be cut `size` ways by `kind`.

    `layer` is one of CUTTABLE, or a bare array for a "heads" cut (attention sinks).
    """
    if kind not in CUT_KINDS:
        raise ValueError(f"{where}: unknown cut {kind!r}; use one of {CUT_KINDS}")
    if isinstance(layer, mx.array):
        if kind != "heads":
            raise TypeError(f"{where} is a bare array; only a 'heads' cut applies to it")
        if layer.shape[0] % size:
            _refuse_count(where, "heads", layer.shape[0], size)
        return
    if not isinstance(layer, CUTTABLE):
        raise TypeError(
            f"{where} is a {type(layer).__name__}; split_model cuts only "
            f"{', '.join(c.__name__ for c in CUTTABLE)}"
        )
    unknown = {k for k, v in layer.items() if isinstance(v, mx.array)} - {*_WEIGHT_ARRAYS, "bias"}
    if unknown:
        raise ValueError(
            f"{where} ({type(layer).__name__}) holds arrays {sorted(unknown)} that split_model "
            f"does not know how to cut; this quantization mode is not supported"
        )
    weight = layer["weight"]
    if kind == "heads":
        if weight.shape[0] % size:
            _refuse_count(where, "heads", weight.shape[0], size)
        return
    if kind == "out":
        if weight.shape[-2] % size:
            _refuse_count(where, "output features", weight.shape[-2], size)
        return
    inputs = _input_features(layer)
    if inputs % size:
        _refuse_count(where, "input features", inputs, size)
    group_size = getattr(layer, "group_size", None)
    if group_size is not None and (inputs // size) % group_size:
        raise ValueError(
            f"{where}: {inputs} input features split across {size} ranks give {inputs // size} "
            f"per rank, not a multiple of the quantization group_size={group_size}; quantize "
            f"with a group size that divides {inputs // size} (e.g. mlx_lm.convert "
            f"--q-group-size 32)"
        )


def _axes(kind: str, name: str) -> Optional[int]:
    """The axis array `name` of a layer is cut along, or None for "not cut here"."""
    if kind == "heads":
        return 0
    if name == "bias":
        return -1 if kind == "out" else None
    return -2 if kind == "out" else -1


def _keep_rank_part(a: mx.array, axis: int, rank: int, size: int) -> mx.array:
    # contiguous() makes the part its own buffer: a plain slice is a view that would keep the
    # whole tensor alive, which is exactly the memory the split exists to save.
    return mx.contiguous(mx.split(a, size, axis=axis)[rank])


def cut_array(a: mx.array, axis: int, group: Any, key: str, read_part: Optional[ReadPart] = None) -> mx.array:
    """This rank's part of `a` along `axis`, read from disk by `read_part` when it can, evaluated."""
    rank, size = rank_and_size(group)
    part = read_part(key, a, axis) if read_part else None
    if part is None:
        part = _keep_rank_part(a, axis, rank, size)
    mx.eval(part)
    return part


def cut_layer(
    layer: nn.Module,
    kind: str,
    group: Any,
    where: str = "layer",
    read_part: Optional[ReadPart] = None,
    *,
    bias_once: bool = False,
) -> nn.Module:
    """Keep this rank's part of `layer`'s arrays ("out", "in" or "heads" cut), in place.

    An "in" cut leaves the bias whole; with bias_once=True ranks other than 0 zero it, so a
    layer that stays inside a block summed by one gate adds it once. Each part is evaluated as
    soon as it is cut and the whole array dropped: a lazily loaded model never holds more than
    one whole tensor at a time (none with `read_part`).
    """
    rank, size = rank_and_size(group)
    check_cut(layer, kind, size, where)
    for name in _WEIGHT_ARRAYS + ("bias",):
        if layer.get(name) is None:
            continue
        axis = _axes(kind, name)
        if axis is not None:
            layer[name] = cut_array(layer[name], axis, group, f"{where}.{name}", read_part)
        elif bias_once and rank != 0:
            layer[name] = mx.zeros(layer[name].shape, layer[name].dtype)
    return layer


def _gather_last_axis(x: mx.array, group: Collective) -> mx.array:
    """The ranks' x concatenated along the last axis (the vocabulary), in rank order."""
    # all_gather stacks along axis 0: [size * B, ..., V / size]. Cut it back into the ranks'
    # pieces and lay them side by side, which is the unsplit logits' vocabulary order.
    pieces = mx.split(group.all_gather(x), group.size(), axis=0)
    return mx.concatenate(pieces, axis=-1)


class AllSumGate(nn.Module):
    """The gate: every rank passes its partial sum in, every rank gets the same total back.

    Drop it into model code wherever ranks hold partial sums of one tensor, e.g. after a row
    parallel matmul: `y = AllSumGate(group)(x @ w_part.T)`.
    """

    def __init__(self, group: Any):
        super().__init__()
        self.group = as_collective(group)

    def __call__(self, x: mx.array) -> mx.array:
        return self.group.all_sum(x)


class ColumnParallelLinear(nn.Module):
    """A Linear (or QuantizedLinear) holding this rank's part of the output features.

    No communication: the output is this rank's slice of the features (its heads, its MLP
    channels), consumed by a RowParallelLinear. Build it from a whole layer with from_linear.
    """

    cut_kind = "out"

    def __init__(self, linear: nn.Module, group: Any):
        super().__init__()
        self.linear = linear

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(x)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Any, where: str = "linear"):
        """Cut a whole layer in place and wrap it."""
        return cls(cut_layer(linear, cls.cut_kind, group, where), group)


class RowParallelLinear(nn.Module):
    """A Linear (or QuantizedLinear) holding this rank's part of the input features, then the gate.

    Each rank multiplies its slice of the features by its slice of the weight, giving a partial
    sum of the whole output; the gate adds the partials. The bias is added once, after the gate:
    added to each partial it would be counted once per rank.
    """

    cut_kind = "in"

    def __init__(self, linear: nn.Module, group: Any):
        super().__init__()
        if linear.get("bias") is not None:
            self.bias = linear["bias"]
            del linear["bias"]
        self.linear = linear
        self.gate = AllSumGate(group)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.gate(self.linear(x))
        return y + self["bias"] if "bias" in self else y

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Any, where: str = "linear"):
        """Cut a whole layer in place and wrap it."""
        return cls(cut_layer(linear, cls.cut_kind, group, where), group)


class VocabParallelEmbedding(nn.Module):
    """An Embedding (or QuantizedEmbedding) holding this rank's part of the vocabulary rows.

    Looking up an id gives its row on the rank that holds it and zeros on the others; the gate
    adds them, so every rank ends with the exact row (x + 0 is exact in floating point). As the
    tied vocabulary projection (`as_linear`) it computes this rank's logits and gathers them.
    """

    cut_kind = "out"

    def __init__(self, embedding: nn.Module, group: Any):
        super().__init__()
        rank, _ = rank_and_size(group)
        self.embedding = embedding
        self.rows = embedding["weight"].shape[0]
        self.first_id = rank * self.rows
        self.group = as_collective(group)
        self.gate = AllSumGate(group)

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.first_id
        mine = (local >= 0) & (local < self.rows)
        rows = self.embedding(mx.where(mine, local, 0))
        return self.gate(mx.where(mine[..., None], rows, 0))

    def as_linear(self, x: mx.array) -> mx.array:
        return _gather_last_axis(self.embedding.as_linear(x), self.group)

    @classmethod
    def from_embedding(cls, embedding: nn.Module, group: Any, where: str = "embedding"):
        """Cut a whole embedding in place and wrap it."""
        return cls(cut_layer(embedding, cls.cut_kind, group, where), group)


class VocabParallelHead(nn.Module):
    """The vocabulary projection holding this rank's part of the vocabulary; logits gathered."""

    cut_kind = "out"

    def __init__(self, linear: nn.Module, group: Any):
        super().__init__()
        self.linear = linear
        self.group = as_collective(group)

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_last_axis(self.linear(x), self.group)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: Any, where: str = "lm_head"):
        """Cut a whole layer in place and wrap it."""
        return cls(cut_layer(linear, cls.cut_kind, group, where), group)


class GatedBlock(nn.Module):
    """A whole block (a mixture of experts) whose layers were cut in place, then one gate.

    Inside, every expert and shared expert holds its part of the intermediate features, so the
    block's output is this rank's partial sum of the routed and shared experts together; one
    gate per block adds the ranks' partials. The router stays whole: every rank routes alike.
    """

    def __init__(self, block: nn.Module, group: Any):
        super().__init__()
        self.block = block
        self.gate = AllSumGate(group)

    def __call__(self, *args, **kwargs) -> mx.array:
        return self.gate(self.block(*args, **kwargs))


SHARDED = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, GatedBlock)
