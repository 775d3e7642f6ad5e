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
matrices keep the widths the kernels are fast at); the MLP's columns and the vocabulary take a
share of their own where they can (split/columns.py). Where the wanted share cannot be cut so,
the nearest that can is used and logged. A plan that does more with the group than cut and sum (a
norm that divides by the group's size, an array it derives from it) splits evenly, logged.

The same runs for N ranks: a rank's units are a run of the cut, however many ranks share it. On
three or more ranks an even share whose counts do not divide by N (8 KV heads on 3) is the
nearest cut too (3:3:2), logged; every rank keeps at least one unit, and a model with fewer
units of a count than ranks is refused naming the count and the group sizes it allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import gcd, lcm
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..base.log import log
from ..collectives.backend import cut_only_group
from .columns import column_paths, recut, segments
from .derive import ArrayCut, ShardPlan, derive_plan, set_array
from .errors import EvenCutOnlyError
from .share import MAX_RANKS, MAX_UNITS, SplitShare, UnitCut, nearest_cuts, pair_cut_rules

# MLP and expert columns per unit of a float model: a multiple of the kernels' tile width.
FLOAT_COLUMNS = 32


@dataclass(frozen=True)
class Layout:
    """How this rank splits the model: the heads' cut, the plan as the twins showed it for this
    rank's units (plan.cuts: this rank's indices), the group the plan runs over (the real group
    for an even cut, a cut-only group of cut.units ranks otherwise), and the columns' cut with
    the arrays it applies to (split/columns.py; the heads' cut and none where they share it)."""

    cut: UnitCut
    rank: int
    plan: ShardPlan
    plan_group: Any
    columns: Optional[UnitCut] = None
    column_arrays: frozenset = frozenset()

    @property
    def count(self) -> int:
        """The units of the heads' cut this rank keeps (1: the plan's own cut is its part)."""
        return self.cut.counts[self.rank]

    @property
    def vocab(self) -> UnitCut:
        """The cut of the vocabulary's rows: the columns' (the finer), or the heads'."""
        return self.columns or self.cut

    @property
    def is_even(self) -> bool:
        return self.cut.is_even and self.vocab.is_even

    def fraction(self, path: str) -> Fraction:
        """The part of the whole this rank keeps of the array at `path` (its class's share)."""
        return self.fraction_of(path, self.rank)

    def fraction_of(self, path: str, rank: int) -> Fraction:
        """The part of the whole `rank` keeps of the array at `path` (the cut is every rank's)."""
        cut = self.columns if path in self.column_arrays else self.cut
        return Fraction(cut.counts[rank], cut.units)

    def takes_runs(self, path: str) -> bool:
        """Whether the array's part must be taken by its runs (the plan's own cut is one unit
        of the heads' cut)."""
        return self.count > 1 or path in self.column_arrays

    @property
    def scaled(self) -> list[str]:
        """Arrays the plan divided by the unit count (a bias added once per unit)."""
        return [p for p, v in self.plan.replaced.items() if v is not None and abs(v * self.cut.units - 1) < 1e-6]

    def describe(self) -> str:
        """What this rank keeps, for the log."""
        heads = f"{self.count} of {self.cut.units} units"
        if self.columns is None:
            return f"rank {self.rank} keeps {heads} of every split count (split {self.cut})"
        return (f"rank {self.rank} keeps {heads} of the attention's counts (split {self.cut}) and "
                f"{self.columns.counts[self.rank]} of {self.columns.units} of the MLP's columns and the "
                f"vocabulary (split {self.columns})")


def _granule(path: str, shape: tuple[int, ...], axis: int, modules: dict, heads: set[str]) -> int:
    """The indices of `path`'s cut axis a unit must keep whole: an MLP or expert weight's output
    columns in quantization groups (FLOAT_COLUMNS for float weights), anything else by one."""
    owner = path.rsplit(".", 1)[0]
    intermediate = (path.endswith(".weight") and axis == len(shape) - 2
                    and owner not in heads and owner.rsplit(".", 1)[0] not in heads)
    return (getattr(modules.get(owner), "group_size", None) or FLOAT_COLUMNS) if intermediate else 1


def _counts(model: nn.Module, base: ShardPlan) -> list[tuple[int, str, bool]]:
    """Every count the plan cuts as (its whole units, its name for the log, whether it is one
    of the columns' (split/columns.py) rather than the attention's)."""
    shapes = {p: v.shape for p, v in tree_flatten(model.parameters())}
    modules = dict(model.named_modules())
    heads = {path for path, _ in base.divided}
    columns = column_paths(base)
    counts = [(value, f"{path}.{attr}={value}", False) for (path, attr), value in base.divided.items()]
    for path, axis in base.axes.items():
        n, granule = shapes[path][axis], _granule(path, shapes[path], axis, modules, heads)
        name = (f"{path.rsplit('.', 1)[0]}: {n} columns in groups of {granule}" if granule > 1
                else f"{path}: {n} along axis {axis}")
        counts.append((n // granule if n % granule == 0 else 1, name, path in columns))
    return counts


def _checked_runs(path: str, per_unit: list[tuple[tuple[int, int], ...]]) -> None:
    """Each unit's indices in order and no index in two units, or EvenCutOnlyError."""
    spans = sorted(run for runs in per_unit for run in runs)
    ordered = all(a[1] <= b[0] for runs in per_unit for a, b in zip(runs, runs[1:]))
    if not ordered or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise EvenCutOnlyError(f"its cut of {path} repeats or reorders indices between ranks")


def _merged(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for a, b in sorted(runs):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _unit_plan(model: nn.Module, shard: Callable, cut: UnitCut, rank: int, label: str) -> tuple[ShardPlan, list]:
    """The plan for this rank's units of `cut`, from every unit's trace (both ranks check the
    same things, so both take the same cut), and the traces."""
    per_unit = [derive_plan(model, cut_only_group(u, cut.units), shard, trace=True, label=label)
                for u in range(cut.units)]
    first = per_unit[0]
    reasons = list(first.share_bound) + [f"its cut of {p} is not a selection" for p in first.underived]
    reasons += [f"it changes the values of {p}" for p, v in first.replaced.items()
                if v is None or not (abs(v - 1) < 1e-6 or abs(v * cut.units - 1) < 1e-6)]
    if reasons:
        raise EvenCutOnlyError(reasons[0])
    mine = range(cut.first(rank), cut.first(rank) + cut.counts[rank])
    plan = ShardPlan(axes=first.axes, divided=first.divided, replaced=first.replaced)
    for path, axis in first.axes.items():
        runs = [p.cuts[path].runs for p in per_unit]
        _checked_runs(path, runs)
        plan.cuts[path] = ArrayCut(path, first.cuts[path].shape, axis, _merged([r for u in mine for r in runs[u]]))
    return plan, per_unit


@dataclass(frozen=True)
class _Ask:
    """What choose_layout was asked for: the model, its plan and the plan's label, the share
    with one part per rank (an even share on three or more ranks as 1:1:1...), the group's
    size and this rank, and the share's name in the logs."""

    model: nn.Module
    shard: Callable
    share: SplitShare
    size: int
    rank: int
    label: str
    name: str


def _heads_cut(ask: _Ask, granules: int, even: bool) -> Optional[tuple[UnitCut, ShardPlan, list]]:
    """The nearest cut of `granules` units the plan runs for (the even one only if `even`)."""
    for cut in nearest_cuts(ask.share, ask.size, granules):
        if cut.is_even and not even:
            return None
        try:
            return (cut, *_unit_plan(ask.model, ask.shard, cut, ask.rank, ask.label))
        except ValueError:
            continue
    return None


def _with_columns(ask: _Ask, base: ShardPlan, counts: list[tuple[int, str, bool]]) -> Optional[Layout]:
    """The layout whose MLP columns take their own share (split/columns.py); None where the
    columns' cuts cannot be recut, or neither class gives more than an even cut."""
    model, rank = ask.model, ask.rank
    columns = column_paths(base)
    found = _heads_cut(ask, gcd(*(u for u, _, c in counts if not c)), True)
    if found is None:
        return None
    cut, plan, per_unit = found
    shapes = {p: v.shape for p, v in tree_flatten(model.parameters())}
    modules, heads = dict(model.named_modules()), {path for path, _ in base.divided}
    spans = {}
    for path in columns & plan.cuts.keys():
        spans[path] = segments([p.cuts[path].runs for p in per_unit])
        if spans[path] is None:
            return None
    for cols in nearest_cuts(ask.share, ask.size, gcd(*(u for u, _, c in counts if c))):
        recuts = {path: recut(plan.cuts[path], span, _granule(path, shapes[path], plan.axes[path], modules, heads),
                              cols, rank) for path, span in spans.items()}
        if all(recuts.values()):
            break
    else:
        return None
    if cut.is_even and cols.is_even:
        return None
    plan.cuts.update(recuts)
    wanted = UnitCut(ask.share.parts)
    if cols == cut != wanted:
        limits = _limits([(u, name) for u, name, _ in counts], wanted.units)
        log(f"split {ask.name}: using {cut} (rank 0's part first), the nearest every count allows ({limits})")
    elif cut != wanted or cols != wanted:
        limits = _limits([(u, name) for u, name, c in counts if not c], wanted.units)
        log(f"split {ask.name}: the attention's counts take {cut}, the nearest they can ({limits}); the MLP's "
            f"columns and the vocabulary take {cols}")
    if cols == cut:
        return Layout(cut, rank, plan, cut_only_group(cut.first(rank), cut.units))
    return Layout(cut, rank, plan, cut_only_group(cut.first(rank), cut.units), cols, frozenset(columns))


def _even(model: nn.Module, group: Any, shard: Callable, trace: bool, label: str) -> Layout:
    size, rank = int(group.size()), int(group.rank())
    return Layout(UnitCut((1,) * size), rank, derive_plan(model, group, shard, trace=trace, label=label), group)


def _base_plan(model: nn.Module, group: Any, shard: Callable, label: str, fall_back: bool) -> ShardPlan:
    """What the plan cuts and divides (no indices yet), from a twin cut for the group's size;
    with `fall_back` (three or more ranks, whose number may not divide the counts: 8 KV heads
    on 3), from the first unit count that does where it does not: the counts and cut axes are
    the same, only their units differ. The group's own refusal (naming the layer and the fix)
    where none does."""
    try:
        return derive_plan(model, group, shard, trace=False, label=label)
    except ValueError as refusal:
        if not fall_back:
            raise
        first = refusal
    for units in range(2, MAX_UNITS + 1):
        try:
            return derive_plan(model, cut_only_group(0, units), shard, trace=False, label=label)
        except ValueError:
            continue
    raise first


def _sizes_that_fit(ask: _Ask, counts: list[tuple[int, str, bool]]) -> list[int]:
    """The group sizes other than ask.size this model's counts allow: those every count divides
    by (the plan's own even cut), and those each class of counts (the attention's, the columns')
    has a cut into at least as many whole units for."""
    def units_for(n: int, kind: Optional[bool]) -> bool:
        granules = gcd(*(u for u, _, c in counts if kind is None or c is kind))
        return any(granules % d == 0 for d in range(n, min(granules, MAX_UNITS) + 1))

    kinds = [None] if len({c for *_, c in counts}) == 1 else [False, True]
    fits = []
    for n in range(2, MAX_RANKS + 1):
        if n == ask.size:
            continue
        if all(units_for(n, kind) for kind in kinds):
            fits.append(n)
            continue
        try:
            derive_plan(ask.model, cut_only_group(0, n), ask.shard, trace=False, label=ask.label)
            fits.append(n)
        except ValueError:
            continue
    return fits


def _fewer_ranks(ask: _Ask, counts: list[tuple[int, str, bool]]) -> str:
    """Why no cut gives every one of ask.size ranks a part of every count, and the fix."""
    size = ask.size
    short = sorted((name for whole, name, _ in counts if whole < size), key=_natural)
    fits = _sizes_that_fit(ask, counts)
    fix = (f"run it on {' or '.join(map(str, fits))} ranks, which its counts allow, or use a model whose "
           f"counts divide among {size}" if fits else
           f"its counts allow no group of 2 to {MAX_RANKS} ranks: run it on one Mac")
    if short:
        return (f"{len(short)} count(s) have fewer whole units than the {size} ranks, each of which needs "
                f"at least one: {', '.join(short[:3])}; {fix}")
    return f"{_limits([(u, name) for u, name, _ in counts], size)}; {fix}"


def _uneven(ask: _Ask, group: Any, trace: bool) -> Layout:
    """The layout of the cut nearest ask.share (its parts one per rank) the counts allow."""
    size = ask.size
    rounds = not pair_cut_rules(size)  # even is rounded to the nearest cut, not refused
    base = _base_plan(ask.model, group, ask.shard, ask.label, rounds)
    counts = _counts(ask.model, base)
    wanted = UnitCut(ask.share.parts)
    try:
        if {c for *_, c in counts} == {True, False}:
            layout = _with_columns(ask, base, counts)
            if layout is not None:
                return layout
        found = _heads_cut(ask, gcd(*(u for u, *_ in counts)), rounds)
    except EvenCutOnlyError as reason:
        log(f"split {ask.name}: {ask.label} can only split evenly ({reason}); splitting {UnitCut((1,) * size)}")
        try:
            return _even(ask.model, group, ask.shard, trace, ask.label)
        except ValueError as exc:
            raise ValueError(f"split {ask.name}: {ask.label} can only split evenly ({reason}), and its "
                             f"counts do not divide among {size} ranks ({exc})") from None
    if found is None and rounds:
        raise ValueError(f"split {ask.name}: no cut of every count into whole units gives each of the "
                         f"{size} ranks a part ({_fewer_ranks(ask, counts)})")
    if found is None:
        log(f"split {ask.name}: no share but 1:1 cuts every count into whole units "
            f"({_limits([(u, name) for u, name, _ in counts], wanted.units)}); splitting 1:1")
        return _even(ask.model, group, ask.shard, trace, ask.label)
    cut, plan, _ = found
    if cut != wanted:
        log(f"split {ask.name} is not a whole number of units of every count; using {cut} (rank 0's part "
            f"first), the nearest that is ({_limits([(u, name) for u, name, _ in counts], wanted.units)})")
    if cut.is_even:
        return _even(ask.model, group, ask.shard, trace, ask.label)
    return Layout(cut, ask.rank, plan, cut_only_group(cut.first(ask.rank), cut.units))


def choose_layout(model: nn.Module, group: Any, shard: Callable, share: SplitShare, *,
                  trace: bool, label: str) -> Layout:
    """The cut nearest `share` that this model's counts and plan allow, for group.rank() of
    group.size(), the MLP's columns cut on their own where they can (split/columns.py); the
    plan's errors (ValueError naming the layer and the fix) as for an even split.

    Even is 1:1 as it is on two ranks (a count that does not divide by 2 is refused); on three
    or more, where the counts do not divide by the ranks, it is the nearest cut they allow
    (8 KV heads on 3 ranks: 3:3:2), logged naming the counts. ValueError naming the counts and
    the fix where no cut gives every rank a part (more ranks than KV heads)."""
    size, rank = int(group.size()), int(group.rank())
    share.check(size)
    if share.is_even:
        if pair_cut_rules(size):
            return _even(model, group, shard, trace, label)
        try:
            return _even(model, group, shard, trace, label)
        except ValueError:
            ask = _Ask(model, shard, SplitShare(share.wanted(size)), size, rank, label, f"even across {size} ranks")
            return _uneven(ask, group, trace)
    return _uneven(_Ask(model, shard, share, size, rank, label, str(share)), group, trace)


def share_granules(model: nn.Module, shard: Callable, label: str) -> int:
    """G: every share u/n with n dividing G is one a load takes as it is, the attention's counts
    and the MLP's columns each in their own units (the shares `--split auto` picks among,
    split/auto.py)."""
    base = _base_plan(model, cut_only_group(0, 2), shard, label, True)
    counts = _counts(model, base)
    return lcm(*(gcd(*(u for u, _, c in counts if c is kind)) or 1 for kind in (False, True)))


def _natural(name: str) -> tuple:
    """The counts the plan divides (heads: "path.attr=value") before the arrays' ("path: ..."),
    layer 2 before layer 10 (the names' numbers as numbers)."""
    return (":" in name, *((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.replace("=", ".").split(".")))


def _limits(counts: list[tuple[int, str]], units: int) -> str:
    short = sorted((name for whole, name in counts if whole % units), key=_natural)
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
        # The plan made it 1/units of the whole; this rank adds its class's part of it.
        factor = layout.fraction(path) * units
        if factor != 1:
            set_array(model, path, arrays[path] * (int(factor) if factor.denominator == 1 else float(factor)))


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


__all__ = ["Layout", "choose_layout", "part_shape", "run_plan", "share_granules", "take_runs"]
