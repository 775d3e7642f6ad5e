"""What the collectives share: the dtype table, moving an array's bytes to the
peer and back, combining the two partials exactly as MLX would, the gradients
MLX gives its own collectives, and the collectives beyond the gate
(all_max, all_min, sum_scatter, send, recv).

Every function here takes the PairCollectives of a resolved two-rank group
(state.py; gate_ops.Group holds it): `state.pair`, `state.rank`,
`state.agree_signature(...)`, `state.scratch(...)`, `state.sum_slot(...)`.

Why the collectives are eager: the bytes leave when the function is called,
not when MLX evaluates the graph (Python cannot add a primitive to MLX's
graph), so the partial is evaluated first and the result is a new array.
Gradients are wired back in with mx.custom_function, only while a gradient
is being traced (a custom function's node costs a scheduler round trip that
the decode gate cannot afford); mx.compile and mx.vmap are refused.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..link.wire import GATE_MAX_BYTES
from .dtypes import (
    DTYPE_CODES,
    GATHER,
    MAX,
    MIN,
    NUMPY_DTYPES,
    P2P_FROM,
    SCATTER,
    SUM,
    dtype_code,
    unsupported,
)
from .state import PairCollectives

# ============================================================================
# Moving the bytes
# ============================================================================


def host_view(x: mx.array) -> Tuple[mx.array, memoryview]:
    """x's own buffer as bytes (unified memory on Apple Silicon: the partial goes
    out with no staging copy). x must be evaluated or scheduled (mx.async_eval):
    taking the buffer waits for it."""
    if x.dtype not in DTYPE_CODES:
        raise unsupported(x.dtype)
    view = memoryview(x)
    if not view.c_contiguous:
        x = mx.contiguous(x)
        mx.eval(x)
        view = memoryview(x)
    return x, view.cast("B")


def exchange(x: mx.array, state: PairCollectives, op: int) -> Tuple[mx.array, np.ndarray, np.ndarray]:
    """Send x's bytes, receive the peer's: a decode gate when it fits one
    message pair, a bulk exchange (prefill rows, logits) otherwise."""
    x, local_bytes = host_view(x)
    code = DTYPE_CODES[x.dtype]
    state.agree_signature(op, code, tuple(x.shape))
    np_dtype = NUMPY_DTYPES[x.dtype]
    peer = state.scratch(local_bytes.nbytes, np_dtype)
    _move(state, local_bytes, peer, op, code)
    return x, np.frombuffer(local_bytes, dtype=np_dtype), peer


def _move(state: PairCollectives, send, recv, op: int, code: int) -> None:
    if send.nbytes <= GATE_MAX_BYTES:
        t0 = time.perf_counter_ns()
        state.pair.gate(send, recv, layer=op, gate=code)
        state.record_latency(time.perf_counter_ns() - t0)
    else:
        t0 = time.perf_counter_ns()
        state.pair.bulk(send, recv, layer=op)
        state.record_exchange(time.perf_counter_ns() - t0)


def to_mlx(values: np.ndarray, dtype) -> mx.array:
    """A materialised array of `dtype` holding `values` (bfloat16 as its uint16 bits)."""
    out = mx.array(values)
    if out.dtype == dtype:
        return out
    if dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
    else:
        # mx.array() makes float64 data float32 (MLX's default float): say the dtype.
        out = mx.array(values, dtype=dtype)
    mx.eval(out)  # so the result does not depend on this thread's stream
    return out


# ============================================================================
# Combining the two partials, rank 0's first on both ranks: the same
# expression everywhere, so both ranks hold identical bits
# ============================================================================


def in_rank_order(state: PairCollectives, local: np.ndarray, peer: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    return (local, peer) if state.rank == 0 else (peer, local)


def bf16_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bfloat16 a + b computed in float32 and rounded to nearest-even, as MLX does."""
    fa = (a.astype(np.uint32) << 16).view(np.float32)
    fb = (b.astype(np.uint32) << 16).view(np.float32)
    bits = (fa + fb).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(fa + fb)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def sum_eager(x: mx.array, state: PairCollectives) -> mx.array:
    """all_sum on an evaluated (or scheduled) x: integers wrap as MLX's do,
    bool sums are a logical or (MLX's bool + bool).

    float32, float16, bfloat16 (every gate of a model): the exchange and the sum are one C
    call into the pair's reused buffers, then one copy into the returned array. gate_ops.all_sum
    runs a gate whose slot exists and whose signature is agreed without coming here; this is
    the first gate of a shape, a non-contiguous partial, or a bulk (prefill) exchange."""
    dtype = x.dtype
    shape = x.shape
    slot = state.sum_slot(dtype, shape)
    if slot is None:
        return _sum_numpy(x, state)
    x, local = host_view(x)
    if not slot.current:
        state.agree_signature(SUM, slot.code, shape, slot)  # current from now on: the fast path
    if slot.gate:
        rc = slot.run(slot.ctx, slot.to_c(local), slot.nbytes)
        if rc:
            slot.fail(rc)
    else:
        t0 = time.perf_counter_ns()
        state.pair.bulk_sum(local, slot.peer, slot.out, slot.code, SUM)
        state.record_exchange(time.perf_counter_ns() - t0)
    return slot.finish()


def _sum_numpy(x: mx.array, state: PairCollectives) -> mx.array:
    """all_sum of the dtypes the C sum does not take (integers, bool, float64, complex64)."""
    x, local, peer = exchange(x, state, SUM)
    first, second = in_rank_order(state, local, peer)
    return to_mlx(np.add(first, second).reshape(x.shape), x.dtype)


def gather_eager(x: mx.array, state: PairCollectives) -> mx.array:
    """all_gather on an evaluated (or scheduled) x: concatenated on axis 0, rank order."""
    x, local, peer = exchange(x, state, GATHER)
    shape = (2 * x.shape[0],) + tuple(x.shape[1:]) if x.ndim else (2,)
    return to_mlx(np.concatenate(in_rank_order(state, local, peer)).reshape(shape), x.dtype)


def _extremum(x: mx.array, state: PairCollectives, op: int) -> mx.array:
    x, local, peer = exchange(x, state, op)
    first, second = in_rank_order(state, local, peer)
    pick = np.maximum if op == MAX else np.minimum
    if x.dtype == mx.bfloat16:
        # Compared as the float32 values the bits stand for (the bits' own
        # order is wrong for negatives); then the winner's bits are kept.
        fa = (first.astype(np.uint32) << 16).view(np.float32)
        fb = (second.astype(np.uint32) << 16).view(np.float32)
        winner = pick(fa, fb).view(np.uint32) >> 16
        return to_mlx(winner.astype(np.uint16).reshape(x.shape), x.dtype)
    # numpy's maximum/minimum: NaN propagates and complex numbers compare
    # real part first, as MLX's maximum/minimum do.
    return to_mlx(pick(first, second).reshape(x.shape), x.dtype)


def max_eager(x: mx.array, state: PairCollectives) -> mx.array:
    return _extremum(x, state, MAX)


def min_eager(x: mx.array, state: PairCollectives) -> mx.array:
    return _extremum(x, state, MIN)


def scatter_eager(x: mx.array, state: PairCollectives) -> mx.array:
    """sum_scatter: each rank sends the half the peer keeps and sums the half it keeps,
    so half the bytes of an all_sum move; the result equals all_sum(x)'s half."""
    if x.ndim == 0 or x.shape[0] % 2:
        raise ValueError(f"sum_scatter: x.shape[0] must be divisible by the group size 2, "
                         f"got shape {tuple(x.shape)}")
    x, local_bytes = host_view(x)
    code = DTYPE_CODES[x.dtype]
    state.agree_signature(SCATTER, code, tuple(x.shape))
    np_dtype = NUMPY_DTYPES[x.dtype]
    rows = x.shape[0] // 2
    local = np.frombuffer(local_bytes, dtype=np_dtype).reshape(x.shape)
    mine = local[rows * state.rank: rows * (state.rank + 1)]
    theirs = local[rows * (1 - state.rank): rows * (2 - state.rank)]
    send = np.ascontiguousarray(theirs).reshape(-1)
    peer = state.scratch(send.nbytes, np_dtype)
    _move(state, send, peer, SCATTER, code)
    first, second = in_rank_order(state, mine.reshape(-1), peer)
    shape = (rows,) + tuple(x.shape[1:])
    if x.dtype == mx.bfloat16:
        return to_mlx(bf16_add(first, second).reshape(shape), x.dtype)
    return to_mlx(np.add(first, second).reshape(shape), x.dtype)


# ============================================================================
# send / recv: the transports move bytes both ways at once (a gate is an
# exchange), so the receiver sends filler of the same size and the sender
# drops what it gets back
# ============================================================================


def _peer_rank(state: PairCollectives, rank: int, what: str) -> None:
    if rank != 1 - state.rank:
        raise ValueError(f"{what}={rank!r}: in a group of 2 this rank ({state.rank}) can only "
                         f"talk to rank {1 - state.rank}")


def send_eager(x: mx.array, dst: int, state: PairCollectives) -> mx.array:
    """Send x to rank dst (the peer); returns x, as MLX's send does once evaluated."""
    _peer_rank(state, dst, "dst")
    exchange(x, state, P2P_FROM + state.rank)
    return x


def recv(shape: Sequence[int], dtype, src: int, state: PairCollectives) -> mx.array:
    """The array of `shape` and `dtype` that rank src sends with send()."""
    _peer_rank(state, src, "src")
    shape = tuple(int(d) for d in shape)
    code = dtype_code(dtype)
    state.agree_signature(P2P_FROM + src, code, shape)
    np_dtype = NUMPY_DTYPES[dtype]
    count = int(np.prod(shape, dtype=np.int64))
    filler = np.zeros(count, dtype=np_dtype)
    received = np.empty(count, dtype=np_dtype)
    _move(state, filler, received, P2P_FROM + src, code)
    return to_mlx(received.reshape(shape), dtype)


# ============================================================================
# Function transformations
# ============================================================================

TRANSFORM_ERROR = (
    "mlx_ds4tp.{name} runs eagerly: it sends this rank's bytes to the peer when it is called, so "
    "it cannot be traced by mx.compile or mx.vmap (nothing was sent; the peer still waits for "
    "this {name}). Compile the pieces between the collectives instead, e.g. "
    "`before = mx.compile(f)`, `after = mx.compile(g)`, then `after(tp.{name}(before(x)))`."
)


def evaluate_traced(x: mx.array, name: str) -> None:
    """Evaluate x while a transformation traces it: allowed under mx.grad and its kin
    (the graph is kept), refused by MLX under mx.compile and mx.vmap, where the
    collective is then refused with a word on how to arrange the code."""
    try:
        mx.eval(x)
    except ValueError as exc:
        if "function transformations" not in str(exc):
            raise
        raise ValueError(TRANSFORM_ERROR.format(name=name)) from None


def traced(eager: Callable[[mx.array, object], mx.array],
           vjp: Callable[[mx.array, mx.array, object], mx.array],
           x: mx.array, state: PairCollectives, name: str) -> mx.array:
    """The collective called while a transformation traces x (mx.async_eval refused it).

    Under mx.grad / mx.vjp / mx.value_and_grad the exchange runs now and
    mx.custom_function ties the result to x with `vjp`, so the gradient flows as
    through MLX's own collective. Under mx.compile or mx.vmap: refused before any
    byte moves."""
    evaluate_traced(x, name)
    fn = mx.custom_function(lambda a: eager(a, state))
    # A one-argument custom function gets its primal and cotangent as arrays, not tuples.
    fn.vjp(lambda primal, cotangent, output: vjp(primal, cotangent, state))
    return fn(x)


def pass_cotangent(x: mx.array, cotangent: mx.array, state: PairCollectives) -> mx.array:
    """all_sum / all_max / all_min: the cotangent unchanged (MLX's AllReduce::vjp)."""
    return cotangent


def slice_cotangent(x: mx.array, cotangent: mx.array, state: PairCollectives) -> mx.array:
    """all_gather: this rank's rows of the cotangent (MLX's AllGather::vjp)."""
    if x.ndim == 0:
        return cotangent[state.rank]
    rows = x.shape[0]
    return cotangent[state.rank * rows: (state.rank + 1) * rows]


def gather_cotangent(x: mx.array, cotangent: mx.array, state: PairCollectives) -> mx.array:
    """sum_scatter: both ranks' cotangents gathered (the transpose of a reduce-scatter
    is an all-gather), so x's gradient covers the rows the peer kept too."""
    try:
        mx.async_eval(cotangent)
    except ValueError:
        return traced(gather_eager, slice_cotangent, cotangent, state, "all_gather")
    return gather_eager(cotangent, state)


def collective(eager: Callable[[mx.array, object], mx.array],
               vjp: Callable[[mx.array, mx.array, object], mx.array],
               x: mx.array, state: PairCollectives, name: str) -> mx.array:
    """Run `eager` on x, through `traced` when a transformation is under way."""
    try:
        # Refused inside any transformation when x is not evaluated yet: the
        # one sign of tracing MLX shows Python, and it costs the hot path
        # nothing (x must be evaluated before its bytes leave anyway).
        mx.async_eval(x)
    except ValueError:
        return traced(eager, vjp, x, state, name)
    return eager(x, state)

