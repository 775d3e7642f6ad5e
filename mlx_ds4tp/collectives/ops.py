"""What the collectives share: the dtype table, moving an array's bytes to the
peer and back, combining the two partials exactly as MLX would, the gradients
MLX gives its own collectives, and the collectives beyond the gate
(all_max, all_min, sum_scatter, send, recv).

Every function here takes a resolved two-rank Group (gate_ops): `group.pair`,
`group.rank()`, `group.agree_signature(...)`, `group.scratch(...)`.

Why the collectives are eager: the bytes leave when the function is called,
not when MLX evaluates the graph (Python cannot add a primitive to MLX's
graph), so the partial is evaluated first and the result is a new array.
Gradients are wired back in with mx.custom_function, only while a gradient
is being traced (a custom function's node costs a scheduler round trip that
the decode gate cannot afford); mx.compile and mx.vmap are refused.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .. import transport as tr
from .dlpack import Bf16Export
from ..link.wire import OP_GATHER, OP_MAX, OP_MIN, OP_P2P_FROM, OP_SCATTER, OP_SUM

# ============================================================================
# Dtypes: the code on the wire and the numpy dtype the bytes are read as
# ============================================================================

# Codes 1-3 are the gate's original three (peers compare them in the gate
# signature and the TCP gate header carries them), the rest follow.
_DTYPES = (
    (mx.float32, 1, np.float32, "float32"),
    (mx.float16, 2, np.float16, "float16"),
    # numpy has no bfloat16: its bits travel and are combined as uint16.
    (mx.bfloat16, 3, np.uint16, "bfloat16"),
    (mx.bool_, 4, np.bool_, "bool"),
    (mx.int8, 5, np.int8, "int8"),
    (mx.int16, 6, np.int16, "int16"),
    (mx.int32, 7, np.int32, "int32"),
    (mx.int64, 8, np.int64, "int64"),
    (mx.uint8, 9, np.uint8, "uint8"),
    (mx.uint16, 10, np.uint16, "uint16"),
    (mx.uint32, 11, np.uint32, "uint32"),
    (mx.uint64, 12, np.uint64, "uint64"),
    (mx.float64, 13, np.float64, "float64"),
    (mx.complex64, 14, np.complex64, "complex64"),
)
DTYPE_CODES = {dtype: code for dtype, code, _, _ in _DTYPES}
DTYPE_NAMES = {code: name for _, code, _, name in _DTYPES}
NUMPY_DTYPES = {dtype: np_dtype for dtype, _, np_dtype, _ in _DTYPES}
MLX_DTYPES = {code: dtype for dtype, code, _, _ in _DTYPES}

# The collectives' codes (in the gate signature, see _wire): two ranks calling
# different collectives at the same point is an error naming both.
SUM, GATHER, MAX, MIN, SCATTER, P2P_FROM = OP_SUM, OP_GATHER, OP_MAX, OP_MIN, OP_SCATTER, OP_P2P_FROM
OP_NAMES = {SUM: "all_sum", GATHER: "all_gather", MAX: "all_max", MIN: "all_min",
            SCATTER: "sum_scatter", P2P_FROM: "send/recv from rank 0", P2P_FROM + 1: "send/recv from rank 1"}


def describe(op: int, dtype_code: int, shape: Sequence[int]) -> str:
    """'all_sum float32 (4096,)': an operation as the mismatch errors name it."""
    dtype = DTYPE_NAMES.get(dtype_code, f"dtype#{dtype_code}")
    return f"{OP_NAMES.get(op, f'op#{op}')} {dtype} {tuple(shape)}"


def _unsupported(dtype) -> TypeError:
    return TypeError(f"dtype {dtype} is not supported by the collectives; use one of "
                     f"{', '.join(DTYPE_NAMES.values())}")


def dtype_code(dtype) -> int:
    """The wire code of an MLX dtype; TypeError naming the supported ones otherwise."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise _unsupported(dtype)
    return code


# ============================================================================
# Moving the bytes
# ============================================================================


def host_view(x: mx.array) -> Tuple[mx.array, memoryview]:
    """x's own buffer as bytes (unified memory on Apple Silicon: the partial goes
    out with no staging copy). x must be evaluated or scheduled (mx.async_eval):
    taking the buffer waits for it."""
    if x.dtype not in DTYPE_CODES:
        raise _unsupported(x.dtype)
    view = memoryview(x)
    if not view.c_contiguous:
        x = mx.contiguous(x)
        mx.eval(x)
        view = memoryview(x)
    return x, view.cast("B")


def exchange(x: mx.array, group, op: int) -> Tuple[mx.array, np.ndarray, np.ndarray]:
    """Send x's bytes, receive the peer's: a decode gate when it fits one
    message pair, a bulk exchange (prefill rows, logits) otherwise."""
    x, local_bytes = host_view(x)
    code = DTYPE_CODES[x.dtype]
    group.agree_signature(op, code, tuple(x.shape))
    np_dtype = NUMPY_DTYPES[x.dtype]
    peer = group.scratch(local_bytes.nbytes, np_dtype)
    _move(group, local_bytes, peer, op, code)
    return x, np.frombuffer(local_bytes, dtype=np_dtype), peer


def _move(group, send, recv, op: int, code: int) -> None:
    if send.nbytes <= tr.GATE_MAX_BYTES:
        t0 = time.perf_counter_ns()
        group.pair.gate(send, recv, layer=op, gate=code)
        group.record_latency(time.perf_counter_ns() - t0)
    else:
        t0 = time.perf_counter_ns()
        group.pair.bulk(send, recv, layer=op)
        group.record_exchange(time.perf_counter_ns() - t0)


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


def in_rank_order(group, local: np.ndarray, peer: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    return (local, peer) if group.rank() == 0 else (peer, local)


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


# The float dtypes whose sum runs in C, inside the gate (tp_sum_gate_run) or after a bulk
# exchange (tp_sum2): their wire codes are the C module's TP_SUM_* codes.
C_SUM_CODES = {mx.float32: 1, mx.float16: 2, mx.bfloat16: 3}
_BF16_CODE = 3
# Bulk-sized (prefill) sum buffers kept for this many shapes at most: a chunk's gates share
# one shape, and prompts of every length must not pile up buffers.
_BULK_SLOTS_KEPT = 4


class SumSlot:
    """What the float gate reuses for one (dtype, shape): the peer's partial lands in `peer`,
    the sum in `out`, so a gate allocates nothing. `result` is out in the result's shape as a
    memoryview: MLX copies a memoryview into a new array in about half the time it takes for
    the numpy array itself (no ndarray conversion). `finish()` makes that array: a copy of
    `result` (bfloat16, which numpy lacks: a copy through DLPack, _dlpack).

    A gate-sized slot (up to GATE_MAX_BYTES) holds the pair's SumGate for it: `run(ctx,
    src, nbytes)` is the whole exchange and sum in one C call (gate_ops.all_sum calls it
    directly), `fail(rc)` raises its error."""

    __slots__ = ("code", "signature", "gate", "peer", "out", "result", "finish", "ctx", "run",
                 "nbytes", "fail", "to_c", "sum_gate")

    def __init__(self, code: int, dtype, shape: Tuple[int, ...]):
        np_dtype = NUMPY_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        self.code = code
        self.signature = (SUM, code, shape)
        self.nbytes = count * np.dtype(np_dtype).itemsize
        self.gate = self.nbytes <= tr.GATE_MAX_BYTES
        self.peer = np.empty(count, dtype=np_dtype)
        self.out = np.empty(count, dtype=np_dtype)
        self.result = memoryview(self.out.reshape(shape))
        self.finish = Bf16Export(self.out, shape) if code == _BF16_CODE else partial(mx.array, self.result)
        self.sum_gate = self.ctx = self.run = self.fail = self.to_c = None

    def attach(self, group) -> None:
        """Fix the gate's C arguments on the group's pair (a gate-sized slot only)."""
        latency_ns, latency_count = group.latency_ring()
        gate = group.pair.sum_gate(self.peer, self.out, self.code, SUM, self.code, latency_ns, latency_count)
        self.sum_gate = gate  # owns the buffers ctx points into
        self.ctx, self.run, self.fail, self.to_c = gate.ctx, gate.run, gate.fail, gate.to_c


def _sum_slot(group, dtype, shape: Tuple[int, ...]):
    """The group's SumSlot for (dtype, shape), made on first use; None for a dtype the C sum
    does not take. Gate-sized slots live in group.sum_slots (where all_sum's fast path looks),
    bulk-sized ones in group.bulk_slots, at most _BULK_SLOTS_KEPT of them."""
    code = C_SUM_CODES.get(dtype)
    if code is None:
        return None
    key = (dtype, shape)
    slot = group.sum_slots.get(key) or group.bulk_slots.get(key)
    if slot is not None:
        return slot
    slot = SumSlot(code, dtype, shape)
    if slot.gate:
        slot.attach(group)
        group.sum_slots[key] = slot
    else:
        bulk = group.bulk_slots
        for old in list(bulk)[: max(0, len(bulk) - _BULK_SLOTS_KEPT + 1)]:
            del bulk[old]
        bulk[key] = slot
    return slot


def sum_eager(x: mx.array, group) -> mx.array:
    """all_sum on an evaluated (or scheduled) x: integers wrap as MLX's do,
    bool sums are a logical or (MLX's bool + bool).

    float32, float16, bfloat16 (every gate of a model): the exchange and the sum are one C
    call into the group's reused buffers, then one copy into the returned array. gate_ops.all_sum
    runs a gate whose slot exists and whose signature is agreed without coming here; this is
    the first gate of a shape, a non-contiguous partial, or a bulk (prefill) exchange."""
    dtype = x.dtype
    shape = x.shape
    slot = _sum_slot(group, dtype, shape)
    if slot is None:
        return _sum_numpy(x, group)
    x, local = host_view(x)
    if group.signature is not slot.signature:
        group.agree_signature(SUM, slot.code, shape)
        group.signature = slot.signature  # all_sum's fast path compares identity
    if slot.gate:
        rc = slot.run(slot.ctx, slot.to_c(local), slot.nbytes)
        if rc:
            slot.fail(rc)
    else:
        t0 = time.perf_counter_ns()
        group.pair.bulk_sum(local, slot.peer, slot.out, slot.code, SUM)
        group.record_exchange(time.perf_counter_ns() - t0)
    return slot.finish()


def _sum_numpy(x: mx.array, group) -> mx.array:
    """all_sum of the dtypes the C sum does not take (integers, bool, float64, complex64)."""
    x, local, peer = exchange(x, group, SUM)
    first, second = in_rank_order(group, local, peer)
    return to_mlx(np.add(first, second).reshape(x.shape), x.dtype)


def gather_eager(x: mx.array, group) -> mx.array:
    """all_gather on an evaluated (or scheduled) x: concatenated on axis 0, rank order."""
    x, local, peer = exchange(x, group, GATHER)
    shape = (2 * x.shape[0],) + tuple(x.shape[1:]) if x.ndim else (2,)
    return to_mlx(np.concatenate(in_rank_order(group, local, peer)).reshape(shape), x.dtype)


def _extremum(x: mx.array, group, op: int) -> mx.array:
    x, local, peer = exchange(x, group, op)
    first, second = in_rank_order(group, local, peer)
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


def max_eager(x: mx.array, group) -> mx.array:
    return _extremum(x, group, MAX)


def min_eager(x: mx.array, group) -> mx.array:
    return _extremum(x, group, MIN)


def scatter_eager(x: mx.array, group) -> mx.array:
    """sum_scatter: each rank sends the half the peer keeps and sums the half it keeps,
    so half the bytes of an all_sum move; the result equals all_sum(x)'s half."""
    if x.ndim == 0 or x.shape[0] % 2:
        raise ValueError(f"sum_scatter: x.shape[0] must be divisible by the group size 2, "
                         f"got shape {tuple(x.shape)}")
    x, local_bytes = host_view(x)
    code = DTYPE_CODES[x.dtype]
    group.agree_signature(SCATTER, code, tuple(x.shape))
    np_dtype = NUMPY_DTYPES[x.dtype]
    rows = x.shape[0] // 2
    local = np.frombuffer(local_bytes, dtype=np_dtype).reshape(x.shape)
    mine = local[rows * group.rank(): rows * (group.rank() + 1)]
    theirs = local[rows * (1 - group.rank()): rows * (2 - group.rank())]
    send = np.ascontiguousarray(theirs).reshape(-1)
    peer = group.scratch(send.nbytes, np_dtype)
    _move(group, send, peer, SCATTER, code)
    first, second = in_rank_order(group, mine.reshape(-1), peer)
    shape = (rows,) + tuple(x.shape[1:])
    if x.dtype == mx.bfloat16:
        return to_mlx(bf16_add(first, second).reshape(shape), x.dtype)
    return to_mlx(np.add(first, second).reshape(shape), x.dtype)


# ============================================================================
# send / recv: the transports move bytes both ways at once (a gate is an
# exchange), so the receiver sends filler of the same size and the sender
# drops what it gets back
# ============================================================================


def _peer_rank(group, rank: int, what: str) -> None:
    if rank != 1 - group.rank():
        raise ValueError(f"{what}={rank!r}: in a group of 2 this rank ({group.rank()}) can only "
                         f"talk to rank {1 - group.rank()}")


def send_eager(x: mx.array, dst: int, group) -> mx.array:
    """Send x to rank dst (the peer); returns x, as MLX's send does once evaluated."""
    _peer_rank(group, dst, "dst")
    exchange(x, group, P2P_FROM + group.rank())
    return x


def recv(shape: Sequence[int], dtype, src: int, group) -> mx.array:
    """The array of `shape` and `dtype` that rank src sends with send()."""
    _peer_rank(group, src, "src")
    shape = tuple(int(d) for d in shape)
    code = dtype_code(dtype)
    group.agree_signature(P2P_FROM + src, code, shape)
    np_dtype = NUMPY_DTYPES[dtype]
    count = int(np.prod(shape, dtype=np.int64))
    filler = np.zeros(count, dtype=np_dtype)
    received = np.empty(count, dtype=np_dtype)
    _move(group, filler, received, P2P_FROM + src, code)
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
           x: mx.array, group, name: str) -> mx.array:
    """The collective called while a transformation traces x (mx.async_eval refused it).

    Under mx.grad / mx.vjp / mx.value_and_grad the exchange runs now and
    mx.custom_function ties the result to x with `vjp`, so the gradient flows as
    through MLX's own collective. Under mx.compile or mx.vmap: refused before any
    byte moves."""
    evaluate_traced(x, name)
    fn = mx.custom_function(lambda a: eager(a, group))
    # A one-argument custom function gets its primal and cotangent as arrays, not tuples.
    fn.vjp(lambda primal, cotangent, output: vjp(primal, cotangent, group))
    return fn(x)


def pass_cotangent(x: mx.array, cotangent: mx.array, group) -> mx.array:
    """all_sum / all_max / all_min: the cotangent unchanged (MLX's AllReduce::vjp)."""
    return cotangent


def slice_cotangent(x: mx.array, cotangent: mx.array, group) -> mx.array:
    """all_gather: this rank's rows of the cotangent (MLX's AllGather::vjp)."""
    if x.ndim == 0:
        return cotangent[group.rank()]
    rows = x.shape[0]
    return cotangent[group.rank() * rows: (group.rank() + 1) * rows]


def gather_cotangent(x: mx.array, cotangent: mx.array, group) -> mx.array:
    """sum_scatter: both ranks' cotangents gathered (the transpose of a reduce-scatter
    is an all-gather), so x's gradient covers the rows the peer kept too."""
    try:
        mx.async_eval(cotangent)
    except ValueError:
        return traced(gather_eager, slice_cotangent, cotangent, group, "all_gather")
    return gather_eager(cotangent, group)


def collective(eager: Callable[[mx.array, object], mx.array],
               vjp: Callable[[mx.array, mx.array, object], mx.array],
               x: mx.array, group, name: str) -> mx.array:
    """Run `eager` on x, through `traced` when a transformation is under way."""
    try:
        # Refused inside any transformation when x is not evaluated yet: the
        # one sign of tracing MLX shows Python, and it costs the hot path
        # nothing (x must be evaluated before its bytes leave anyway).
        mx.async_eval(x)
    except ValueError:
        return traced(eager, vjp, x, group, name)
    return eager(x, group)

