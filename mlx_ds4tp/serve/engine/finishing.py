"""What becomes of a step's tokens: each into its row's answer (text out, logprobs, the finish
reason: an eos, a stop string, max_tokens), then the rows that finished ended on both ranks, a
completed one's cache stored for reuse (serve.engine.admission). Every kind of step (pipelined,
stepped, verified, mixed) ends here alike, from what the batch returned (lockstep/batch.py's
StepOutput). The counts the HTTP side reports travel in the events (TextEvent, DoneEvent)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import mlx.core as mx

from ...lockstep.batch import Row, RowResult, StepOutput
from ...lockstep.sampling.options import logprob_item
from .admission import Admission
from .events import DoneEvent, FailedEvent, TextEvent
from .generation import Reply, Ticket


@dataclasses.dataclass
class Outcome:
    """One row after its tokens went in: its finish reason (None: it runs on), whether its held
    text is sent, how many of its positions in the step it used, and why it failed."""

    finish: Optional[str]
    flush: bool
    used: int
    error: str = ""


class Finishing:
    """Token intake and session ends (see the module docstring)."""

    def __init__(self, admission: Admission, tokenizer):
        self.admission = admission
        self.tokenizer = tokenizer
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.replies: Dict[int, Reply] = {}  # by row id
        self.stats = {"generated_tokens": 0}

    def open(self, row: Row, ticket: Ticket) -> None:
        """A started row: its tokens are written to `ticket` from now on."""
        self.replies[row.id] = Reply(ticket, self.tokenizer)

    def forget(self, row: Row) -> None:
        """A row ended without an answer (cancelled, or the pair down)."""
        self.replies.pop(row.id, None)

    def advance(self, out: StepOutput) -> List[Outcome]:
        """Each row's new tokens into its answer, in order, until one ends it."""
        return [self._row(row, result) for row, result in zip(out.rows, out.results)]

    def _row(self, row: Row, result: RowResult) -> Outcome:
        if result.chunk:  # a prompt chunk: all its positions kept, no token yet
            return Outcome(None, True, result.chunk)
        if result.tokens is None:
            return Outcome("failed", False, 1, result.error)
        outcome = Outcome(None, True, 0)
        for token in result.tokens:
            outcome.used += 1
            try:
                outcome.finish, outcome.flush = self.take_token(row, token, result.logprobs)
            except Exception as exc:  # noqa: BLE001 - this request's text, reported to it alone
                outcome.finish, outcome.flush, outcome.error = "failed", False, f"{type(exc).__name__}: {exc}"
            if outcome.finish is not None:
                break
        return outcome

    def take_token(self, row: Row, token: int, logprobs: Optional[mx.array]) -> tuple:
        """Take a row's new token into its answer: (finish reason or None, whether held text is
        sent); logprobs: what it was drawn from (None where the request did not ask)."""
        request, reply = row.request, self.replies[row.id]
        row.taken.append(token)
        self.stats["generated_tokens"] += 1
        if token in self.eos:
            return "stop", True
        if request.logprobs is not None:
            reply.items.append(logprob_item(self.tokenizer, logprobs, token, request.logprobs))
        text, stopped = reply.text.add(token)
        if text:
            reply.ticket.events.put(TextEvent(text, len(row.taken), tuple(reply.items)))
            reply.items = []
        if stopped:
            return "stop", False  # whatever follows a stop string is never sent
        if len(row.taken) >= request.max_tokens:
            return "length", True
        return None, True

    def end(self, out: StepOutput, outcomes: List[Outcome]) -> List[Row]:
        """End the rows that finished; returns them (the others run on)."""
        ended = []
        for row, outcome in zip(out.rows, outcomes):
            if outcome.finish is None:
                continue
            ended.append(row)
            reply = self.replies.pop(row.id)
            if outcome.finish == "failed":
                # Leader-only work failed for this request: the pair is fine, and the
                # session ends on both ranks like an abandoned one.
                reply.ticket.events.put(FailedEvent(outcome.error))
                self.admission.close(row, None)
            else:
                self._complete(row, reply, outcome.finish, outcome.flush)
        return ended

    def _complete(self, row: Row, reply: Reply, finish: str, flush: bool) -> None:
        # The cache holds every token fed in: the prompt and all but the last sampled one, or
        # all of them when a pipelined step already took the last one in.
        fed = row.taken if row.fed_all else row.taken[:-1]
        self.admission.close(row, list(row.request.prompt) + fed)
        tail = reply.text.finish() if flush else ""
        if tail or reply.items:
            reply.ticket.events.put(TextEvent(tail, len(row.taken), tuple(reply.items)))
        reply.ticket.events.put(DoneEvent(finish, len(row.taken)))
