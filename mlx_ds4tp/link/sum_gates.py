"""The float gate as one C call: a tp_sum_gate holds every argument that stays
the same from gate to gate of one (dtype, shape), so all_sum's hot path hands
C only the partial's buffer.

Why a context and not a call with all the arguments: on a decode gate of a few
microseconds each converted argument, Python frame and attribute lookup is a
visible fraction of the round trip, and after the gate's system calls they run
with cold caches (measured at 2-3x their cost in a tight loop). Filling a
struct once leaves three arguments to convert per gate."""

from __future__ import annotations

from typing import Any, Callable

from .native import load_verbs
from .wire import GATE_HEADER, GATE_MAX_BYTES
from ..errors import TransportError


class SumGate:
    """One (dtype, shape)'s float gate over a pair's transport.

    run(ctx, to_c(partial), nbytes) -> rc is the C entry (tp_sum_gate_run): the peer's partial lands
    in `peer`, rank 0's partial plus rank 1's in `out`, the pair's sequence number is
    bumped and the round trip timed into the latency ring. A non-zero rc goes to fail(rc),
    which raises the transport's own error for it."""

    __slots__ = ("ctx", "run", "to_c", "nbytes", "_keep", "_raise")

    def __init__(self, ctx: Any, run: Callable[..., int], nbytes: int, keep: tuple,
                 raise_error: Callable[[int, str, bytes, int], None]):
        self.ctx = ctx
        self.run = run
        self.to_c = load_verbs()[0].from_buffer  # src for run: any contiguous buffer
        self.nbytes = nbytes
        self._keep = keep  # the C buffers the struct points into stay alive with it
        self._raise = raise_error

    def fail(self, rc: int) -> None:
        ffi, lib = load_verbs()
        ctx = self.ctx
        text = ffi.string(ctx.err).decode("utf-8", "replace")
        if rc == lib.TP_ECLOSED:
            raise TransportError(text)
        self._raise(rc, text, bytes(ffi.buffer(ctx.hdr_in)), ctx.pair.seq)


def make_sum_gate(state: Any, tcp, rdma, rank: int, peer, out, dtype: int, layer: int, gate: int,
                  latency_ns=None, latency_count=None) -> SumGate:
    """A SumGate over rdma (RdmaGates) when given, else tcp (TcpGates). state: the pair's
    tp_pair_state. peer and out: writable buffers of the partial's size, reused by every
    gate. dtype: lib.TP_SUM_*. latency_ns (int64 buffer) and latency_count (a uint64[2]
    buffer: the round trips recorded, their total ns): the ring each round trip is recorded
    in, or None."""
    ffi, lib = load_verbs()
    peer_c = ffi.from_buffer(peer, require_writable=True)
    out_c = ffi.from_buffer(out, require_writable=True)
    if len(peer_c) != len(out_c) or len(out_c) > GATE_MAX_BYTES:
        raise ValueError(f"sum gate: peer is {len(peer_c)} bytes and out {len(out_c)}; they must match "
                         f"and be at most {GATE_MAX_BYTES} bytes (a bigger exchange is bulk_sum)")
    ctx = ffi.new("tp_sum_gate *")
    if len(ctx.hdr_out) != GATE_HEADER.size:  # C builds the header _wire describes
        raise AssertionError("_wire.GATE_HEADER and tp_sum_gate.hdr_out disagree on the header size")
    ctx.pair = state
    ctx.rank = rank
    ctx.dtype = dtype
    ctx.layer = layer & 0xFFFF
    ctx.gate = gate & 0xFFFF
    ctx.peer = peer_c
    ctx.out = out_c
    ctx.bytes = len(out_c)
    keep: tuple = (peer, out, peer_c, out_c, state)
    if rdma is not None:
        ctx.dev = rdma.dev
        ctx.timeout_s = rdma.timeout
        keep += (rdma,)

        def raise_error(rc: int, text: str, header: bytes, seq: int) -> None:
            rdma.raise_error(rc, text)
    else:
        ctx.dev = ffi.NULL
        ctx.fd = tcp.fileno()
        ctx.spin_ns = tcp.spin_ns

        def raise_error(rc: int, text: str, header: bytes, seq: int) -> None:
            tcp.raise_error(rc, text, header, seq, layer, gate)
    if latency_ns is not None:
        ring = ffi.from_buffer("int64_t[]", latency_ns, require_writable=True)
        count = ffi.from_buffer("uint64_t[]", latency_count, require_writable=True)
        if len(count) < 2:
            raise ValueError(f"sum gate: latency_count holds {len(count)} uint64; it needs 2 "
                             "(the round trips recorded and their total ns)")
        ctx.latency_ns = ring
        ctx.latency_len = len(ring)
        ctx.latency_count = count
        keep += (latency_ns, latency_count, ring, count)
    return SumGate(ctx, lib.tp_sum_gate_run, len(out_c), keep, raise_error)

