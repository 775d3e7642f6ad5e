"""RDMA bring-up: READY barrier, receives-posted barrier, warm-up, re-creation.

The public face of ``link/rdma_bringup.py``, where the bring-up lives. connect()
(``transport.connect``) runs it itself when both ranks agree on RDMA and hands
out the pair only once its queue pair is proven (or TCP is chosen), so no
caller drives it; these names are here for tests, tools and the curious.
"""

from __future__ import annotations

from .link.handshake_done import HandshakeDone
from .link.rdma_bringup import (
    MAX_SETUP_ATTEMPT,
    UC_ROUND_SEC,
    UC_ROUNDS,
    WARM_BYTES,
    bring_up_rdma,
    connect_queue_pair,
    exchange_status,
    posted_barrier,
    ready_barrier,
    warm_up,
)

__all__ = [
    "bring_up_rdma", "connect_queue_pair", "exchange_status", "posted_barrier", "ready_barrier",
    "warm_up", "HandshakeDone", "WARM_BYTES", "UC_ROUNDS", "UC_ROUND_SEC", "MAX_SETUP_ATTEMPT",
]
