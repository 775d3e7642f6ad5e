"""The collective seam: how the vocabulary split and AllSumGate reach the other ranks.

A split layer holds a `Collective` and calls `self.group.all_sum(x)` / `self.group.all_gather(x)`.
`as_collective` makes one of any group:

- an `mx.distributed.Group` (the pair's group mlx_ds4tp.init returns, MLX's ring, JACCL, MPI):
  wrapped once in `MlxCollective`;
- any object of the user's own with `rank()`, `size()`, `all_sum(x)`, `all_gather(x)`: as is.

An object with only `rank()` and `size()` is enough to cut weights (cutting never talks to the
other ranks); its first collective raises, naming what is missing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import mlx.core as mx


@runtime_checkable
class Collective(Protocol):
    """What a split model needs from its group: who it is, and the two collectives."""

    def rank(self) -> int:
        """This process's rank, 0 .. size() - 1."""

    def size(self) -> int:
        """How many ranks hold a part of the model."""

    def all_sum(self, x: mx.array) -> mx.array:
        """x summed over the ranks: same shape and dtype, identical bits on every rank."""

    def all_gather(self, x: mx.array) -> mx.array:
        """The ranks' x concatenated along axis 0, in rank order."""


class MlxCollective:
    """An mx.distributed.Group (ring, JACCL, MPI) seen as a Collective."""

    def __init__(self, group: "mx.distributed.Group"):
        self.group = group

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def all_sum(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.group)

    def all_gather(self, x: mx.array) -> mx.array:
        return mx.distributed.all_gather(x, group=self.group)

    def __repr__(self) -> str:
        return f"<MlxCollective rank={self.rank()} size={self.size()}>"


class _RankOnly:
    """A group that can say who it is but has no collectives: fine for cutting, refused at a gate."""

    def __init__(self, group: Any):
        self.group = group

    def rank(self) -> int:
        return int(self.group.rank())

    def size(self) -> int:
        return int(self.group.size())

    def _refuse(self, name: str) -> None:
        raise TypeError(
            f"group={self.group!r} is neither an mlx_ds4tp Group nor an mx.distributed.Group and "
            f"has no {name}(x) method; pass the group from mlx_ds4tp.init(...) or "
            f"mx.distributed.init(...), or give your object all_sum(x) and all_gather(x)"
        )

    def all_sum(self, x: mx.array) -> mx.array:
        self._refuse("all_sum")

    def all_gather(self, x: mx.array) -> mx.array:
        self._refuse("all_gather")


def as_collective(group: Any) -> Collective:
    """`group` as a Collective: ours and the user's as they are, MLX's wrapped once.

    Raises TypeError when `group` cannot even say its rank and size.
    """
    if isinstance(group, mx.distributed.Group):
        return MlxCollective(group)
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise TypeError(
            f"group={group!r} has no rank()/size(); pass the group from mlx_ds4tp.init(...) "
            f"or mx.distributed.init(...)"
        )
    if callable(getattr(group, "all_sum", None)) and callable(getattr(group, "all_gather", None)):
        return group
    return _RankOnly(group)


__all__ = ["Collective", "MlxCollective", "as_collective"]
