"""The pair's exchange called from Python: the C entry point the MLX backend
calls inside MLX's evaluation (tp_link_exchange, csrc/exchange.c), on a
group's own link, with numpy buffers. So `ds4tp bench`, `ds4tp doctor` and the
tests time and check the very exchange a decode step runs (its signature
header, its RDMA receive window and bulk rounds, its dead-link rule), not a
path of their own. Beside it, the raw floor the bench holds it against.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DesyncError, PeerClosedError, RdmaError, TransportError, TransportTimeoutError
from .native import load_verbs

_ERR_BYTES = 512
# The dtypes Python callers move (float32 partials and raw bytes), by the name of their
# code in csrc/exchange_codes.h, the codes' one source.
_DTYPE_NAMES = {np.dtype(np.float32): "TP_DTYPE_FLOAT32", np.dtype(np.uint8): "TP_DTYPE_UINT8"}


class Exchange:
    """One collective's exchange on a link (a Group's ``c_link(peer)``), for buffers
    shaped and typed like ``like``: both ranks must build the same one, as both
    must call the same collective. Each call is one tp_link_exchange, numbered
    by the pair's shared sequence, with the GIL released."""

    def __init__(self, link: Any, like: np.ndarray):
        if like.dtype not in _DTYPE_NAMES:
            names = ", ".join(str(d) for d in _DTYPE_NAMES)
            raise TypeError(f"an exchange of {like.dtype} is not offered from Python; use one of {names}")
        self.ffi, self.lib = load_verbs()
        self.link = link
        self.shape = like.shape
        self.dtype = like.dtype
        self.sig = self.ffi.new("tp_xsig *")
        self.sig.op = self.lib.TP_XOP_SUM
        self.sig.dtype = getattr(self.lib, _DTYPE_NAMES[like.dtype])
        self.sig.bytes = like.nbytes
        self.sig.ndim = like.ndim
        for i, n in enumerate(like.shape[: self.lib.TP_XSIG_DIMS]):
            self.sig.shape[i] = n
        self._err = self.ffi.new("char[]", _ERR_BYTES)

    def __call__(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Send `send`, receive the peer's bytes into `recv` (both contiguous, like `like`)."""
        for name, buf in (("send", send), ("recv", recv)):
            if buf.shape != self.shape or buf.dtype != self.dtype or not buf.flags.c_contiguous:
                raise ValueError(f"exchange {name} is {buf.dtype} {buf.shape}, this exchange is for "
                                 f"contiguous {self.dtype} {self.shape}: build one per shape")
        ffi = self.ffi
        rc = self.lib.tp_link_exchange(self.link, self.sig, ffi.from_buffer(send),
                                       ffi.from_buffer(recv, require_writable=True), self._err, _ERR_BYTES)
        if rc != 0:
            raise rc_error(self.lib, rc, ffi.string(self._err).decode("utf-8", "replace"),
                                 rdma=self.link.dev != ffi.NULL)


def rc_error(lib: Any, rc: int, text: str, rdma: bool) -> TransportError:
    """The exception for a failed call's TP_E* return code (an exchange, the RDMA
    bring-up's calls); text is the C side's message."""
    if rc in (lib.TP_EDESYNC, lib.TP_ELOST):
        # TP_ELOST: UC dropped a message and the in-order window shifted, so the ranks'
        # streams are out of step; the text names the seq.
        return DesyncError(text)
    if rc == lib.TP_ETIMEOUT:
        return TransportTimeoutError(f"{text} (DS4_TP_TIMEOUT_SEC)")
    if rc == lib.TP_EPEER:
        return PeerClosedError(text)
    if rdma and rc != lib.TP_ECLOSED:
        return RdmaError(text, rc)
    return TransportError(text)


def raw_floor(pair: Any, send: np.ndarray, recv: np.ndarray) -> None:
    """The floor: a bare write-then-read of the same bytes on the pair's data
    socket (no header, no checks), in C and waiting as the TCP exchange does
    (poll for the pair's spin_ns, then block), so the comparison is like for like."""
    ffi, lib = load_verbs()
    src = ffi.from_buffer(send)
    dst = ffi.from_buffer(recv, require_writable=True)
    if len(src) != len(dst):
        raise ValueError(f"raw floor send is {len(src)} bytes but recv is {len(dst)}: they must match")
    err = ffi.new("char[]", _ERR_BYTES)
    rc = lib.tp_tcp_raw(pair.data.fileno(), src, dst, len(src), pair.spin_ns, err, _ERR_BYTES)
    if rc != 0:
        raise rc_error(lib, rc, ffi.string(err).decode("utf-8", "replace"), rdma=False)
