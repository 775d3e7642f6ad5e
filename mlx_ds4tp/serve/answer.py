"""One request's answer as the engine produces it: its events (text gathered, keep-alives,
the pair's failure as an ApiError), and the whole answer of a request that does not stream."""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from .chat import ChatText
from .connection import Connection
from .errors import ApiError, ClientGone, unavailable
from .metrics import TokenClock
from .requests import Request
from .state import ServeState

# How often a request waiting for its next token checks that the engine is still alive. The
# engine itself never waits on the worker past the gate timeout: it fails the pair instead,
# and every waiting request gets the reason.
EVENT_POLL_SEC = 1.0
# How often a request being answered looks whether its client is still connected.
CLIENT_CHECK_SEC = 0.5


def answer_events(request: Request, state: ServeState, client_gone: Callable[[], bool]) -> Iterator[tuple]:
    """The request's events until done, with ("idle", None) after keepalive_sec of silence;
    ApiError(503) when the pair fails. Text that piled up while this thread waited for the
    interpreter goes out as one event: fewer writes, and less time holding the lock the
    engine thread needs for the next step."""
    text: list = []
    items: list = []
    clock, counted = TokenClock(state.metrics), 0
    checked = last = time.monotonic()
    keepalive = state.http.keepalive_sec
    poll = min(EVENT_POLL_SEC, keepalive)
    while True:
        if time.monotonic() - checked > CLIENT_CHECK_SEC:
            checked = time.monotonic()
            if client_gone():
                # Nobody will read the answer: free the session on both ranks.
                request.cancelled = True
                raise ClientGone()
        try:
            event = request.events.get_nowait() if text else request.events.get(timeout=poll)
        except queue.Empty:
            if text:
                yield ("text", "".join(text), items)
                text, items = [], []
                last = time.monotonic()
            elif not state.engine.alive():
                request.cancelled = True
                raise unavailable(state.engine.error or "the engine thread stopped") from None
            elif time.monotonic() - last >= keepalive:
                last = time.monotonic()
                yield ("idle", None)
            continue
        last = time.monotonic()
        if event[0] == "error":
            raise unavailable(event[1])
        if event[0] == "busy":
            raise ApiError(429, event[1], None, "server_busy", "rate_limit_error")
        if event[0] == "failed":
            raise ApiError(500, f"generating this answer failed ({event[1]}); the server goes on "
                           "serving", None, "generation_failed", "server_error")
        if event[0] == "text":
            text.append(event[1])
            items.extend(event[2])
            clock.tokens(request.completion_tokens - counted)
            counted = request.completion_tokens
            continue
        if event[0] == "done":
            state.metrics.finished(len(request.prompt), request.completion_tokens, request.cached_tokens)
        if text:
            yield ("text", "".join(text), items)
            text, items = [], []
        yield event
        if event[0] == "done":
            return


@dataclasses.dataclass
class Answer:
    """A whole answer: its text (content), reasoning, tool calls, logprobs entries (None: not
    asked for) and finish reason."""

    text: str
    reasoning: str
    calls: List[dict]
    items: Optional[list]
    finish: str


def _collect(chat: Optional[ChatText], events: Iterator[tuple], request: Request) -> Answer:
    parts, items, finish = [], [], "stop"
    reasoning, calls = [], []

    def take(pieces: Dict[str, Any]) -> None:
        parts.append(pieces["content"])
        reasoning.append(pieces["reasoning"])
        calls.extend(pieces["tool_calls"])

    for event in events:
        if event[0] == "text":
            items.extend(event[2])
            if chat is None:
                parts.append(event[1])
            else:
                take(chat.add(event[1]))
        elif event[0] == "done":
            finish = event[1]
    if chat is not None:
        take(chat.finish(finish))
        if chat.made_tool_call and finish == "stop":
            finish = "tool_calls"
    return Answer("".join(parts), "".join(reasoning), calls,
                  items if request.logprobs is not None else None, finish)


def send_whole(conn: Connection, request: Request, chat: Optional[ChatText], events: Iterator[tuple],
               body: Callable[[Answer], Dict[str, Any]]) -> None:
    """The answer of a request that does not stream, once the engine is done with it: `body`
    (each API's shape of the Answer) with 200, or the error; nothing when the client left.
    chat: the answer's text is split into content, reasoning and tool calls (None: plain text)."""
    try:
        answer = _collect(chat, events, request)
    except ApiError as err:
        conn.send_api_error(err)
        return
    except ClientGone:
        return
    conn.send_json(200, body(answer))
