"""What the collectives over one Pair keep between calls: the gate signature
both ranks last agreed on, the reused receive buffers, the float gates' slots
(buffers and C arguments per dtype and shape), and the round-trip ring.

gate_ops.Group holds one PairCollectives (None for transport="mlx") and hands
it to the collectives (ops.py); nothing here knows about Group.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import HelloMismatchError, TransportError
from ..link.pair import Pair
from ..link.wire import DESCRIPTOR, DESCRIPTOR_MAGIC, GATE_MAX_BYTES, MAX_DIMS
from .dlpack import Bf16Export
from .dtypes import BF16_CODE, C_SUM_CODES, NUMPY_DTYPES, SUM, describe

# Round trips of this many recent decode gates are kept (p50/p99 of a run's closing line).
LATENCY_WINDOW = 8192
# Bulk-sized (prefill) sum buffers kept for this many shapes at most: a chunk's gates share
# one shape, and prompts of every length must not pile up buffers.
BULK_SLOTS_KEPT = 4


class PairCollectives:
    """The collectives' state on one pair. gate_ops.all_sum's fast path reads two
    attributes only, no call (it runs dozens of times per token): the group's alias
    of `sum_slots`, and the slot's `current`, which is True exactly while that slot's
    signature is the one both ranks last agreed on."""

    __slots__ = ("rank", "signature", "sum_slots", "bulk_slots", "_current", "_pair", "_scratch",
                 "_latency_ns", "_latency_count", "_other_exchange_ns")

    def __init__(self, pair: Pair):
        self._pair: Optional[Pair] = pair
        self.rank = pair.rank
        # The last (op, dtype code, shape) both ranks agreed on (agree_signature).
        self.signature: Optional[Tuple[int, int, Tuple[int, ...]]] = None
        self._current: Optional[SumSlot] = None  # the slot whose signature that is, if any
        self._scratch: Dict[Tuple[int, int], np.ndarray] = {}
        # The float gate's reused buffers and C arguments per (dtype, shape) (SumSlot):
        # decode-sized ones, where all_sum looks first, and bulk-sized (prefill) ones.
        self.sum_slots: Dict[tuple, SumSlot] = {}
        self.bulk_slots: Dict[tuple, SumSlot] = {}
        # Round trips of the last LATENCY_WINDOW decode gates, for the closing line of a
        # run (p50/p99). The float gates record theirs in C (tp_sum_gate_run), hence the
        # count, and the total time of every gate so far, in an array C writes too.
        self._latency_ns = np.zeros(LATENCY_WINDOW, dtype=np.int64)
        self._latency_count = np.zeros(2, dtype=np.uint64)
        # The total time of the other exchanges: bulk (prefill rows, logits) and the
        # signature checks (agree_signature).
        self._other_exchange_ns = 0

    @property
    def pair(self) -> Pair:
        if self._pair is None:
            raise TransportError("this group is closed; create a new one with mlx_ds4tp.init(...)")
        return self._pair

    def close(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None
        # all_sum's fast path finds no slot now, so it takes the path that says "closed".
        self.sum_slots.clear()
        self.bulk_slots.clear()
        self._agreed(None, None)

    # -- timing -------------------------------------------------------------
    def gate_latency_us(self) -> Tuple[float, float]:
        """(p50, p99) of the recent decode gates' round trips, in microseconds."""
        n = min(int(self._latency_count[0]), LATENCY_WINDOW)
        if n == 0:
            return 0.0, 0.0
        p50, p99 = np.percentile(self._latency_ns[:n], [50, 99]) / 1000.0
        return float(p50), float(p99)

    def record_latency(self, ns: int) -> None:
        self._latency_ns[int(self._latency_count[0]) % LATENCY_WINDOW] = ns
        self._latency_count[0] += 1
        self._latency_count[1] += ns

    def record_exchange(self, ns: int) -> None:
        """Time spent in an exchange the gates' ring does not record (bulk, signature)."""
        self._other_exchange_ns += ns

    def exchange_seconds(self) -> float:
        """Seconds spent in gates, bulk exchanges and signature checks so far."""
        return (int(self._latency_count[1]) + self._other_exchange_ns) / 1e9

    def latency_ring(self) -> Tuple[np.ndarray, np.ndarray]:
        """(round trips in ns, [how many were recorded, their total ns]): the float gates'
        C side writes both."""
        return self._latency_ns, self._latency_count

    # -- buffers --------------------------------------------------------------
    def scratch(self, nbytes: int, np_dtype) -> np.ndarray:
        """Reusable receive buffers: the gate path allocates nothing per call."""
        key = (nbytes, np.dtype(np_dtype).num)
        buf = self._scratch.get(key)
        if buf is None:
            buf = np.empty(nbytes // np.dtype(np_dtype).itemsize, dtype=np_dtype)
            self._scratch[key] = buf
        return buf

    def sum_slot(self, dtype, shape: Tuple[int, ...]) -> Optional["SumSlot"]:
        """The SumSlot for (dtype, shape), made on first use; None for a dtype the C sum
        does not take. Gate-sized slots live in sum_slots (where all_sum's fast path
        looks), bulk-sized ones in bulk_slots, at most BULK_SLOTS_KEPT of them."""
        code = C_SUM_CODES.get(dtype)
        if code is None:
            return None
        key = (dtype, shape)
        slot = self.sum_slots.get(key) or self.bulk_slots.get(key)
        if slot is not None:
            return slot
        slot = SumSlot(code, dtype, shape)
        if slot.gate:
            slot.attach(self)
            self.sum_slots[key] = slot
        else:
            bulk = self.bulk_slots
            for old in list(bulk)[: max(0, len(bulk) - BULK_SLOTS_KEPT + 1)]:
                del bulk[old]
            bulk[key] = slot
        return slot

    # -- the gate signature ---------------------------------------------------
    def agree_signature(self, op: int, dtype_code: int, shape: Tuple[int, ...],
                        slot: Optional["SumSlot"] = None) -> None:
        """When the collective, dtype or shape changes, both ranks compare theirs.
        slot: the float gate's slot of this signature, marked current once agreed."""
        sig = (op, dtype_code, shape)
        if sig == self.signature:
            self._agreed(sig, slot)
            return
        if len(shape) > MAX_DIMS:
            raise ValueError(f"gate arrays have at most {MAX_DIMS} dimensions, got shape {shape}")
        dims = list(shape) + [0] * (MAX_DIMS - len(shape))
        mine = DESCRIPTOR.pack(DESCRIPTOR_MAGIC, dtype_code, len(shape), op, *dims)
        t0 = time.perf_counter_ns()
        theirs = self.pair.exchange_small(mine, "gate signature")
        self.record_exchange(time.perf_counter_ns() - t0)
        magic, pcode, pndim, pop, *pdims = DESCRIPTOR.unpack(theirs)
        if magic != DESCRIPTOR_MAGIC:
            raise HelloMismatchError(
                f"gate signature: this rank changed its partial to {describe(op, dtype_code, shape)} "
                f"while the peer did not (it sent magic 0x{magic:08x}); both ranks must run "
                "the same sequence of gates"
            )
        pshape = tuple(pdims[:pndim])
        if (pop, pcode, pshape) != sig:
            raise HelloMismatchError(
                f"gate partial mismatch: this rank has {describe(op, dtype_code, shape)}, the peer "
                f"has {describe(pop, pcode, pshape)}; both ranks must call the same collective "
                "with the same shape and dtype"
            )
        self._agreed(sig, slot)

    def _agreed(self, sig: Tuple[int, int, Tuple[int, ...]], slot: Optional["SumSlot"]) -> None:
        """sig is agreed: the slot that was current no longer is, `slot` (if any) is."""
        if self._current is not None:
            self._current.current = False
        self.signature = sig
        self._current = slot
        if slot is not None:
            slot.current = True


class SumSlot:
    """What the float gate reuses for one (dtype, shape): the peer's partial lands in `peer`,
    the sum in `out`, so a gate allocates nothing. `result` is out in the result's shape as a
    memoryview: MLX copies a memoryview into a new array in about half the time it takes for
    the numpy array itself (no ndarray conversion). `finish()` makes that array: a copy of
    `result` (bfloat16, which numpy lacks: a copy through DLPack, dlpack.py).

    A gate-sized slot (up to GATE_MAX_BYTES) holds the pair's SumGate for it: `run(ctx,
    src, nbytes)` is the whole exchange and sum in one C call (gate_ops.all_sum calls it
    directly), `fail(rc)` raises its error."""

    __slots__ = ("code", "signature", "current", "gate", "peer", "out", "result", "finish", "ctx",
                 "run", "nbytes", "fail", "to_c", "sum_gate")

    def __init__(self, code: int, dtype, shape: Tuple[int, ...]):
        np_dtype = NUMPY_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        self.code = code
        self.signature = (SUM, code, shape)
        self.current = False  # set by PairCollectives while this is the agreed signature
        self.nbytes = count * np.dtype(np_dtype).itemsize
        self.gate = self.nbytes <= GATE_MAX_BYTES
        self.peer = np.empty(count, dtype=np_dtype)
        self.out = np.empty(count, dtype=np_dtype)
        self.result = memoryview(self.out.reshape(shape))
        self.finish = Bf16Export(self.out, shape) if code == BF16_CODE else partial(mx.array, self.result)
        self.sum_gate = self.ctx = self.run = self.fail = self.to_c = None

    def attach(self, state: PairCollectives) -> None:
        """Fix the gate's C arguments on the state's pair (a gate-sized slot only)."""
        latency_ns, latency_count = state.latency_ring()
        gate = state.pair.sum_gate(self.peer, self.out, self.code, SUM, self.code, latency_ns, latency_count)
        self.sum_gate = gate  # owns the buffers ctx points into
        self.ctx, self.run, self.fail, self.to_c = gate.ctx, gate.run, gate.fail, gate.to_c
