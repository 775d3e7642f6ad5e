"""A leader with no peer: every lockstep command packed and applied to this rank's own table
(lockstep.protocol.sessions.LeaderSessions without a worker), for the batch, the drafting and the
commands in one process: tests, the statistics of the sampler, and a serving leader whose group
shrank to itself alone (serve/resize.py)."""

from __future__ import annotations

from typing import Tuple

from .protocol.sessions import LeaderSessions
from .protocol.table import SessionTable


class NoGroup:
    """The group's figures a generation (and a server) reads of a rank alone: no exchanges, no
    waits, nothing to close."""

    transport = "none"

    def exchange_seconds(self) -> float:
        return 0.0

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def gate_latency_us(self) -> Tuple[float, float]:
        return 0.0, 0.0

    def close(self) -> None:
        pass


class OneRank(LeaderSessions):
    """LeaderSessions over one rank's table and no worker: every command is applied here
    only, and a hash is computed (and so checked) with nobody to compare it with. disk: this
    rank's --prompt-cache-dir (lockstep.caches.disk_cache.DiskCache), or None."""

    def __init__(self, model, grammars=None, disk=None):
        self.table, self.group, self.controls = SessionTable(model, grammars, disk), NoGroup(), []

    def abort(self, reason: str) -> None:
        """Nobody to tell."""
