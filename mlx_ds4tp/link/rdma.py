"""The RDMA device of a pair over the _verbs C module (ibverbs, or the
emulated UC device "ucsim"): one registered slab and one UC queue pair, built,
connected and warmed up from here (rdma_bringup.py); the exchange (csrc/exchange.c)
then runs its decode window and bulk rounds on it in C."""

from __future__ import annotations

import dataclasses
import mmap
from typing import Optional, Tuple

from ..base.log import log
from ..errors import FrameError, RdmaUnavailableError
from .config import VERBS_LIBRARY_ENV
from .exchange import rc_error
from .native import load_verbs
from .wire import RDMA_INFO, RDMA_MAX_MSG

UCSIM = "ucsim"
_ERR_BYTES = 512


def use_verbs_library(ffi, lib, path: str) -> None:
    """Point the ibverbs provider at the verbs library `path` ("" = the system
    one) for the probes and opens that follow. The C side only records the path:
    a library that cannot be loaded is reported by the next probe or open,
    naming the path and DS4_TP_VERBS_LIBRARY."""
    err = ffi.new("char[]", _ERR_BYTES)
    if lib.tp_set_verbs_library(path.encode() if path else ffi.NULL, err, _ERR_BYTES) < 0:
        raise RdmaUnavailableError(
            f"{VERBS_LIBRARY_ENV}={path!r}: {ffi.string(err).decode('utf-8', 'replace')}"
        )


def rdma_probe(device: Optional[str], verbs_library: str) -> Tuple[bool, str]:
    """(usable, reason): does this side have the RDMA device it would use?
    verbs_library: the library the ibverbs provider loads ("" = the system
    one; LinkSettings.verbs_library)."""
    try:
        ffi, lib = load_verbs()
        use_verbs_library(ffi, lib, verbs_library)
    except RdmaUnavailableError as exc:
        return False, str(exc)
    err = ffi.new("char[]", _ERR_BYTES)
    ok = lib.tp_probe(device.encode() if device else ffi.NULL, err, _ERR_BYTES)
    return bool(ok), ffi.string(err).decode("utf-8", "replace")


@dataclasses.dataclass(frozen=True)
class RdmaOpening:
    """What one side opens its RDMA device with (HandshakeDone.open_rdma makes it from the link's
    settings and sockets).

    device: "ucsim" or an ibverbs device name (None: the first). gid_index:
    None lets the provider pick. rank: 0 leader, 1 worker. bind_ip: this
    side's control address (ucsim sends its datagrams from it). control_fd,
    data_fd: the pair's sockets, watched by the hot loops so a dead peer is an
    error, never a hang. timeout: every wait, in seconds. faults: the emulated
    device's faults (DS4_TP_UCSIM_FAULTS syntax). no_imm: send without the
    immediate-data sequence tag (LinkSettings.rdma_no_imm, DS4_TP_RDMA_NO_IMM).
    verbs_library: the library the ibverbs provider loads ("" = the system one;
    LinkSettings.verbs_library, DS4_TP_VERBS_LIBRARY)."""

    device: Optional[str]
    gid_index: Optional[int]
    rank: int
    bind_ip: str
    control_fd: int
    data_fd: int
    timeout: float
    verbs_library: str
    faults: str = ""
    no_imm: bool = False


class RdmaDevice:
    """One registered slab and one UC queue pair on an open device (RdmaOpening says which)."""

    def __init__(self, opening: "RdmaOpening"):
        self.ffi, self.lib = load_verbs()
        use_verbs_library(self.ffi, self.lib, opening.verbs_library)
        self.timeout = opening.timeout
        self.no_imm = opening.no_imm
        self._err = self.ffi.new("char[]", _ERR_BYTES)
        self.device = opening.device or ""
        bind_ip = opening.bind_ip
        if self.device == UCSIM and ":" in bind_ip:
            raise RdmaUnavailableError(
                f"ucsim needs an IPv4 control address, this side uses {bind_ip}; "
                "connect the pair over IPv4 (e.g. 127.0.0.1)"
            )
        # The slab is registered once: the Apple stack allows about 100
        # memory regions in all. The hot paths own its head; the tail holds
        # the warm-up's one send and one receive buffer.
        self.hot_bytes = int(self.lib.tp_slab_bytes())
        self.slab_bytes = self.hot_bytes + 2 * RDMA_MAX_MSG
        # Anonymous mmap: page aligned, zeroed, never moved by Python.
        self._slab_map = mmap.mmap(-1, self.slab_bytes)
        self.slab = self.ffi.from_buffer(self._slab_map)
        self.dev = self.lib.tp_open(
            self.device.encode() if self.device else self.ffi.NULL,
            -1 if opening.gid_index is None else int(opening.gid_index),
            bind_ip.encode(),
            opening.rank,
            opening.faults.encode(),
            self.slab,
            self.slab_bytes,
            self._err,
            _ERR_BYTES,
        )
        if self.dev == self.ffi.NULL:
            raise RdmaUnavailableError(self._error_text())
        self.lib.tp_set_fds(self.dev, opening.control_fd, opening.data_fd)
        self.lib.tp_set_no_imm(self.dev, int(opening.no_imm))
        self.warm_send = self.slab + self.hot_bytes
        self.warm_recv = self.slab + self.hot_bytes + RDMA_MAX_MSG
        self.setup_attempt = 0
        self.depths: Tuple[int, int, int] = (0, 0, 0)
        self.warmup_ms: Optional[float] = None  # set by the bring-up (rdma_bringup.py) once both directions are proven

    # -- setup -----------------------------------------------------------------
    def _error_text(self) -> str:
        return self.ffi.string(self._err).decode("utf-8", "replace")

    def _check(self, rc: int) -> int:
        if rc < 0:
            raise rc_error(self.lib, rc, self._error_text(), rdma=True)
        return rc

    def build(self, setup_attempt: int) -> Tuple[int, int, int]:
        """(Re)build CQ and QP; returns the granted (cq, send, recv) depths.
        If the device refuses the full depths, halve them until it accepts."""
        self.setup_attempt = setup_attempt
        # The depths asked for are the C module's (TP_DEFAULT_*): it sizes its
        # hot-path rounds from the same numbers. The Apple driver may grant less.
        asked = (self.lib.TP_DEFAULT_CQ, self.lib.TP_DEFAULT_SEND_WR, self.lib.TP_DEFAULT_RECV_WR)
        cq, send, recv = asked
        while True:
            rc = self.lib.tp_build_qp(
                self.dev, self.lib.TP_QPT_UC, setup_attempt, cq, send, recv, self._err, _ERR_BYTES
            )
            if rc == self.lib.TP_ENOMEM and recv > 64:
                log(f"queue pair depths cq {cq} send {send} recv {recv} refused; trying half")
                cq, send, recv = max(64, cq // 2), send // 2, recv // 2
                continue
            self._check(rc)
            break
        out = self.ffi.new("int[3]")
        self.lib.tp_depths(self.dev, out, out + 1, out + 2)
        granted = (out[0], out[1], out[2])
        if granted != asked:
            log(f"queue pair granted cq {granted[0]} send {granted[1]} recv {granted[2]} "
                f"(asked {asked[0]}/{asked[1]}/{asked[2]})")
        self.depths = granted
        return granted

    def local_info(self) -> bytes:
        """This side's queue pair address (RDMA_INFO layout) for the peer."""
        info = self.ffi.new("tp_info *")
        self._check(self.lib.tp_local_info(self.dev, info))
        return RDMA_INFO.pack(
            info.qpn, info.psn, info.mtu, info.lid, info.link_layer, bytes(self.ffi.buffer(info.gid, 16))
        )

    def connect_peer(self, payload: bytes) -> None:
        """Move the queue pair to RTS towards the peer's RDMA_INFO payload."""
        if len(payload) != RDMA_INFO.size:
            raise FrameError(f"RDMA_INFO payload is {len(payload)} bytes, expected {RDMA_INFO.size}")
        qpn, psn, mtu, lid, link_layer, gid = RDMA_INFO.unpack(payload)
        info = self.ffi.new("tp_info *")
        info.qpn, info.psn, info.mtu, info.lid, info.link_layer = qpn, psn, mtu, lid, link_layer
        self.ffi.memmove(info.gid, gid, 16)
        self._check(self.lib.tp_connect(self.dev, info, self._err, _ERR_BYTES))

    def stats(self):
        """The C module's counters (tp_stats)."""
        out = self.ffi.new("tp_stats *")
        self.lib.tp_get_stats(self.dev, out)
        return out

    # -- raw work requests (warm-up) -------------------------------------------
    def post_recv(self, addr, nbytes: int, wr_id: int) -> None:
        """Post one receive of nbytes at addr (inside the slab)."""
        self._check(self.lib.tp_post_recv(self.dev, addr, nbytes, wr_id, self._err, _ERR_BYTES))

    def post_send(self, addr, nbytes: int, wr_id: int) -> None:
        """Post one signalled SEND of nbytes from addr (inside the slab)."""
        self._check(
            self.lib.tp_post_send(
                self.dev, addr, nbytes, wr_id, self.lib.TP_OP_SEND, 1, self._err, _ERR_BYTES
            )
        )

    def poll(self, max_wc: int, timeout: float):
        """Up to max_wc completions, waiting at most timeout seconds."""
        wc = self.ffi.new("tp_wc[]", max_wc)
        n = self._check(self.lib.tp_poll(self.dev, wc, max_wc, timeout, self._err, _ERR_BYTES))
        return [wc[i] for i in range(n)]

    def close(self) -> None:
        """Destroy the queue pair and device; release the slab."""
        if self.dev is not None and self.dev != self.ffi.NULL:
            self.lib.tp_close(self.dev)
        self.dev = None
        self.slab = None
        try:
            self._slab_map.close()
        except (BufferError, ValueError):
            pass
