"""A leader with no peer: every lockstep command packed and applied to this rank's own table
(lockstep.protocol.sessions.LeaderSessions without a worker), for the batch, the drafting and the
commands in one process: tests and the statistics of the sampler."""

from __future__ import annotations

from .protocol.sessions import LeaderSessions
from .protocol.table import SessionTable


class _NoGroup:
    """The group's figures a generation reads: no exchanges, no waits."""

    def exchange_seconds(self) -> float:
        return 0.0


class OneRank(LeaderSessions):
    """LeaderSessions over one rank's table and no worker: every command is applied here
    only, and a hash is computed (and so checked) with nobody to compare it with."""

    def __init__(self, model, grammars=None):
        self.table, self.group, self.controls = SessionTable(model, grammars), _NoGroup(), []
