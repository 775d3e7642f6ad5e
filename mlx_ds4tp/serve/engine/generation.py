"""What the engine schedules: a request as the HTTP layer hands it over, the session the
engine keeps for it while it runs, and what a decode step produced for each of its rows."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from ...lockstep.batch import BatchRequest, Row, RowResult, StepOutput as BatchStep
from ...lockstep.sampling.options import SamplingOptions
from .events import EventQueue
from .text_stream import TextStream


@dataclasses.dataclass
class Request:
    """One generation as the HTTP layer hands it over; `events` receives TextEvents, then
    one that ends it: DoneEvent, FailedEvent when this request alone failed, PairDownEvent
    when the pair is down, BusyEvent when it was refused for want of KV room (serve.engine.events).
    `logprobs`: None, or how many most likely tokens each generated token's logprobs entry
    lists (a TextEvent's items: those entries, OpenAI's shape, for its tokens)."""

    prompt: List[int]
    max_tokens: int
    options: SamplingOptions = SamplingOptions()
    stop: List[str] = dataclasses.field(default_factory=list)
    events: EventQueue = dataclasses.field(default_factory=EventQueue)
    cached_tokens: int = 0
    completion_tokens: int = 0
    cancelled: bool = False
    logprobs: Optional[int] = None
    num_draft_tokens: Optional[int] = None  # drafts a round (None: the server's; 0: none)


def batch_request(request: Request, reuse, kv: int) -> BatchRequest:
    """The request as the leader's batch takes it, from stored prefix `reuse` with KV code `kv`."""
    return BatchRequest(tuple(request.prompt), request.max_tokens, request.options,
                        logprobs=request.logprobs is not None, num_draft_tokens=request.num_draft_tokens,
                        reuse=reuse, kv=kv)


def reserved_tokens(request: Request) -> int:
    """The cache tokens a request may come to hold: its prompt and every token it may generate."""
    return len(request.prompt) + request.max_tokens


class RunningSession:
    """A request the engine has started: its row of the leader's batch (lockstep.batch.Row:
    the prompt still to prefill, the sampler, the drafter), what it generated and its text."""

    def __init__(self, row: Row, request: Request, tokenizer):
        self.row = row
        self.sid = row.id
        self.request = request
        self.generated: List[int] = []  # the tokens taken (Finishing), up to its end
        self.text = TextStream(tokenizer.detokenizer, request.stop)
        self.items: List[dict] = []  # logprobs entries not sent yet
        self.reserved = reserved_tokens(request)

    @property
    def todo(self) -> List[int]:
        """Prompt tokens still to prefill."""
        return self.row.todo

    @property
    def fed_all(self) -> bool:
        """Whether its cache holds every token it generated (lockstep.batch.Row.fed_all)."""
        return self.row.fed_all


def cancelled_out(sessions: List[RunningSession]) -> Tuple[List[RunningSession], List[RunningSession]]:
    """(the sessions that go on, those whose requests were cancelled): each request's flag read
    once, since the HTTP face may set it meanwhile."""
    cancelled = [s for s in sessions if s.request.cancelled]
    return [s for s in sessions if s not in cancelled], cancelled


@dataclasses.dataclass
class StepOutput:
    """A decode step's rows (the sessions) and what it produced for each (lockstep.batch's
    RowResult); `step`: the batch's own output, which commit() takes back."""

    rows: List[RunningSession]
    results: List[RowResult]
    verify: bool = False  # a VERIFY_BATCH: the positions the rows did not use go before any ends
    step: Optional[BatchStep] = None
