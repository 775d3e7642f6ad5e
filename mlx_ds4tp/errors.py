"""Exception types of the transport and the lockstep, shared by every layer (the HTTP
server's own are in mlx_ds4tp.serve.errors).

Each error message says what failed, with the values involved, and what to do.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """The pair connection failed; the message names the values and the fix."""


class PeerClosedError(TransportError):
    """The peer closed its end or died (EOF or reset on a socket)."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A wait ran past its deadline (DS4_TP_TIMEOUT_SEC or the call's timeout)."""


class GroupNotFoundError(TransportTimeoutError):
    """Discovery could not gather the whole group of N ranks before its timeout; the message
    names the ranks it saw, the ones refused or gone, and how many were missing."""


class FrameError(TransportError):
    """A control frame was malformed, truncated, oversized or of an unknown type."""


class RegroupedError(TransportError):
    """The leader's door answered this rank's JOIN with RESIZE: the group it joins forms at
    another size (a grow whose new group did not form falls back to the ranks it had,
    serve/resize.py); `resize` is the RESIZE payload (lockstep/regroup.py reads it)."""

    def __init__(self, message: str, resize: bytes):
        super().__init__(message)
        self.resize = resize


class HelloMismatchError(TransportError):
    """The two ranks disagree about the protocol, their roles or the model."""


class DesyncError(TransportError):
    """The two ranks are not at the same gate: their headers disagree."""


class RdmaUnavailableError(TransportError):
    """RDMA was required but this side (or the peer) has no usable device."""


class MissingCableError(RdmaUnavailableError):
    """--transport rdma over named cables: two ranks share no cable (and the cables form no ring)."""


class AuthenticationError(TransportError):
    """The peer could not prove it holds the shared secret (or one side has none)."""


class RdmaError(TransportError):
    """An RDMA call failed; carries the C module's return code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class WarmupFailedError(TransportError):
    """Both directions could not be proven on this build of the queue pair."""


class LockstepDivergenceError(TransportError):
    """The two ranks computed different logits: their states diverged."""
