"""RDMA bring-up: READY barrier, receives-posted barrier, warm-up, re-creation.

On Apple's Thunderbolt RDMA a freshly created UC queue pair can deliver in one
direction only, and UC never reports the loss: the first bulk exchange would
just time out. A UC send that reaches a queue pair with no receive posted
kills that direction for good. So before any real traffic both directions are
proven with one full-size message each way, behind a barrier that guarantees
the peer's receive is posted, and a pair that fails is destroyed and rebuilt.

connect() (handshake.py) runs bring_up_rdma on the HandshakeDone ranks when they
agreed on RDMA, and hands out the Pair only once this has returned.
"""

from __future__ import annotations

import random
import time
from typing import Optional

from ..base.log import log
from ..errors import (
    DesyncError,
    FrameError,
    PeerClosedError,
    RdmaUnavailableError,
    TransportError,
    WarmupFailedError,
)
from .handshake_done import HandshakeDone
from .rdma import RdmaDevice
from .wire import (
    MAX_STATUS_MESSAGE_BYTES,
    POSTED,
    RDMA_MAX_MSG,
    ROLE_NAMES,
    STATUS,
    WARM_MAGIC,
    WARM_PHASE_SENT,
    WARM_PHASE_STATUS,
    WARM_ROUND,
    WARM_TAG,
    WARM_WR_ID,
    FrameType,
)

# The warm message is full size: 64-byte messages pass on a fresh dead
# direction while the first 16 KiB chunks are still dropped.
WARM_BYTES = RDMA_MAX_MSG
UC_ROUNDS, UC_ROUND_SEC = 20, 0.1
MAX_SETUP_ATTEMPT = 3  # re-creations: at most four builds in all

# Test seams (tests/README.md), set only by tests (monkeypatch): they show what the
# receives-posted barrier protects against, so no user or environment can reach them.
SKIP_POSTED_BARRIER = False  # skip the receives-posted barrier before the warm-up
WARMUP_DELAY_MS = 0.0  # sleep a random 0..N ms before posting the warm-up receive


# ============================================================================
# Barriers
# ============================================================================


def ready_barrier(joined: HandshakeDone) -> None:
    """Both queue pairs are in RTS before either side goes on."""
    joined.control.send(FrameType.RDMA_READY)
    joined.control.recv(FrameType.RDMA_READY)


def posted_barrier(joined: HandshakeDone) -> None:
    """Receives-posted barrier: a sender waits for the peer's word that its
    receives are posted, because a UC send into an empty receive queue kills
    that direction on Thunderbolt for good."""
    if SKIP_POSTED_BARRIER:
        return
    joined.control.send(FrameType.RDMA_POSTED, POSTED.pack(1))
    joined.control.recv(FrameType.RDMA_POSTED)


def exchange_status(joined: HandshakeDone, ok: bool, message: str) -> tuple:
    """Both ranks learn both outcomes, so both take the same path."""
    data = message.encode("utf-8", "replace")[:MAX_STATUS_MESSAGE_BYTES]
    joined.control.send(FrameType.RDMA_STATUS, STATUS.pack(int(ok), len(data)) + data)
    _, payload = joined.control.recv(FrameType.RDMA_STATUS)
    if len(payload) < STATUS.size:
        raise FrameError(f"RDMA_STATUS payload is {len(payload)} bytes, need {STATUS.size}")
    peer_ok, n = STATUS.unpack_from(payload)
    return bool(peer_ok), payload[STATUS.size : STATUS.size + n].decode("utf-8", "replace")


# ============================================================================
# Warm-up
# ============================================================================


def warm_up(joined: HandshakeDone, rdma: RdmaDevice, rounds: int = UC_ROUNDS, round_sec: float = UC_ROUND_SEC) -> int:
    """Prove both directions; returns the rounds used. Raises WarmupFailedError."""
    if WARMUP_DELAY_MS:
        time.sleep(random.uniform(0.0, WARMUP_DELAY_MS) / 1000.0)
    rdma.post_recv(rdma.warm_recv, WARM_BYTES, WARM_WR_ID)
    posted_barrier(joined)
    tag = WARM_TAG.pack(WARM_MAGIC, joined.rank, rdma.setup_attempt, 0)
    rdma.ffi.memmove(rdma.warm_send, tag, len(tag))
    received = peer_received = False
    for round_no in range(1, rounds + 1):
        if not peer_received:
            rdma.post_send(rdma.warm_send, WARM_BYTES, WARM_WR_ID)
        # The round's clock starts only once the peer's send is posted. Why: each side has one
        # warm receive, and a message that missed the deadline is sent again. A peer that posts
        # late (descheduled between the barrier and its send) would see "not received" and send
        # a second message; the first, late but not lost, takes the one receive, and the second
        # reaches a queue pair with none posted, which kills that direction on Thunderbolt UC
        # for good, after a warm-up that passed. A dropped UC message never arrives late, so a
        # message missing after the peer's word is a drop, and only a drop is sent again.
        _exchange_round(joined, rdma, round_no, WARM_PHASE_SENT, False)
        deadline = time.monotonic() + round_sec
        while not received:
            left = deadline - time.monotonic()
            for wc in rdma.poll(8, max(0.0, left)):
                if wc.opcode == rdma.lib.TP_WC_RECV and wc.wr_id == WARM_WR_ID:
                    if wc.status != rdma.lib.TP_WC_SUCCESS:
                        raise WarmupFailedError(
                            f"tp rdma: warm-up receive completed with status {wc.status}"
                        )
                    received = True
            if left <= 0:
                break
        peer_received = _exchange_round(joined, rdma, round_no, WARM_PHASE_STATUS, received)
        if received and peer_received:
            rdma.poll(64, 0.0)  # the sends' completions: the exchanges start on a clean queue
            return round_no
    raise WarmupFailedError(
        f"tp rdma: warm-up failed after {rounds} attempts "
        f"(recv {int(received)}, peer {int(peer_received)})"
    )


def _exchange_round(joined: HandshakeDone, rdma: RdmaDevice, round_no: int, phase: int, received: bool) -> bool:
    """One RDMA_WARM each way for this round's phase; returns the peer's received flag."""
    joined.control.send(
        FrameType.RDMA_WARM, WARM_ROUND.pack(rdma.setup_attempt, round_no, int(received), phase)
    )
    _, payload = joined.control.recv(FrameType.RDMA_WARM)
    if len(payload) != WARM_ROUND.size:
        raise FrameError(f"RDMA_WARM payload is {len(payload)} bytes, expected {WARM_ROUND.size}")
    p_attempt, p_round, p_received, p_phase = WARM_ROUND.unpack(payload)
    if (p_attempt, p_round, p_phase) != (rdma.setup_attempt, round_no, phase):
        raise DesyncError(
            f"warm-up desync: the peer is at setup attempt {p_attempt} round {p_round} "
            f"phase {p_phase}, this side at {rdma.setup_attempt} round {round_no} phase {phase} "
            f"(phases: {WARM_PHASE_SENT} send posted, {WARM_PHASE_STATUS} received)"
        )
    return bool(p_received)


# ============================================================================
# Bring-up
# ============================================================================


def connect_queue_pair(joined: HandshakeDone, rdma: RdmaDevice) -> None:
    """Exchange queue pair info over the control channel, move to RTS, READY."""
    joined.control.send(FrameType.RDMA_INFO, rdma.local_info())
    _, payload = joined.control.recv(FrameType.RDMA_INFO)
    rdma.connect_peer(payload)
    ready_barrier(joined)


def bring_up_rdma(joined: HandshakeDone) -> Optional[RdmaDevice]:
    """Open the device, build, connect and warm the queue joined, re-creating
    it after a failed warm-up; returns the proven device, from which connect()
    makes the Pair. With transport="auto" any failure makes both ranks return
    None together, loudly, and fall back to TCP; with "rdma" both raise
    RdmaUnavailableError."""
    strict = joined.config.transport == "rdma"
    rdma = None
    try:
        try:
            rdma = joined.open_rdma()
            rdma.build(0)
            ok, message = True, ""
        except (TransportError, OSError) as exc:
            if isinstance(exc, PeerClosedError):
                raise
            ok, message = False, str(exc)
        peer_ok, peer_message = exchange_status(joined, ok, message)
        if not (ok and peer_ok):
            failures = []
            if not ok:
                failures.append(f"this side ({ROLE_NAMES[joined.rank]}): {message}")
            if not peer_ok:
                failures.append(f"the {ROLE_NAMES[1 - joined.rank]}: {peer_message}")
            return _give_up(rdma, strict, "rdma device setup failed on " + "; ".join(failures))
        return _warm_loop(joined, rdma, strict)
    except BaseException:
        if rdma is not None:
            rdma.close()
        raise


def _warm_loop(joined: HandshakeDone, rdma: RdmaDevice, strict: bool) -> Optional[RdmaDevice]:
    started = time.monotonic()
    setup_attempt = 0
    while True:
        connect_queue_pair(joined, rdma)
        if joined.config.disable_warmup:
            log("rdma warm-up skipped (DS4_TP_DISABLE_RDMA_WARMUP is set): a dead direction "
                   "will surface as a timeout in the first gate")
            return rdma
        warm_started = time.monotonic()
        try:
            used = warm_up(joined, rdma)
        except WarmupFailedError as exc:
            if setup_attempt >= MAX_SETUP_ATTEMPT:
                return _give_up(rdma, strict, f"{exc} on all {setup_attempt + 1} queue pair builds")
            setup_attempt += 1
            log(f"{exc}; recreating the queue pair (setup attempt {setup_attempt})")
            rdma.build(setup_attempt)
            continue
        _, send_wr, recv_wr = rdma.depths
        plural = "" if used == 1 else "s"
        now = time.monotonic()
        rdma.warmup_ms = 1000 * (now - warm_started)
        log(
            f"rdma warm-up ok ({used} attempt{plural}), queue depth recv {recv_wr} send {send_wr}"
            f" [build {setup_attempt + 1}, warm-up {rdma.warmup_ms:.1f} ms, queue pair bring-up "
            f"{1000 * (now - started):.1f} ms]"
        )
        return rdma


def _give_up(rdma: Optional[RdmaDevice], strict: bool, reason: str) -> None:
    """Both ranks reach this point from the same exchanged outcome, so both
    stop (transport=rdma) or both fall back to TCP (transport=auto)."""
    if rdma is not None:
        rdma.close()
    if strict:
        raise RdmaUnavailableError(f"{reason}; transport=rdma requested, stopping")
    log(f"WARNING: {reason}; falling back to TCP gates (transport=auto)")
    return None
