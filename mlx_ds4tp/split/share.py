"""The split share: how much of every split count each rank keeps.

Decode is bound by memory bandwidth, so two different Macs finish a step together only when each
holds weights in proportion to its bandwidth; and a model that fits two Macs together but not
half of the smaller one fits only a share that gives the larger Mac more. A share is written
"even" or "A:B", rank 0's part first ("3:1": rank 0 keeps three quarters of the heads, the MLP
columns, the experts' columns and the vocabulary). "auto" is resolved from what each rank measured
at the hello, before the model is loaded. split/units.py runs a share as the plan for its units
(3:1 as if for 4 ranks), or the nearest share the model's counts can be cut into.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import gcd
from typing import Union

# A candidate share's unit count never exceeds this: finer shares gain nothing measurable and each
# candidate costs a run of the plan on a twin.
MAX_UNITS = 64


@dataclass(frozen=True)
class SplitShare:
    """parts[r] / sum(parts) of every split count on rank r; () is even; auto is unresolved."""

    parts: tuple[int, ...] = ()
    auto: bool = False

    @classmethod
    def parse(cls, text: str) -> "SplitShare":
        """ "even", "auto" or "A:B" (rank 0's part first, whole numbers above zero)."""
        value = text.strip().lower()
        if value == "even":
            return cls()
        if value == "auto":
            return cls(auto=True)
        pieces = value.split(":")
        try:
            parts = tuple(int(p) for p in pieces)
        except ValueError:
            parts = ()
        if len(pieces) < 2 or len(parts) != len(pieces):
            raise ValueError(f"split={text!r} is not a share; write even, auto, or A:B with rank 0's "
                             f"part first in whole numbers (e.g. 3:1)")
        if min(parts) <= 0:
            raise ValueError(f"split={text!r} leaves a rank with nothing; every rank needs a part above "
                             f"zero (e.g. 3:1), or run the model on one Mac")
        common = gcd(*parts)
        parts = tuple(p // common for p in parts)
        return cls() if len(set(parts)) == 1 else cls(parts=parts)

    @classmethod
    def of(cls, value: Union["SplitShare", str]) -> "SplitShare":
        """A SplitShare as it is, a string parsed."""
        return value if isinstance(value, SplitShare) else cls.parse(value)

    @property
    def is_even(self) -> bool:
        return not self.parts and not self.auto

    @property
    def fraction(self) -> float:
        """Rank 0's part of the whole (1/2 for even)."""
        return self.parts[0] / sum(self.parts) if self.parts else 0.5

    def check(self, size: int) -> None:
        """ValueError for a share the plan cannot take on `size` ranks as it is."""
        if self.auto:
            raise ValueError("split='auto' is resolved at the hello from what each rank measured; give "
                             "load_split the resolved share (even or A:B, e.g. SplitShare.parse('3:1'))")
        if self.parts and len(self.parts) != size:
            raise ValueError(f"split={self} names {len(self.parts)} parts for a group of {size} ranks; "
                             f"give one part per rank, or even")

    def __str__(self) -> str:
        return "auto" if self.auto else ":".join(map(str, self.parts)) if self.parts else "even"


EVEN = SplitShare()


@dataclass(frozen=True)
class SplitSettings:
    """This rank's --split: the share it asks for (the leader's decides), whether it was given
    (a worker without one takes the leader's silently), and the cap on the memory it reports
    for auto (DS4_TP_MEMORY_LIMIT_BYTES; 0: the machine's)."""

    share: SplitShare = EVEN
    given: bool = False
    memory_limit: int = 0

    def measures(self, role: str) -> bool:
        """Whether this rank measures its figures at start: a worker always (its leader may ask
        for auto), a leader only for auto."""
        return role == "worker" or self.share.auto


@dataclass(frozen=True)
class UnitCut:
    """A share as the plan runs it: every count cut into `units` units, rank r keeping `counts[r]`
    of them, rank 0's first."""

    counts: tuple[int, ...]

    @property
    def units(self) -> int:
        return sum(self.counts)

    def first(self, rank: int) -> int:
        return sum(self.counts[:rank])

    @property
    def is_even(self) -> bool:
        return len(set(self.counts)) == 1

    def bounds(self, whole: int) -> tuple[int, ...]:
        """Where each rank's part of `whole` rows starts, and the end: rows cut in proportion
        (the vocabulary, which is ours to cut at any row)."""
        return tuple(whole * self.first(r) // self.units for r in range(len(self.counts) + 1))

    def __str__(self) -> str:
        return ":".join(map(str, self.counts))


def nearest_cuts(share: SplitShare, size: int, granules: int) -> list[UnitCut]:
    """The cuts a model whose counts all divide into `granules` units can take, the one nearest
    `share` first, the even cut among them; two ranks only (more split evenly).

    Nearest in step time, taking the share for the ranks' speeds: a step waits for the slower
    rank, so of the cuts on either side of the wanted one, the one that overloads the faster
    rank is the nearer unless it is much further off (3:1 on sixths: 5:1, whose step is 1.11x
    the wanted one's, before 2:1 at 1.33x); then by distance, then the coarser."""
    if not share.parts or size != 2:
        return [UnitCut((1,) * size)]
    wanted = Fraction(share.parts[0], sum(share.parts))
    found = {Fraction(1, 2)}
    for units in range(2, min(granules, MAX_UNITS) + 1):
        if granules % units == 0:
            found.update(Fraction(u, units) for u in range(1, units))

    def step(f: Fraction) -> Fraction:
        return max(f / wanted, (1 - f) / (1 - wanted))

    ordered = sorted(found, key=lambda f: (step(f), abs(f - wanted), f.denominator))
    return [UnitCut((f.numerator, f.denominator - f.numerator)) for f in ordered]


__all__ = ["EVEN", "MAX_UNITS", "SplitSettings", "SplitShare", "UnitCut", "nearest_cuts"]
