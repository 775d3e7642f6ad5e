"""What the engine schedules: a request as the HTTP layer hands it over, the session the
engine keeps for it while it runs, and what a decode step produced for each of its rows."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import mlx.core as mx

from ..lockstep.prompt_cache import Reuse
from ..lockstep.row_sampling import RowSampler
from ..lockstep.sampling import SamplingOptions
from .events import EventQueue
from .text_stream import TextStream


@dataclasses.dataclass
class Request:
    """One generation as the HTTP layer hands it over; `events` receives ("text", str, items),
    then ("done", finish_reason), ("failed", message) when this request alone failed, or
    ("error", message) when the pair is down. `logprobs`: None, or how many most likely
    tokens each generated token's logprobs entry lists (items: those entries, OpenAI's shape,
    for the tokens since the last text event)."""

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


def reserved_tokens(request: Request) -> int:
    """The cache tokens a request may come to hold: its prompt and every token it may generate."""
    return len(request.prompt) + request.max_tokens


class RunningSession:
    """A request the engine has started: its cache's tokens still to prefill, its next input,
    what it generated, its sampler and its text."""

    def __init__(self, sid: int, request: Request, reuse: Reuse, tokenizer):
        self.sid = sid
        self.request = request
        self.todo = request.prompt[reuse.keep : -1]
        self.next_input = request.prompt[-1]
        self.generated: List[int] = []
        self.sampler: Optional[RowSampler] = None  # set by the engine as the session starts
        self.text = TextStream(tokenizer.detokenizer, request.stop)
        self.items: List[dict] = []  # logprobs entries not sent yet
        self.reserved = reserved_tokens(request)
        self.drafter = None  # set when this session drafts (serve.speculation)
        # Pipelined decode: True while the step last sent takes in this session's token of the
        # step before (EVAL_PENDING): when that token is read, it is in the cache already, so
        # an ended session's cache holds every token generated. A token read before the next
        # step is sent (DecodeStepper.read_ahead) is not, and goes in as the next step's own input.
        self.fed_all = False


def cancelled_out(sessions: List[RunningSession]) -> Tuple[List[RunningSession], List[RunningSession]]:
    """(the sessions that go on, those whose requests were cancelled): each request's flag read
    once, since the HTTP face may set it meanwhile."""
    cancelled = [s for s in sessions if s.request.cancelled]
    return [s for s in sessions if s not in cancelled], cancelled


@dataclasses.dataclass
class RowResult:
    """What a decode step produced for one row: its new tokens (None: its sampling failed, for
    `error`), the log-probabilities its token was drawn from (where the request asked), or,
    for a prompt row of a mixed step, the `chunk` prompt tokens it took in and no token."""

    tokens: Optional[List[int]]
    error: str = ""
    logprobs: Optional[mx.array] = None
    chunk: int = 0


@dataclasses.dataclass
class StepOutput:
    """A decode step's rows and what it produced for each; `verify`: a VERIFY_BATCH, whose
    positions the rows did not use must be dropped (COMMIT_BATCH) before any session ends."""

    rows: List[RunningSession]
    results: List[RowResult]
    verify: bool = False
