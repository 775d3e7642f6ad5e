"""The split share: how much of every split count each rank keeps.

Decode is bound by memory bandwidth, so two different Macs finish a step together only when each
holds weights in proportion to its bandwidth; and a model that fits two Macs together but not
half of the smaller one fits only a share that gives the larger Mac more. A share is written
"even" or "A:B[:C...]", one part per rank, rank 0's first ("3:1": rank 0 keeps three quarters of
the heads, the MLP columns, the experts' columns and the vocabulary; "2:1:1": three ranks, rank 0
half). "auto" is resolved from what each rank measured at the hello, before the model is loaded.
split/units.py runs a share as the plan for its units (3:1 as if for 4 ranks), or the nearest
share the model's counts can be cut into; from three ranks up, "even" too is the nearest share
the counts allow (8 KV heads on 3 ranks: 3:3:2), since few models' counts divide by 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import gcd
from typing import Optional, Sequence, Union

# A candidate share's unit count never exceeds this: finer shares gain nothing measurable and each
# candidate costs a run of the plan on a twin.
MAX_UNITS = 64
# The most ranks a share names (the group's own bound).
MAX_RANKS = 8


@dataclass(frozen=True)
class SplitShare:
    """parts[r] / sum(parts) of every split count on rank r; () is even; auto is unresolved."""

    parts: tuple[int, ...] = ()
    auto: bool = False

    @classmethod
    def parse(cls, text: str) -> "SplitShare":
        """ "even", "auto" or "A:B[:C...]" (one part per rank, rank 0's first, whole numbers
        above zero, at most MAX_RANKS of them)."""
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
            raise ValueError(f"split={text!r} is not a share; write even, auto, or A:B[:C...] with one "
                             f"whole number per rank, rank 0's part first (e.g. 3:1, or 2:1:1 for three)")
        if min(parts) <= 0:
            raise ValueError(f"split={text!r} leaves a rank with nothing; every rank needs a part above "
                             f"zero (e.g. 3:1, or 2:1:1), or run the model on fewer Macs")
        if len(parts) > MAX_RANKS:
            raise ValueError(f"split={text!r} names {len(parts)} ranks; a group has at most {MAX_RANKS}")
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

    def wanted(self, size: int) -> tuple[int, ...]:
        """The parts asked for on `size` ranks: these, or one each for even."""
        return self.parts or (1,) * size

    def check(self, size: int) -> None:
        """ValueError for a share the plan cannot take on `size` ranks as it is."""
        if self.auto:
            raise ValueError("split='auto' is resolved at the hello from what each rank measured; give "
                             "load_split the resolved share (even or A:B, e.g. SplitShare.parse('3:1'))")
        if self.parts and len(self.parts) != size:
            example = ":".join(["2"] + ["1"] * (size - 1))
            raise ValueError(f"split={self} names {len(self.parts)} parts for a group of {size} ranks; "
                             f"give one part per rank, rank 0's first (e.g. {example}), or even")

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


def _apportioned(wanted: Sequence[Fraction], units: int, caps: Optional[Sequence[float]]) -> Optional[tuple[int, ...]]:
    """`units` units among the ranks, each at least one and at most caps[r] of the whole, with
    the slowest rank's step (its part over its wanted part) as short as it can be; None where
    no such cut exists. One unit at a time goes to the rank it overloads least (a tie to the
    lower rank), which keeps that maximum at its least at every count."""
    size = len(wanted)
    limits = [units] * size if caps is None else [int(cap * units + 1e-9) for cap in caps]
    if units < size or min(limits) < 1:
        return None
    counts = [1] * size
    for _ in range(units - size):
        free = [r for r in range(size) if counts[r] < limits[r]]
        if not free:
            return None
        best = min(free, key=lambda r: ((counts[r] + 1) / wanted[r], r))
        counts[best] += 1
    return tuple(counts)


def pair_cut_rules(size: int) -> bool:
    """Whether a split over `size` ranks keeps the rules two ranks have always had: an even
    share is 1:1 exactly (a count that does not divide by two is refused, not rounded) and an
    uneven one may take any cut of the units. From three ranks, even is the nearest cut the
    counts allow (8 KV heads on 3: 3:3:2) and each unit count offers its quickest cut. The one
    place the split tells the two apart: a model split 1:1 before groups of N splits the same."""
    return size == 2


def nearest_cuts(share: SplitShare, size: int, granules: int,
                 caps: Optional[Sequence[float]] = None) -> list[UnitCut]:
    """The cuts a model whose counts all divide into `granules` units can take on `size` ranks,
    the one nearest `share` first (`share` even: one part each); with `caps`, only those giving
    each rank r at most caps[r] of the whole.

    Nearest in step time, taking the share for the ranks' speeds: a step waits for the slowest
    rank, so of the cuts on either side of the wanted one, the one that overloads the faster
    rank is the nearer unless it is much further off (3:1 on sixths: 5:1, whose step is 1.11x
    the wanted one's, before 2:1 at 1.33x); then by distance, then the coarser. Two ranks list
    every cut (a pair's even share is 1:1 as it is: only an uneven one is rounded); more list,
    for each unit count, the quickest cut of it (8 KV heads on 3 ranks, even: 3:3:2)."""
    if size < 2 or (pair_cut_rules(size) and not share.parts):
        return [UnitCut((1,) * size)]
    parts = share.wanted(size)
    wanted = [Fraction(p, sum(parts)) for p in parts]
    found: set[tuple[int, ...]] = set()
    if pair_cut_rules(size):
        found.add((1, 1))
        for units in range(2, min(granules, MAX_UNITS) + 1):
            if granules % units == 0:
                found.update((u, units - u) for u in range(1, units) if gcd(u, units) == 1)
    else:
        for units in range(size, min(granules, MAX_UNITS) + 1):
            counts = _apportioned(wanted, units, caps) if granules % units == 0 else None
            if counts is not None:
                common = gcd(*counts)
                found.add(tuple(c // common for c in counts))

    def order(counts: tuple[int, ...]) -> tuple:
        units = sum(counts)
        step = max(Fraction(c, units) / w for c, w in zip(counts, wanted))
        return step, sum(abs(Fraction(c, units) - w) for c, w in zip(counts, wanted)) / 2, units, counts

    fits = (lambda c: True) if caps is None else (lambda c: all(n / sum(c) <= cap for n, cap in zip(c, caps)))
    return [UnitCut(c) for c in sorted(found, key=order) if fits(c)]


__all__ = ["EVEN", "MAX_RANKS", "MAX_UNITS", "SplitSettings", "SplitShare", "UnitCut", "nearest_cuts"]
