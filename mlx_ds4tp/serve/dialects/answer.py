"""One request's answer as the engine produces it, in what every dialect renders: its pieces
(text gathered, keep-alives, the pair's failure as an ApiError), the whole answer of a request
that does not stream, and the server-sent events a dialect writes for a streamed one (the HTTP
face frames and sends them: serve/http/sse.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Protocol

from ..engine.events import BusyEvent, DoneEvent, EngineEvent, FailedEvent, PairDownEvent, StartedEvent, TextEvent
from ..engine.generation import Ticket
from ..errors import GENERATION_FAILED, ApiError, unavailable
from ..http.metrics import TokenClock
from ..state import ServeState
from .chat import ChatText

# How often a request waiting for its next token checks that the engine is still alive. The
# engine itself never waits on the worker past the gate timeout: it fails the pair instead,
# and every waiting request gets the reason.
EVENT_POLL_SEC = 1.0


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of an answer as a dialect renders it: `said` ({"content", "reasoning",
    "tool_calls"}, split by the request's ChatText; plain text without one), the logprobs
    entries of its tokens, and on the last piece the finish reason ("" before)."""

    said: Dict[str, Any]
    items: List[dict] = dataclasses.field(default_factory=list)
    finish: str = ""


# What answer_pieces yields after keepalive_sec of silence: a dialect writes its keep-alive.
IDLE = Piece({"content": "", "reasoning": "", "tool_calls": []})


@dataclasses.dataclass(frozen=True)
class SseEvent:
    """One server-sent event a dialect writes: `data` (an object, or a string such as "[DONE]")
    under the event `name` (None: a data-only event); data None is a keep-alive comment."""

    data: Any
    name: Optional[str] = None


KEEP_ALIVE = SseEvent(None)


@dataclasses.dataclass
class Usage:
    """A request's token counts as its answer reports them: its prompt's, and what the engine's
    events said of the rest (StartedEvent: the reused prompt tokens; TextEvent, DoneEvent: the
    tokens generated). Written by answer_pieces on the event loop only."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


class Answering(Protocol):
    """A dialect's answer to one submitted request: the whole answer's body, or the events of a
    stream (a list for each piece, written at once), and an error once the stream is open."""

    chat: Optional[ChatText]
    usage: Usage

    def whole(self, answer: "Answer") -> Dict[str, Any]: ...
    def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[List[SseEvent]]: ...
    def error_event(self, err: ApiError) -> SseEvent: ...


async def answer_pieces(state: ServeState, ticket: Ticket, chat: Optional[ChatText],
                        usage: Usage) -> AsyncIterator[Piece]:
    """The answer as the engine produces it, in Pieces: text as it comes, IDLE after
    keepalive_sec of silence, and last the piece with the finish reason, where "stop" after a
    tool call is "tool_calls"; ApiError(503) when the pair fails. Text that piled up while the
    event loop was busy goes out as one piece: fewer writes. `usage` follows the events. A
    client gone (the HTTP face cancels the task reading this, or closes it) cancels the
    request (Engine.cancel): the engine frees its row at its next turn."""
    events = ticket.events
    text, items = [], []
    clock, counted = TokenClock(state.metrics), 0
    last = time.monotonic()
    keepalive = state.http.keepalive_sec
    poll = min(EVENT_POLL_SEC, keepalive)

    def text_piece() -> Piece:
        return Piece(chat.add("".join(text)) if chat else _plain("".join(text)), items)

    try:
        while True:
            event = events.poll() if text else await events.next(poll)
            if event is None:
                if text:
                    yield text_piece()
                    text, items = [], []
                    last = time.monotonic()
                elif not state.engine.alive():
                    state.engine.cancel(ticket.id)
                    raise unavailable(state.engine.error or "the engine thread stopped") from None
                elif time.monotonic() - last >= keepalive:
                    last = time.monotonic()
                    yield IDLE
                continue
            last = time.monotonic()
            if isinstance(event, StartedEvent):
                usage.cached_tokens = event.cached_tokens
                continue
            if isinstance(event, TextEvent):
                text.append(event.text)
                items.extend(event.items)
                usage.completion_tokens = event.completion_tokens
                clock.tokens(usage.completion_tokens - counted)
                counted = usage.completion_tokens
                continue
            finish = _finish_reason(event)  # the last event there is
            usage.completion_tokens = event.completion_tokens
            state.metrics.finished(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
            if text:
                yield text_piece()
            # The end's text first: a format whose call ends at EOS (Mistral's [TOOL_CALLS]) has
            # its call read only there.
            said = chat.finish(finish) if chat else _plain("")
            called = chat is not None and chat.made_tool_call and finish == "stop"
            yield Piece(said, [], "tool_calls" if called else finish)
            return
    except (asyncio.CancelledError, GeneratorExit):
        # Nobody will read the rest of the answer: free the session on both ranks.
        state.engine.cancel(ticket.id)
        raise


def _finish_reason(event: EngineEvent) -> str:
    """The finish reason of the event that ends an answer; the ApiError of one that ends it
    short: the pair down, the queue full, this request's own failure (its cause in one line)."""
    if isinstance(event, DoneEvent):
        return event.finish
    if isinstance(event, PairDownEvent):
        raise unavailable(event.cause)
    if isinstance(event, BusyEvent):
        raise ApiError(429, event.reason, None, "server_busy", "rate_limit_error")
    if isinstance(event, FailedEvent):
        raise ApiError(500, f"generating this answer failed ({_one_line(event.cause)}); the server goes "
                       "on serving", None, GENERATION_FAILED, "server_error")
    raise TypeError(f"not an engine event: {event!r}")


def _one_line(cause: str, limit: int = 300) -> str:
    """A failure's cause as the client sees it: its first line (no engine state dump), bounded."""
    line = str(cause).strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit] + "..."


def _plain(text: str) -> Dict[str, Any]:
    return {"content": text, "reasoning": "", "tool_calls": []}


@dataclasses.dataclass
class Answer:
    """A whole answer (items: its logprobs entries, None when not asked for)."""

    text: str
    reasoning: str
    calls: List[dict]
    items: Optional[list]
    finish: str


async def whole_answer(state: ServeState, ticket: Ticket, chat: Optional[ChatText], usage: Usage) -> Answer:
    """The answer of a request that does not stream, once the engine is done with it; ApiError
    raised."""
    text, reasoning, calls, items, finish = [], [], [], [], "stop"
    async for piece in answer_pieces(state, ticket, chat, usage):
        text.append(piece.said["content"])
        reasoning.append(piece.said["reasoning"])
        calls.extend(piece.said["tool_calls"])
        items.extend(piece.items)
        finish = piece.finish or finish
    return Answer("".join(text), "".join(reasoning), calls, items if ticket.request.logprobs is not None else None,
                  finish)
