"""The sessions whose prompts are still being prefilled, and how each turn prefills them.

One chunk of each of the oldest of them (up to prompt_concurrency) goes in one padded
forward on both ranks (PREFILL_BATCH): prompts that arrive together cost one forward per
chunk, not one each, and a long prompt delays the running sessions by one chunk per turn,
not by its whole length. With --mixed-prefill the prompts may instead ride in the decode step
(serve.engine.mixing decides, turn by turn, from what it measured): they are then handed over to the
decode batch, which carries their chunks from there on.
"""

from __future__ import annotations

import time
from typing import List

from ...lockstep.batch import Batch
from ...lockstep.protocol.commands.limits import MAX_PREFILL_ROWS, MAX_TOKENS_PER_FRAME
from ..limits import ServeLimits
from .generation import RunningSession, cancelled_out
from .mixing import MixChoice


class PrefillScheduler:
    """The prefilling sessions, oldest first (see the module docstring)."""

    def __init__(self, batch: Batch, limits: ServeLimits):
        self.batch = batch
        # One forward takes at most prefill_step tokens in all, padding included, however many
        # rows share it: its activations (the attention scores above all) then never outgrow
        # those of one session's chunk; and no more than one PREFILL_BATCH frame carries.
        self.step = min(limits.prefill_step, MAX_TOKENS_PER_FRAME)
        # Prompts prefilled together in one padded forward (mlx_lm.server's --prompt-concurrency).
        self.concurrency = max(1, min(limits.prompt_concurrency, MAX_PREFILL_ROWS))
        # Prompt tokens a prefilling session carries in a decode step (0: prompts are prefilled
        # in forwards of their own); serve.engine.mixing says why, and decides when.
        self.mixed_prefill = limits.mixed_prefill
        self.mixing = MixChoice(limits.mixed_when)
        self.queue: List[RunningSession] = []
        self.stats = {"prefilled_tokens": 0, "prefill_batches": 0, "prefill_batch_rows": 0,
                      "prefill_padded_tokens": 0}

    def add(self, session: RunningSession) -> None:
        self.queue.append(session)

    def mixes(self, batch_has_room: bool) -> bool:
        """Whether this turn's prompts ride in the decode step (the decode batch has sessions
        and a free row); a full batch has no row for a prompt: it is prefilled on its own."""
        return bool(self.mixed_prefill and batch_has_room and self.queue and self.mixing.mix())

    def chunk(self) -> List[RunningSession]:
        """Prefill one chunk of each of the oldest sessions in one forward; the sessions whose
        prefill that finished (they wait to join the decode batch)."""
        waiting = self.queue[: self.concurrency]
        # The rows share the chunk evenly; a short prompt takes only what it needs.
        width = min(max(len(s.todo) for s in waiting), max(self.step // len(waiting), 1))
        count = max(1, min(len(waiting), self.step // width))
        rows = [(session, len(session.todo[:width])) for session in waiting[:count]]
        total = sum(n for _, n in rows)
        began = time.perf_counter()
        finished = self.batch.prefill([(session.sid, n) for session, n in rows])
        self.mixing.prefill_timed(time.perf_counter() - began, total)
        self.stats["prefilled_tokens"] += total
        self.stats["prefill_batches"] += 1
        self.stats["prefill_batch_rows"] = max(self.stats["prefill_batch_rows"], len(rows))
        self.stats["prefill_padded_tokens"] = max(self.stats["prefill_padded_tokens"],
                                                  len(rows) * max(n for _, n in rows))
        done = [session for session, _ in rows if session.sid in finished]
        for session in done:
            self.queue.remove(session)
        return done

    def hand_over(self, count: int) -> List[RunningSession]:
        """The oldest `count` prefilling sessions, for a mixed decode step to carry from now on."""
        entering, self.queue = self.queue[:count], self.queue[count:]
        return entering

    def take_cancelled(self) -> List[RunningSession]:
        """The sessions whose requests were cancelled, out of the queue (for the caller to end)."""
        self.queue, cancelled = cancelled_out(self.queue)
        return cancelled

    def clear(self) -> None:
        self.queue = []

    def rebind(self) -> None:
        """Prefill over a pair joined anew (the queue went with the old one)."""
        self.queue = []
