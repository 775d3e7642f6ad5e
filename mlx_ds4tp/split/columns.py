"""The MLP's columns cut finer than the heads.

A share is cut in whole units of a count (split/units.py), so one count that divides coarsely
would set the share of everything: a model with 8 KV heads takes shares in eighths, one with 2
only 1:1, though its MLP (most of a step's bytes: 2816 columns are 88 groups of 32) could take
nearly any. Each block's partials are summed on their own (attention's after o_proj, the MLP's
after down_proj), and nothing a plan does couples the two, so the MLP's and experts' columns, and
the vocabulary with them, take a share of their own: 2:1 where the heads can only give 3:1.
With speeds 2:1, two Macs then finish the MLP and the logits together, and only attention waits.

The columns' cut is computed, not run: the plan can only run for a unit count every head count
divides. It is run for the heads' units; an array outside the attention (no module above it has
a count the plan divides) that the twins show cut, unit by unit, as one equal slice of each of
its segments (a GLU's gate, up and down; an expert stack's; a fused gate_up's two halves) is
recut at the columns' units, in whole quantization groups (32 columns for float weights). Any
other cut (interleaved, per-head slices) keeps the heads' share for the whole model.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .derive import ArrayCut, ShardPlan
from .share import UnitCut

Runs = tuple[tuple[int, int], ...]


def under(path: str, modules: set[str]) -> bool:
    """Whether the array or module at `path` lies inside one of `modules`."""
    return any(path == m or path.startswith(m + ".") for m in modules)


def column_paths(plan: ShardPlan) -> set[str]:
    """The arrays the plan cuts or rescales outside every module whose counts it divides."""
    heads = {path for path, _ in plan.divided}
    return {p for p in (*plan.axes, *plan.replaced) if not under(p, heads)}


def segments(per_unit: Sequence[Runs]) -> Optional[list[tuple[int, int]]]:
    """[start, stop) of each segment when unit u of n keeps slice u of every one of them, in
    order; None for any other cut."""
    n, first = len(per_unit), per_unit[0]
    found = [(a, a + n * (b - a)) for a, b in first]
    for u, runs in enumerate(per_unit):
        if len(runs) != len(first):
            return None
        for (start, stop), run in zip(found, runs):
            width = (stop - start) // n
            if run != (start + u * width, start + (u + 1) * width):
                return None
    return found


def recut(cut: ArrayCut, spans: list[tuple[int, int]], granule: int, columns: UnitCut, rank: int) -> Optional[ArrayCut]:
    """`cut` for rank's units of `columns`: its slice of every segment, in whole granules;
    None where a segment does not divide so."""
    units, first, count = columns.units, columns.first(rank), columns.counts[rank]
    runs = []
    for start, stop in spans:
        if (stop - start) % (units * granule):
            return None
        width = (stop - start) // units
        runs.append((start + first * width, start + (first + count) * width))
    return ArrayCut(cut.path, cut.shape, cut.axis, tuple(runs))


__all__ = ["column_paths", "recut", "segments", "under"]
