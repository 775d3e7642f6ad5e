"""The vocabulary split we add on top of every plan, and the gate for user code.

A plan (mlx-lm's own or ours) cuts the blocks; the embedding and the vocabulary projection are
ours to cut: each rank keeps a part of the vocabulary rows (an Embedding's weight, a Linear's
output features; with a quantized layer its scales and biases alike, which are laid out by row).
A lookup is summed over the ranks (the row comes from the rank that holds it, zeros from the
others); the logits' parts are gathered.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..collectives.seam import Collective, as_collective

_WEIGHT_ARRAYS = ("weight", "scales", "biases", "bias")
VOCAB_LAYERS = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)

# read_part(key, whole, axis, runs=None) -> this rank's part of the array saved under `key`,
# read from disk, or None to cut `whole` in memory instead. `whole` is the layer's (usually
# still lazy) array; runs, when given, are the [start, stop) ranges of `axis` to keep.
ReadPart = Callable[..., Optional[mx.array]]


def rank_and_size(group: Any) -> tuple[int, int]:
    """(rank, size) of any group split_model accepts; TypeError naming it otherwise."""
    collective = as_collective(group)
    return int(collective.rank()), int(collective.size())


def check_rows(layer: Any, size: int, where: str) -> None:
    """Raise, naming the values and the fix, if `layer`'s vocabulary rows cannot be cut `size` ways."""
    if not isinstance(layer, VOCAB_LAYERS):
        raise TypeError(f"{where} is a {type(layer).__name__}; the vocabulary split cuts only "
                        f"{', '.join(c.__name__ for c in VOCAB_LAYERS)}")
    rows = layer["weight"].shape[0]
    if rows % size:
        raise ValueError(
            f"{where}: {rows} output features cannot be split evenly across {size} ranks; use a "
            f"model whose sizes are a multiple of {size}, or a number of ranks that divides it (one "
            "Mac always does)"
        )


def _keep_rows(whole: mx.array, start: int, stop: int) -> mx.array:
    # contiguous() makes the part its own buffer: a plain slice is a view that would keep the
    # whole tensor alive, which is exactly the memory the split exists to save.
    return mx.contiguous(whole[start:stop])


def cut_rows(layer: nn.Module, rows: tuple[int, int], where: str = "layer",
             read_part: Optional[ReadPart] = None) -> nn.Module:
    """Keep `layer`'s vocabulary rows [start, stop), in place, each array read from disk by
    `read_part` when it can and evaluated at once."""
    start, stop = rows
    for name in _WEIGHT_ARRAYS:
        whole = layer.get(name)
        if whole is None:
            continue
        part = read_part(f"{where}.{name}", whole, 0, runs=(rows,)) if read_part else None
        if part is None:
            part = _keep_rows(whole, start, stop)
        mx.eval(part)
        layer[name] = part
    return layer


def _gather_last_axis(x: mx.array, group: Collective, bounds: tuple[int, ...]) -> mx.array:
    """The ranks' x concatenated along the last axis (the vocabulary), in rank order; rank r's
    x holds bounds[r + 1] - bounds[r] columns."""
    widths = [b - a for a, b in zip(bounds, bounds[1:])]
    widest = max(widths)
    # all_gather moves equal shapes only: an uneven share's narrower part is padded with zeros
    # to the widest and the padding dropped again, the same bytes on every rank.
    if x.shape[-1] < widest:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, widest - x.shape[-1])])
    # all_gather stacks along axis 0: [size * B, ..., widest]. Cut it back into the ranks'
    # pieces and lay them side by side, which is the unsplit logits' vocabulary order.
    pieces = mx.split(group.all_gather(x), group.size(), axis=0)
    return mx.concatenate([piece[..., :width] for piece, width in zip(pieces, widths)], axis=-1)


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


class VocabParallelEmbedding(nn.Module):
    """An Embedding (or QuantizedEmbedding) holding this rank's part of the vocabulary rows:
    ids bounds[rank] to bounds[rank + 1].

    Looking up an id gives its row on the rank that holds it and zeros on the others; the gate
    adds them, so every rank ends with the exact row (x + 0 is exact in floating point). As the
    tied vocabulary projection (`as_linear`) it computes this rank's logits and gathers them.
    """

    def __init__(self, embedding: nn.Module, group: Any, bounds: tuple[int, ...]):
        super().__init__()
        rank, _ = rank_and_size(group)
        self.embedding = embedding
        self.bounds = tuple(bounds)
        self.first_id, self.rows = bounds[rank], bounds[rank + 1] - bounds[rank]
        self.group = as_collective(group)

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.first_id
        mine = (local >= 0) & (local < self.rows)
        rows = self.embedding(mx.where(mine, local, 0))
        return self.group.all_sum(mx.where(mine[..., None], rows, 0))

    def as_linear(self, x: mx.array) -> mx.array:
        return _gather_last_axis(self.embedding.as_linear(x), self.group, self.bounds)


class VocabParallelHead(nn.Module):
    """The vocabulary projection holding this rank's part of the vocabulary (rows bounds[rank]
    to bounds[rank + 1]); logits gathered."""

    def __init__(self, linear: nn.Module, group: Any, bounds: tuple[int, ...]):
        super().__init__()
        self.linear = linear
        self.bounds = tuple(bounds)
        self.group = as_collective(group)

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_last_axis(self.linear(x), self.group, self.bounds)


SHARDED = (VocabParallelEmbedding, VocabParallelHead)
