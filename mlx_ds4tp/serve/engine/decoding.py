"""The engine's view of the leader's batch (lockstep.batch.Batch): the sessions decoding and
waiting to join, each step's output by session, and the step timings the mixed-prefill choice
decides by (serve.engine.mixing). The batch itself decodes, samples and speculates, for `ds4tp run`
and `ds4tp serve` alike; this module only maps its rows to the engine's sessions.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ...lockstep.batch import Batch, StepOutput as BatchStep
from .generation import RunningSession, StepOutput, cancelled_out
from .mixing import MixChoice


class DecodeStepper:
    """The batch's rows as the engine's sessions (see the module docstring)."""

    def __init__(self, batch: Batch, mixing: MixChoice):
        self.batch = batch
        self.mixing = mixing  # the step timings it decides by (serve.engine.mixing)
        self._sessions: Dict[int, RunningSession] = {}  # by row id

    @property
    def stats(self) -> Dict[str, int]:
        return self.batch.stats

    @property
    def ready(self) -> List[RunningSession]:
        """Prefilled sessions waiting for a row."""
        return [self._sessions[r.id] for r in self.batch.ready]

    @property
    def running(self) -> List[RunningSession]:
        """The sessions of the batch, in row order."""
        return [self._sessions[r.id] for r in self.batch.running]

    @property
    def has_rows(self) -> bool:
        return self.batch.has_rows

    @property
    def first_unread(self) -> bool:
        """The unread step made a session's first token."""
        return self.batch.first_unread

    def free_rows(self) -> int:
        return self.batch.free_rows()

    def join(self, sessions: List[RunningSession]) -> None:
        """Prefilled sessions: they join the batch at the next step with a free row."""
        self._adopt(sessions)
        self.batch.join([s.sid for s in sessions])

    def step(self, entering: List[RunningSession]) -> Optional[StepOutput]:
        """One decode step (Batch.step); `entering`: prompts a mixed step carries from now on."""
        self._adopt(entering)
        return self._output(self.batch.step([s.sid for s in entering]))

    def read_ahead(self) -> Optional[StepOutput]:
        """The last pipelined step's tokens now (Batch.read_ahead)."""
        return self._output(self.batch.read_ahead())

    def commit(self, out: StepOutput, used: List[int]) -> None:
        """After a verify step: every rank keeps in each row's cache the positions it used."""
        if out.step is not None:
            self.batch.commit(out.step, used)

    def drop(self, ended: List[RunningSession]) -> None:
        """Sessions that ended (Admission.close removed them from the batch)."""
        for session in ended:
            self._sessions.pop(session.sid, None)

    def take_cancelled(self) -> List[RunningSession]:
        """The waiting sessions whose requests were cancelled (for the caller to end)."""
        cancelled = cancelled_out(self.ready)[1]
        self.drop(cancelled)
        return cancelled

    def clear(self) -> None:
        self._sessions = {}

    def _adopt(self, sessions: List[RunningSession]) -> None:
        for session in sessions:
            self._sessions[session.sid] = session

    def _output(self, out: Optional[BatchStep]) -> Optional[StepOutput]:
        if out is None:
            return None
        if not self.batch.pipelined:
            # A stepped step's time, to the mixed-prefill choice: a mixed step beside a decode
            # step as wide as its decode rows (1 + the drafts of the widest).
            if out.prompt_tokens:
                self.mixing.mixed_timed(out.seconds, out.prompt_tokens, out.width)
            else:
                self.mixing.decode_timed(out.seconds, out.width)
        return StepOutput([self._sessions[r.id] for r in out.rows], out.results, out.verify, out)
