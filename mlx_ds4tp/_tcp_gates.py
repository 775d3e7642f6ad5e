"""TCP gates: decode gates and bulk exchanges over the dedicated gate data
socket, both sides write-then-read; plus the raw floor the bench compares with."""

from __future__ import annotations

import select
import socket
import time

from ._control import swap_small
from ._native import load_verbs
from ._wire import BATCH_MAGIC, BIG_HEADER, BIG_ROUND_BYTES, BIG_TAG, GATE_HEADER, MAGIC
from .errors import DesyncError, PeerClosedError, TransportError, TransportTimeoutError

_ERR_BYTES = 512


class TcpGates:
    """Gates over the dedicated data socket. Both sides write, then read; the
    header (magic, layer, gate, seq) travels with the payload in one sendmsg so
    TCP_NODELAY never splits them, and a mismatch is a loud desync error.

    spin_us: how long a gate polls for the peer's message before it blocks."""

    def __init__(self, sock: socket.socket, timeout: float, spin_us: int = 0):
        self.sock = sock
        self.timeout = timeout
        self.ffi, self.lib = load_verbs()
        self._fd = sock.fileno()
        self._out_header = bytearray(GATE_HEADER.size)
        self._in_header = bytearray(GATE_HEADER.size)
        self._out_header_c = self.ffi.from_buffer(self._out_header)
        self._in_header_c = self.ffi.from_buffer(self._in_header)
        self._err = self.ffi.new("char[]", _ERR_BYTES)
        self._big_in = bytearray(BIG_HEADER.size)
        self._sum_peer = self._sum_out = self._sum_c = None  # gate_sum's reused buffers
        # Polling comes before the kernel's SO_RCVTIMEO wait, so it is capped at a quarter of
        # the timeout: a silent peer is still reported within 1.25x the timeout.
        self.spin_ns = min(spin_us * 1000, int(timeout * 1e9) // 4)

    # -- decode gates --------------------------------------------------------
    def gate(self, send, recv, seq: int, layer: int = 0, gate: int = 0) -> None:
        """The round trip runs in C with the GIL released (_tcp_gate.c)."""
        ffi = self.ffi
        src = ffi.from_buffer(send)
        dst = ffi.from_buffer(recv, require_writable=True)
        if len(src) != len(dst):
            raise ValueError(f"gate send is {len(src)} bytes but recv is {len(dst)}: they must match")
        GATE_HEADER.pack_into(self._out_header, 0, MAGIC, layer & 0xFFFF, gate & 0xFFFF, seq)
        rc = self.lib.tp_tcp_gate(self._fd, self._out_header_c, self._in_header_c, GATE_HEADER.size,
                                  src, dst, len(src), seq, self.spin_ns, self._err, _ERR_BYTES)
        if rc != 0:
            self._raise(rc, seq, layer, gate)

    def gate_sum(self, send, peer, out, seq: int, dtype: int, rank: int, layer: int = 0,
                 gate: int = 0) -> None:
        """A gate whose peer partial lands in `peer` and whose sum (rank 0's partial first,
        tp_tcp_gate_sum) lands in `out`: one C call, GIL released. peer and out are reused
        from gate to gate, so their C pointers are kept (buffers cached by identity)."""
        src = self.ffi.from_buffer(send)
        if peer is not self._sum_peer or out is not self._sum_out:
            self._sum_targets(peer, out)
        peer_c, out_c = self._sum_c
        if not len(peer_c) == len(out_c) == len(src):
            raise ValueError(f"gate sum: send is {len(src)} bytes, peer {len(peer_c)}, out {len(out_c)}: "
                             "they must match")
        GATE_HEADER.pack_into(self._out_header, 0, MAGIC, layer & 0xFFFF, gate & 0xFFFF, seq)
        rc = self.lib.tp_tcp_gate_sum(self._fd, self._out_header_c, self._in_header_c, GATE_HEADER.size,
                                      src, peer_c, out_c, len(src), seq, self.spin_ns, dtype, rank,
                                      self._err, _ERR_BYTES)
        if rc != 0:
            self._raise(rc, seq, layer, gate)

    def _sum_targets(self, peer, out) -> None:
        self._sum_c = (self.ffi.from_buffer(peer, require_writable=True),
                       self.ffi.from_buffer(out, require_writable=True))
        self._sum_peer, self._sum_out = peer, out

    def raw_exchange(self, send, recv) -> None:
        """The floor: a bare write-then-read of the same bytes (no header, no
        checks), in C like the gate and waiting the same way (poll, then
        block), so the bench's comparison is like for like."""
        src = self.ffi.from_buffer(send)
        dst = self.ffi.from_buffer(recv, require_writable=True)
        rc = self.lib.tp_tcp_raw(self._fd, src, dst, len(src), self.spin_ns, self._err, _ERR_BYTES)
        if rc != 0:
            self._raise(rc, 0, 0, 0)

    def fileno(self) -> int:
        return self._fd

    def _raise(self, rc: int, seq: int, layer: int, gate: int) -> None:
        self.raise_error(rc, self.ffi.string(self._err).decode("utf-8", "replace"), bytes(self._in_header),
                         seq, layer, gate)

    def raise_error(self, rc: int, text: str, in_header: bytes, seq: int, layer: int, gate: int) -> None:
        """The error for a failed gate's rc: text is the C side's message, in_header the
        header the peer sent (read on a desync)."""
        lib = self.lib
        if rc == lib.TP_EDESYNC:
            magic, player, pgate, pseq = GATE_HEADER.unpack(in_header)
            raise DesyncError(
                f"gate desync: the peer sent layer {player} gate {pgate} seq {pseq} "
                f"(magic 0x{magic:08x}), this side is at layer {layer} gate {gate} seq {seq}"
            )
        if rc == lib.TP_ETIMEOUT:
            raise TransportTimeoutError(
                f"{text} (layer {layer} gate {gate}, timeout {self.timeout:g} s, DS4_TP_TIMEOUT_SEC)"
            )
        if rc == lib.TP_EPEER:
            raise PeerClosedError(text)
        raise TransportError(text)

    # -- big gates -----------------------------------------------------------
    def big_header(self, nbytes: int, seq: int, layer: int = 0) -> None:
        """Both sides agree on (layer, seq, bytes) before a big exchange."""
        header = BIG_HEADER.pack(BATCH_MAGIC, layer & 0xFFFF, BIG_TAG, seq, nbytes)
        swap_small(self.sock, header, self._big_in, f"big gate seq {seq}", self.timeout)
        magic, player, tag, pseq, pbytes = BIG_HEADER.unpack(self._big_in)
        if (magic, player, tag, pseq, pbytes) != (BATCH_MAGIC, layer & 0xFFFF, BIG_TAG, seq, nbytes):
            raise DesyncError(
                f"big gate desync: the peer is at layer {player} seq {pseq} with {pbytes} bytes "
                f"(magic 0x{magic:08x}, tag 0x{tag:x}), this side at layer {layer} seq {seq} with "
                f"{nbytes} bytes"
            )

    def big(self, send, recv, seq: int, layer: int = 0) -> None:
        """Prefill-sized exchange in 2 MiB rounds, each round full duplex, so
        neither side can fill its send buffer while the peer also only writes,
        whatever the socket buffer sizes are."""
        out = memoryview(send).cast("B")
        inp = memoryview(recv).cast("B")
        if len(out) != len(inp):
            raise ValueError(f"big gate send is {len(out)} bytes but recv is {len(inp)}: they must match")
        self.big_header(len(out), seq, layer)
        for start in range(0, len(out), BIG_ROUND_BYTES):
            end = min(start + BIG_ROUND_BYTES, len(out))
            self._duplex(out[start:end], inp[start:end], seq)

    def _duplex(self, out: memoryview, inp: memoryview, seq: int) -> None:
        sock = self.sock
        fd = sock.fileno()
        poller = select.poll()
        sent = got = 0
        deadline = time.monotonic() + self.timeout
        flags = socket.MSG_DONTWAIT
        while sent < len(out) or got < len(inp):
            progressed = False
            try:
                if sent < len(out):
                    n = sock.send(out[sent:], flags)
                    sent += n
                    progressed = progressed or n > 0
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise PeerClosedError(f"peer closed the gate connection during big gate seq {seq}: {exc}") from None
            try:
                if got < len(inp):
                    n = sock.recv_into(inp[got:], 0, flags)
                    if n == 0:
                        raise PeerClosedError(
                            f"peer closed the gate connection during big gate seq {seq} "
                            f"({got}/{len(inp)} bytes of this round received)"
                        )
                    got += n
                    progressed = True
            except BlockingIOError:
                pass
            except ConnectionResetError as exc:
                raise PeerClosedError(f"peer reset the gate connection during big gate seq {seq}: {exc}") from None
            if progressed:
                deadline = time.monotonic() + self.timeout
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeoutError(
                    f"big gate seq {seq}: no progress for {self.timeout:g} s "
                    f"(sent {sent}/{len(out)}, received {got}/{len(inp)} bytes of this round)"
                )
            events = select.POLLIN if got < len(inp) else 0
            if sent < len(out):
                events |= select.POLLOUT
            poller.register(fd, events)
            poller.poll(min(remaining, 1.0) * 1000)
            poller.unregister(fd)


def raw_exchange(gates: TcpGates, send, recv) -> None:
    """The raw floor on gates' socket (see TcpGates.raw_exchange)."""
    gates.raw_exchange(send, recv)
