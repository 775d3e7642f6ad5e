"""The pair of ranks as connect() hands it out: both connections, the
hellos, the RDMA device when its queue pair is proven by the bring-up (else
TCP), and the state every exchange of the pair shares (csrc/exchange.c)."""

from __future__ import annotations

from typing import Optional, Tuple

from ..errors import FrameError, HelloMismatchError
from .control import ControlChannel
from .fingerprint import Fingerprint, first_difference, summary_label
from .handshake_done import HandshakeDone
from .native import load_verbs
from .rdma import RdmaDevice
from .wire import FINGERPRINT_SUMMARY, LEADER, ROLE_NAMES, FrameType


class Pair:
    """An established connection between the two ranks: control channel, gate
    data connection and, over RDMA, the proven device (connect() makes one,
    complete: RDMA proven, or TCP). The exchanges themselves run in C on a
    link made of it (collectives/backend.py, link/exchange.py)."""

    def __init__(self, joined: HandshakeDone, rdma: Optional[RdmaDevice]):
        self._joined = joined  # closes both connections
        config = joined.config
        self.config = config
        self.rank = config.rank
        self.control = joined.control
        self.data = joined.data
        self.mine = joined.mine
        self.peer_hello = joined.theirs
        # The transport follows from the device: a pair says "rdma" only with its queue pair
        # proven, so no exchange can quietly run over TCP while the pair says otherwise.
        self.transport = "rdma" if rdma is not None else "tcp"
        self.timeout = float(config.timeout)
        self.rdma: Optional[RdmaDevice] = rdma
        # How long a TCP exchange polls for the peer's bytes before it blocks. Polling comes
        # before the kernel's SO_RCVTIMEO wait, so it is capped at a quarter of the timeout:
        # a silent peer is still reported within 1.25x the timeout.
        self.spin_ns = min(config.tcp_spin_us * 1000, int(self.timeout * 1e9) // 4)
        # The sequence number of the last exchange, and whether the pair is closed, in C
        # memory: the exchanges (csrc/exchange.c) bump and check them without Python.
        ffi, _ = load_verbs()
        self.state = ffi.new("tp_pair_state *")
        self.closed = False

    @property
    def seq(self) -> int:
        """The last exchange's sequence number (tests set it to put the ranks out of step)."""
        return int(self.state.seq)

    @seq.setter
    def seq(self, value: int) -> None:
        self.state.seq = value

    @property
    def peer_name(self) -> str:
        """"leader" or "worker": the other rank's role."""
        return ROLE_NAMES[1 - self.rank]

    def fingerprint_labels(self) -> Tuple[str, str]:
        """(this side's, the peer's) model fingerprint as the hello carried
        them: 12 hex digits each, or "none"."""
        return summary_label(self.mine.fingerprint), summary_label(self.peer_hello.fingerprint)

    def agree_fingerprint(self, fingerprint: Fingerprint) -> None:
        """Both ranks swap fingerprints on the control channel (for a pair
        whose hello carried none, e.g. before load_split); a difference raises
        HelloMismatchError on both, naming both and the first difference."""
        mine = fingerprint.summary()
        self.control.send(FrameType.FINGERPRINT, mine)
        _, theirs = self.control.recv(FrameType.FINGERPRINT)
        if len(theirs) != FINGERPRINT_SUMMARY.size:
            raise FrameError(f"FINGERPRINT payload is {len(theirs)} bytes, expected {FINGERPRINT_SUMMARY.size}")
        if theirs != mine:
            raise fingerprint_mismatch(self.control, self.rank, fingerprint, theirs)

    def close(self) -> None:
        """Close the RDMA device and both connections (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.state.closed = 1  # before the device is freed: the backend's exchanges refuse from now on
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None
        self._joined.close()


def fingerprint_mismatch(control: ControlChannel, rank: int, mine: Optional[Fingerprint],
                         their_summary: bytes) -> HelloMismatchError:
    """The error both ranks raise when their fingerprints differ. When both
    have one, they first swap the details so each can name the first
    difference (both run this on the same two fingerprints)."""
    peer = ROLE_NAMES[1 - rank]
    here, there = summary_label(b"" if mine is None else mine.summary()), summary_label(their_summary)
    if mine is None or not their_summary:
        without, having = ("this side", f"the {peer}") if mine is None else (f"the {peer}", "this side")
        why = (f"{without} joined without a model fingerprint and {having} with one; start both "
               "ranks the same way, each with its model directory")
    else:
        # One side at a time: a big model's details (megabytes) written by both
        # ranks at once could fill both sockets' buffers and wait forever.
        if rank == LEADER:
            control.send(FrameType.FINGERPRINT_DETAIL, mine.details())
            _, payload = control.recv(FrameType.FINGERPRINT_DETAIL)
        else:
            _, payload = control.recv(FrameType.FINGERPRINT_DETAIL)
            control.send(FrameType.FINGERPRINT_DETAIL, mine.details())
        theirs = Fingerprint.from_details(payload)
        if theirs.summary() != their_summary:
            raise FrameError(f"the {peer}'s fingerprint details do not add up to its fingerprint {there}")
        why = first_difference(mine, theirs, peer) or "the fingerprints differ"
    return HelloMismatchError(
        f"model mismatch: fingerprint {here} here and {there} on the {peer}: {why}; "
        "load the same model on both machines"
    )
