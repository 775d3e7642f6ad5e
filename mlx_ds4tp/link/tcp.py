"""TCP gates: decode gates and bulk exchanges over the dedicated gate data
socket, both sides write-then-read; plus the raw floor the bench compares with."""

from __future__ import annotations

import socket

from .control import swap_small
from .native import load_verbs
from .wire import BATCH_MAGIC, BIG_HEADER, BIG_TAG, GATE_HEADER, MAGIC
from ..errors import DesyncError, PeerClosedError, TransportError, TransportTimeoutError

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
        self._big_out = bytearray(BIG_HEADER.size)
        self._big_in_c = self.ffi.from_buffer(self._big_in)
        self._big_out_c = self.ffi.from_buffer(self._big_out)
        # Polling comes before the kernel's SO_RCVTIMEO wait, so it is capped at a quarter of
        # the timeout: a silent peer is still reported within 1.25x the timeout.
        self.spin_ns = min(spin_us * 1000, int(timeout * 1e9) // 4)

    # -- decode gates --------------------------------------------------------
    def gate(self, send, recv, seq: int, layer: int = 0, gate: int = 0) -> None:
        """The round trip runs in C with the GIL released (csrc/tcp/gate.c)."""
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
        """Both sides agree on (layer, seq, bytes) before an RDMA bulk exchange."""
        header = BIG_HEADER.pack(BATCH_MAGIC, layer & 0xFFFF, BIG_TAG, seq, nbytes)
        swap_small(self.sock, header, self._big_in, f"big gate seq {seq}", self.timeout)
        if bytes(self._big_in) != header:
            self._big_desync(layer, seq, nbytes)

    def big(self, send, recv, seq: int, layer: int = 0) -> None:
        """A bulk exchange of any size (prefill rows, gathered logits): the header and the
        payload in one byte stream each way, written and read at once in C (tp_tcp_duplex),
        polling before it sleeps as the gate does: the logits gather ends the longest stretch
        of a token's work, where one rank usually waits for the other."""
        ffi = self.ffi
        src = ffi.from_buffer(send)
        dst = ffi.from_buffer(recv, require_writable=True)
        if len(src) != len(dst):
            raise ValueError(f"big gate send is {len(src)} bytes but recv is {len(dst)}: they must match")
        BIG_HEADER.pack_into(self._big_out, 0, BATCH_MAGIC, layer & 0xFFFF, BIG_TAG, seq, len(src))
        rc = self.lib.tp_tcp_duplex(self._fd, self._big_out_c, self._big_in_c, BIG_HEADER.size, src, dst,
                                    len(src), seq, self.spin_ns, self.timeout, self._err, _ERR_BYTES)
        if rc == self.lib.TP_EDESYNC:
            self._big_desync(layer, seq, len(src))
        if rc != 0:
            self._raise(rc, seq, layer, 0)

    def _big_desync(self, layer: int, seq: int, nbytes: int) -> None:
        magic, player, tag, pseq, pbytes = BIG_HEADER.unpack(self._big_in)
        raise DesyncError(
            f"big gate desync: the peer is at layer {player} seq {pseq} with {pbytes} bytes "
            f"(magic 0x{magic:08x}, tag 0x{tag:x}), this side at layer {layer} seq {seq} with "
            f"{nbytes} bytes"
        )


def raw_exchange(gates: TcpGates, send, recv) -> None:
    """The raw floor on gates' socket (see TcpGates.raw_exchange)."""
    gates.raw_exchange(send, recv)
