"""A split share as the plan runs it: every count cut into equal units, each rank a run of them.

mlx-lm's plans (and ours) cut every count into group.size() equal parts. A share such as 3:1 is
run as the plan for 4 ranks (units), on twins of the model: each unit's indices of every cut
array, and the counts the plan divides. A rank keeping units [first, first + count) then holds
the union of its units' indices (its query heads with their KV heads, its MLP and experts'
columns, in order), every divided count times `count`, and the plan's group replaced by the real
one, whose sums are still full-size: an uneven split changes no collective. The vocabulary is
ours, cut at any row in proportion (split/layers.py).

The units must be whole: every head count divisible by the unit count, every MLP or expert width
a whole number of quantization groups per unit (32 columns for float weights, so each rank's
matrices keep the widths the kernels are fast at). Where the wanted share cannot be cut so, the
nearest that can is used and logged. A plan that does more with the group than cut and sum (a
norm that divides by the group's size, an array it derives from it) splits evenly, logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..base.log import log
from ..collectives.backend import cut_only_group
from .derive import ArrayCut, ShardPlan, derive_plan, set_array
from .share import SplitShare, UnitCut, nearest_cuts

# MLP and expert columns per unit of a float model: a multiple of the kernels' tile width.
FLOAT_COLUMNS = 32


@dataclass(frozen=True)
class Layout:
    """How this rank splits the model: the cut, the plan as the twins showed it for this rank's
    units (plan.cuts: this rank's indices), and the group the plan runs over (the real group for
    an even cut, a cut-only group of cut.units ranks otherwise)."""

    cut: UnitCut
    rank: int
    plan: ShardPlan
    plan_group: Any

    @property
    def count(self) -> int:
        """The units this rank keeps (1: the plan's own cut is this rank's part)."""
        return self.cut.counts[self.rank]

    @property
    def scaled(self) -> list[str]:
        """Arrays the plan divided by the unit count (a bias added once per unit)."""
        return [p for p, v in self.plan.replaced.items() if v is not None and abs(v * self.cut.units - 1) < 1e-6]


class _ShareBound(Exception):
    """The plan does something only an even cut follows."""


def _granules(model: nn.Module, base: ShardPlan) -> tuple[int, list[tuple[int, str]]]:
    """(G, counts): every count the plan cuts divides into G whole units, and each count as
    (its whole units, its name) for the log."""
    shapes = {p: v.shape for p, v in tree_flatten(model.parameters())}
    modules = dict(model.named_modules())
    heads = {path for path, _ in base.divided}
    counts = [(value, f"{path}.{attr}={value}") for (path, attr), value in base.divided.items()]
    for path, axis in base.axes.items():
        owner = path.rsplit(".", 1)[0]
        n = shapes[path][axis]
        intermediate = (path.endswith(".weight") and axis == len(shapes[path]) - 2
                        and owner not in heads and owner.rsplit(".", 1)[0] not in heads)
        if intermediate:
            granule = getattr(modules.get(owner), "group_size", None) or FLOAT_COLUMNS
            counts.append((n // granule if n % granule == 0 else 1,
                           f"{owner}: {n} columns in groups of {granule}"))
        else:
            counts.append((n, f"{path}: {n} along axis {axis}"))
    common = 0
    for units, _ in counts:
        common = gcd(common, units)
    return common, counts


def _checked_runs(path: str, per_unit: list[tuple[tuple[int, int], ...]]) -> None:
    """Each unit's indices in order and no index in two units, or _ShareBound."""
    spans = sorted(run for runs in per_unit for run in runs)
    ordered = all(a[1] <= b[0] for runs in per_unit for a, b in zip(runs, runs[1:]))
    if not ordered or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise _ShareBound(f"its cut of {path} repeats or reorders indices between ranks")


def _merged(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for a, b in sorted(runs):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _unit_plan(model: nn.Module, shard: Callable, cut: UnitCut, rank: int, label: str) -> ShardPlan:
    """The plan for this rank's units of `cut`, from every unit's trace (both ranks check the
    same things, so both take the same cut)."""
    per_unit = [derive_plan(model, cut_only_group(u, cut.units), shard, trace=True, label=label)
                for u in range(cut.units)]
    first = per_unit[0]
    reasons = list(first.share_bound) + [f"its cut of {p} is not a selection" for p in first.underived]
    reasons += [f"it changes the values of {p}" for p, v in first.replaced.items()
                if v is None or not (abs(v - 1) < 1e-6 or abs(v * cut.units - 1) < 1e-6)]
    if reasons:
        raise _ShareBound(reasons[0])
    mine = range(cut.first(rank), cut.first(rank) + cut.counts[rank])
    plan = ShardPlan(axes=first.axes, divided=first.divided, replaced=first.replaced)
    for path, axis in first.axes.items():
        runs = [p.cuts[path].runs for p in per_unit]
        _checked_runs(path, runs)
        plan.cuts[path] = ArrayCut(path, first.cuts[path].shape, axis, _merged([r for u in mine for r in runs[u]]))
    return plan


def choose_layout(model: nn.Module, group: Any, shard: Callable, share: SplitShare, *,
                  trace: bool, label: str) -> Layout:
    """The cut nearest `share` that this model's counts and plan allow, for group.rank(); the
    plan's errors (ValueError naming the layer and the fix) as for an even split."""
    size, rank = int(group.size()), int(group.rank())
    share.check(size)
    even = UnitCut((1,) * size)
    if share.is_even:
        return Layout(even, rank, derive_plan(model, group, shard, trace=trace, label=label), group)
    base = derive_plan(model, group, shard, trace=False, label=label)
    granules, counts = _granules(model, base)
    wanted = UnitCut(share.parts)
    for cut in nearest_cuts(share, size, granules):
        if cut.is_even:
            break
        try:
            plan = _unit_plan(model, shard, cut, rank, label)
        except _ShareBound as reason:
            log(f"split {share}: {label} can only split evenly ({reason}); splitting 1:1")
            return Layout(even, rank, derive_plan(model, group, shard, trace=trace, label=label), group)
        except ValueError:
            continue
        if cut != wanted:
            log(f"split {share} is not a whole number of units of every count; using {cut}, the nearest "
                f"that is ({_limits(counts, wanted.units)})")
        return Layout(cut, rank, plan, cut_only_group(cut.first(rank), cut.units))
    log(f"split {share}: no share but 1:1 cuts every count into whole units "
        f"({_limits(counts, wanted.units)}); splitting 1:1")
    return Layout(even, rank, derive_plan(model, group, shard, trace=trace, label=label), group)


def share_granules(model: nn.Module, shard: Callable, label: str) -> int:
    """G: every count the plan cuts divides into G whole units, so a load takes any share u/n
    with n dividing G as it is (the shares `--split auto` picks among, split/auto.py)."""
    base = derive_plan(model, cut_only_group(0, 2), shard, trace=False, label=label)
    return _granules(model, base)[0]


def _limits(counts: list[tuple[int, str]], units: int) -> str:
    short = [name for whole, name in counts if whole % units]
    if not short:
        return "the plan refused it"
    return f"{len(short)} count(s) do not divide into {units}: " + ", ".join(short[:3])


def run_plan(layout: Layout, model: nn.Module, shard: Callable, group: Any) -> None:
    """Run the plan on the model for this rank's units; the cut arrays still hold one unit's
    part (split_model puts this rank's in)."""
    shard(model, layout.plan_group)
    if layout.plan_group is group:
        return
    count, units = layout.count, layout.cut.units
    modules = dict(model.named_modules())
    for (path, attr), whole in layout.plan.divided.items():
        setattr(modules[path], attr, whole * count // units)
    for module in modules.values():
        for attr, value in list(vars(module).items()):
            if value is layout.plan_group:
                setattr(module, attr, group)
    arrays = dict(tree_flatten(model.parameters()))
    for path in layout.scaled:
        set_array(model, path, arrays[path] * count)


def take_runs(whole: mx.array, cut: ArrayCut) -> mx.array:
    """`cut`'s indices of `whole` along its axis, as an array of its own."""
    index = [slice(None)] * whole.ndim
    pieces = []
    for a, b in cut.runs:
        index[cut.axis] = slice(a, b)
        pieces.append(whole[tuple(index)])
    return mx.contiguous(mx.concatenate(pieces, axis=cut.axis) if len(pieces) > 1 else pieces[0])


def part_shape(cut: ArrayCut) -> tuple[int, ...]:
    shape = list(cut.shape)
    shape[cut.axis] = sum(b - a for a, b in cut.runs)
    return tuple(shape)


__all__ = ["FLOAT_COLUMNS", "Layout", "choose_layout", "part_shape", "run_plan", "share_granules",
           "take_runs"]
