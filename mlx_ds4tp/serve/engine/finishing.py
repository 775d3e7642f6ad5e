"""What becomes of a step's tokens: each into its session (text out, logprobs, the finish
reason: an eos, a stop string, max_tokens, a cancel), then the sessions that finished ended on
both ranks, a completed one's cache stored for reuse (serve.engine.admission). Every kind of step
(pipelined, stepped, verified, mixed) ends here alike, from what it returned (StepOutput)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import mlx.core as mx

from ...lockstep.sampling.options import logprob_item
from .admission import Admission
from .events import DoneEvent, FailedEvent, TextEvent
from .generation import RowResult, RunningSession, StepOutput


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
        self.stats = {"generated_tokens": 0}

    def advance(self, out: StepOutput) -> List[Outcome]:
        """Each row's new tokens into its session, in order, until one ends it."""
        return [self._row(session, result) for session, result in zip(out.rows, out.results)]

    def _row(self, session: RunningSession, result: RowResult) -> Outcome:
        if result.chunk:  # a prompt chunk: all its positions kept, no token yet
            return Outcome("cancelled", False, result.chunk) if session.request.cancelled \
                else Outcome(None, True, result.chunk)
        if result.tokens is None:
            return Outcome("failed", False, 1, result.error)
        outcome = Outcome(None, True, 0)
        for token in result.tokens:
            outcome.used += 1
            try:
                outcome.finish, outcome.flush = self.take_token(session, token, result.logprobs)
            except Exception as exc:  # noqa: BLE001 - this request's text, reported to it alone
                outcome.finish, outcome.flush, outcome.error = "failed", False, f"{type(exc).__name__}: {exc}"
            if outcome.finish is not None:
                break
        return outcome

    def take_token(self, session: RunningSession, token: int, logprobs: Optional[mx.array]) -> tuple:
        """Take a session's new token: (finish reason or None, whether held text is sent);
        logprobs: what it was drawn from (None where the request did not ask)."""
        request = session.request
        session.generated.append(token)
        request.completion_tokens += 1
        self.stats["generated_tokens"] += 1
        if token in self.eos:
            return "stop", True
        if request.logprobs is not None:
            session.items.append(logprob_item(self.tokenizer, logprobs, token, request.logprobs))
        text, stopped = session.text.add(token)
        if text:
            request.events.put(TextEvent(text, tuple(session.items)))
            session.items = []
        if stopped:
            return "stop", False  # whatever follows a stop string is never sent
        if len(session.generated) >= request.max_tokens:
            return "length", True
        if request.cancelled:
            return "cancelled", False
        return None, True

    def end(self, out: StepOutput, outcomes: List[Outcome]) -> List[RunningSession]:
        """End the rows that finished; returns them (the others run on)."""
        ended = []
        for session, outcome in zip(out.rows, outcomes):
            if outcome.finish is None:
                continue
            ended.append(session)
            if outcome.finish == "failed":
                # Leader-only work failed for this request: the pair is fine, and the
                # session ends on both ranks like an abandoned one.
                session.request.events.put(FailedEvent(outcome.error))
                self.admission.close(session, None)
            elif outcome.finish == "cancelled":
                self.admission.close(session, None)
            else:
                self._complete(session, outcome.finish, outcome.flush)
        return ended

    def _complete(self, session: RunningSession, finish: str, flush: bool) -> None:
        request = session.request
        # The cache holds every token fed in: the prompt and all but the last sampled one, or
        # all of them when a pipelined step already took the last one in.
        fed = session.generated if session.fed_all else session.generated[:-1]
        self.admission.close(session, request.prompt + fed)
        tail = session.text.finish() if flush else ""
        if tail or session.items:
            request.events.put(TextEvent(tail, tuple(session.items)))
        request.events.put(DoneEvent(finish))
