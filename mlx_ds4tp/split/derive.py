"""What a split plan (mlx-lm's `Model.shard(group)`, or ours) cuts, learned before the model changes.

mlx-lm's plans are code, not tables: about two dozen modules each cut their layers with
`shard_linear` / `shard_inplace` (some with segments: fused q/k/v), slice per-head arrays,
repeat KV heads, divide head counts. Rather than keep a table per family that mirrors that code
(and goes stale the day mlx-lm changes it), the plan is run on a *twin* of the model: the same
module objects copied, the same arrays shared, so the real model is untouched and no byte is
read. The twin shows

- whether the plan can run for this many ranks at all: a count that does not divide fails
  inside MLX's split, and the error is raised again naming the layer it failed on;
- which head counts it divides: `n_heads //= N` floors silently, so a count that does not
  divide is refused here, naming the attribute;
- which arrays it cuts: their shapes before and after.

A second run, on a twin whose cut arrays are *index tracers* (each element its own index along
the cut axis: a broadcast view, no memory of its own) shows which indices of the saved tensor
each rank keeps, whatever code made the cut (segments, per-head slices, repeats). The reader
then reads exactly those bytes. A cut the tracer cannot explain (an array reshaped across axes,
or values changed) is left to the plan itself: read whole and cut in memory, and counted.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten


@dataclass(frozen=True)
class ArrayCut:
    """One array the plan cuts: which indices of the whole array's `axis` this rank keeps,
    as [start, stop) runs in the order the part holds them."""

    path: str
    shape: tuple[int, ...]
    axis: int
    runs: tuple[tuple[int, int], ...]


@dataclass
class ShardPlan:
    """A plan for this model, rank and group size, as the twins showed it."""

    axes: dict[str, int] = field(default_factory=dict)  # every array it cuts: the cut axis
    cuts: dict[str, ArrayCut] = field(default_factory=dict)  # traced: this rank's indices
    underived: list[str] = field(default_factory=list)  # cut, but not by index selection
    # (module path, attribute) -> its whole value, of every count the plan divided by the size
    divided: dict[tuple[str, str], int] = field(default_factory=dict)
    # traced: arrays the plan replaced without cutting -> what it made of an array of ones
    # (1: a copy; 1/size: gpt-oss's and our down_proj biases, added once per rank)
    replaced: dict[str, float | None] = field(default_factory=dict)
    # what the plan does that a share other than 1/size could not follow, as readable reasons
    share_bound: list[str] = field(default_factory=list)


def _twin(value: Any) -> Any:
    """A copy of every module (their attributes included) whose arrays are new array objects
    over the same data: nothing is read or copied, and an in-place update a plan makes
    (gpt-oss's `bias /= N`) changes the twin's array, not the model's."""
    if isinstance(value, mx.array):
        return mx.stop_gradient(value)
    if isinstance(value, nn.Module):
        twin = copy.copy(value)
        for key, child in list(twin.items()):
            twin[key] = _twin(child)
        return twin
    if isinstance(value, list):
        return [_twin(v) for v in value]
    if isinstance(value, dict):
        return {k: _twin(v) for k, v in value.items()}
    return value


def set_array(root: nn.Module, path: str, value: mx.array | nn.Module) -> None:
    """Put `value` (an array, or a module) at the dotted path (list indices included)."""
    *parents, name = path.split(".")
    node: Any = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[name] = value


def _layer_of(error: BaseException, modules: dict[int, tuple[str, nn.Module]]) -> tuple[str, Any]:
    """The innermost module of the twin the failing code was handling: (dotted path, module)."""
    tb, found = error.__traceback__, ("the model", None)
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, nn.Module) and modules.get(id(value), (None, None))[1] is value:
                found = modules[id(value)]
        tb = tb.tb_next
    return found


def _fix(size: int) -> str:
    return (f"use a model whose head counts and layer widths are multiples of {size}, or a number "
            "of ranks that divides them (one Mac always does)")


def _run_plan(twin: nn.Module, group: Any, shard: Callable[[nn.Module, Any], None], family: str) -> None:
    size = int(group.size())
    # The modules themselves are held, not only their ids: the plan replaces some, and a new
    # module could take a freed one's id.
    modules = {id(m): (p or "model", m) for p, m in twin.named_modules()}
    try:
        shard(twin, group)
    except (ValueError, AssertionError, RuntimeError, IndexError) as e:
        where, layer = _layer_of(e, modules)
        fix = _fix(size)
        group_size = getattr(layer, "group_size", None)
        if group_size is not None:
            fix += (f"; or, as it is quantized with group_size={group_size}, quantize with a group "
                    f"size that divides its inputs per rank (e.g. mlx_lm.convert --q-group-size 32)")
        raise ValueError(f"{family} cannot split {where} across {size} ranks ({e}); {fix}") from None


def _check_counts(model: nn.Module, twin: nn.Module, size: int, family: str, plan: ShardPlan) -> None:
    """A count the plan floor-divided by the group size must have divided exactly; the divided
    ones go into plan.divided, any other count it changed into plan.share_bound."""
    before = dict(model.named_modules())
    refused = []
    for path, module in twin.named_modules():
        orig = before.get(path)
        if orig is None:
            continue
        for attr, value in vars(orig).items():
            new = vars(module).get(attr)
            if not (isinstance(value, int) and not isinstance(value, bool) and isinstance(new, int)) or new == value:
                continue
            if new * size == value:
                plan.divided[(path, attr)] = value
            elif new == value // size:
                refused.append((_natural(path), f"{path}.{attr}={value}"))
            else:
                plan.share_bound.append(f"it sets {path}.{attr} from {value} to {new}")
    if refused:
        first = min(refused)[1]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise ValueError(
            f"{first}{more} cannot be split across {size} ranks ({family} divides it); {_fix(size)}"
        )


# The modules that may hold the plan's group: they use it only for their sums (MLX's sharded
# linears: `group`; mlx-lm's MoE blocks: `sharding_group`; split/plans.py's sum_after:
# `_sum_group`). Any other holder may compute with the group's size (minimax's q/k norm divides
# by it), which a share other than 1/size would get wrong.
MLX_SHARDED = (nn.AllToShardedLinear, nn.ShardedToAllLinear,
               nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear)
_SUM_ONLY_NAMES = {"sharding_group", "_sum_group"}


def _private_arrays(twin: nn.Module) -> dict[tuple[str, str], int]:
    return {(path, key): id(value) for path, module in twin.named_modules()
            for key, value in module.items() if key.startswith("_") and isinstance(value, mx.array)}


def _check_share_bound(twin: nn.Module, group: Any, private: dict, plan: ShardPlan) -> None:
    """What in the plan's result only a share of 1/size explains, into plan.share_bound."""
    for path, module in twin.named_modules():
        for attr, value in vars(module).items():
            if value is group and not (isinstance(module, MLX_SHARDED) or attr in _SUM_ONLY_NAMES):
                plan.share_bound.append(f"{type(module).__name__} at {path} keeps the group for its own arithmetic")
    for (path, key), ident in _private_arrays(twin).items():
        if private.get((path, key)) not in (None, ident):
            plan.share_bound.append(f"it derives {path}.{key} from the group's size")


def _natural(path: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


# The narrowest index type the tracers use: an axis of up to 2**15 indices (most of them: heads,
# hidden and intermediate widths) is traced in int16, half the bytes MLX materializes and numpy
# reads where the plan copies the cut (mlx-lm's shard makes it contiguous). Signed, so that a
# plan's subtraction cannot wrap a value back into the valid range unseen as an unsigned one could.
_NARROW_INDICES = 1 << 15


def _tracer(shape: tuple[int, ...], axis: int) -> mx.array:
    line = [1] * len(shape)
    line[axis] = shape[axis]
    dtype = mx.int16 if shape[axis] <= _NARROW_INDICES else mx.int32
    return mx.broadcast_to(mx.arange(shape[axis], dtype=dtype).reshape(line), shape)


def _runs(indices: np.ndarray) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    for i in indices.tolist():
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


# Elements compared at once: the compare's bool buffer is reused, not one the cut's size.
_COMPARE_ELEMENTS = 1 << 20


def _is_broadcast(values: np.ndarray, line: np.ndarray, axis: int) -> bool:
    """Whether every element of `values` equals `line` (its shape: 1 on every axis but `axis`).
    Exact (every element is compared), without a temporary the array's size: an axis of stride 0
    repeats one element (every element there aliases it), so only its first is compared; the
    rest in slices along the leading axis into one reused buffer."""
    whole = tuple(slice(0, 1) if d != axis and values.strides[d] == 0 else slice(None)
                  for d in range(values.ndim))
    values = values[whole]
    if values.size == line.size:  # only the line itself is left (it is where `line` came from)
        return True
    rows = max(1, _COMPARE_ELEMENTS // max(1, values[0].size))
    buffer = np.empty((min(rows, values.shape[0]),) + values.shape[1:], dtype=bool)
    for start in range(0, values.shape[0], rows):
        part = values[start: start + rows]
        expected = line[start: start + rows] if axis == 0 else line
        out = buffer[: part.shape[0]]
        np.equal(part, expected, out=out)
        if not out.all():
            return False
    return True


def _kept_indices(traced: mx.array, axis: int, whole: int) -> np.ndarray | None:
    """The indices a traced array kept along `axis`, or None if it is not a pure selection."""
    if not mx.issubdtype(traced.dtype, mx.integer):
        return None
    mx.eval(traced)
    # Read in place (the buffer protocol, strides and all): a copy into numpy would cost the cut
    # weight's element count again, for every weight of the model.
    values = np.asarray(memoryview(traced))
    index = [0] * values.ndim
    index[axis] = slice(None)
    kept = values[tuple(index)]
    shape = [1] * values.ndim
    shape[axis] = kept.size
    if kept.size == 0 or kept.min() < 0 or kept.max() >= whole:
        return None
    if not _is_broadcast(values, kept.reshape(shape), axis):
        return None
    return kept.astype(np.int64)


def _marker(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    return mx.broadcast_to(mx.array(1, dtype=dtype), shape)


def _constant(array: mx.array) -> float | None:
    """The one value every element of `array` holds, or None."""
    values = np.array(array.astype(mx.float32))
    return float(values.flat[0]) if values.size and np.all(values == values.flat[0]) else None


def derive_plan(model: nn.Module, group: Any, shard: Callable[[nn.Module, Any], None], *,
                trace: bool, label: str = "the plan") -> ShardPlan:
    """Run `shard(model, group)` on twins of `model` (which stays whole); raise ValueError
    naming the layer, the values and the fix when it cannot split this model across
    group.size() ranks. `label` names the plan in messages ("mlx-lm's llama plan").

    trace: also learn which indices of every cut array this rank keeps (for reading only
    those bytes) and what the plan made of the arrays it replaced; without it only the
    checks run and the cut axes are found."""
    size = int(group.size())
    before = dict(tree_flatten(model.parameters()))
    twin = _twin(model)
    private = _private_arrays(twin)
    kept_objects = {path: id(v) for path, v in tree_flatten(twin.parameters())}
    _run_plan(twin, group, shard, label)
    plan = ShardPlan()
    _check_counts(model, twin, size, label, plan)
    _check_share_bound(twin, group, private, plan)
    for path, cut in tree_flatten(twin.parameters()):
        whole = before.get(path)
        if whole is None:
            continue
        if whole.shape == cut.shape:
            if kept_objects.get(path) != id(cut):
                plan.replaced[path] = None
            continue
        axes = [a for a in range(whole.ndim) if cut.ndim == whole.ndim and whole.shape[a] != cut.shape[a]]
        if len(axes) == 1:
            plan.axes[path] = axes[0]
        else:
            plan.underived.append(path)
    del twin
    if not trace:
        return plan
    traced = _twin(model)
    for path, axis in plan.axes.items():
        set_array(traced, path, _tracer(before[path].shape, axis))
    for path in plan.replaced:
        set_array(traced, path, _marker(before[path].shape, before[path].dtype))
    shard(traced, group)
    after = dict(tree_flatten(traced.parameters()))
    # Each traced array is dropped once checked (after.pop), its memory reused for the next:
    # the twin would hold every one, the part's element count, until the plan returns.
    del traced
    for path in plan.replaced:
        plan.replaced[path] = _constant(after[path]) if path in after else None
    for path, axis in plan.axes.items():
        kept = _kept_indices(after.pop(path), axis, before[path].shape[axis]) if path in after else None
        if kept is None:
            plan.underived.append(path)
        else:
            plan.cuts[path] = ArrayCut(path, tuple(before[path].shape), axis, _runs(kept))
    return plan


__all__ = ["MLX_SHARDED", "ArrayCut", "ShardPlan", "derive_plan", "set_array"]
