"""One request's answer as the engine produces it: its pieces (text gathered, keep-alives, the
pair's failure as an ApiError), and the whole answer of a request that does not stream."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from ..connection import Connection
from ..errors import GENERATION_FAILED, ApiError, ClientGone, unavailable
from ..generation import Request
from ..http.metrics import TokenClock
from ..state import ServeState
from .chat import ChatText

# How often a request waiting for its next token checks that the engine is still alive. The
# engine itself never waits on the worker past the gate timeout: it fails the pair instead,
# and every waiting request gets the reason.
EVENT_POLL_SEC = 1.0


async def answer_pieces(conn: Connection, state: ServeState, request: Request,
                        chat: Optional[ChatText]) -> AsyncIterator[tuple]:
    """The answer as the engine produces it, in pieces ({"content", "reasoning", "tool_calls"},
    split by `chat`; plain text when None): ("text", pieces, logprobs entries), ("idle", None,
    None) after keepalive_sec of silence, and last ("done", pieces, finish reason), where "stop"
    after a tool call is "tool_calls"; ApiError(503) when the pair fails. Text that piled up
    while the event loop was busy goes out as one piece: fewer writes. A client gone (the
    connection says so, or the answer's task is cancelled because the stack saw it close)
    cancels the request: the engine frees its row at its next turn."""
    text, items = [], []
    clock, counted = TokenClock(state.metrics), 0
    last = time.monotonic()
    keepalive = state.http.keepalive_sec
    poll = min(EVENT_POLL_SEC, keepalive)

    def text_piece() -> tuple:
        return "text", chat.add("".join(text)) if chat else _plain("".join(text)), items

    try:
        while True:
            if conn.client_gone():
                raise ClientGone()
            event = request.events.poll() if text else await request.events.next(poll)
            if event is None:
                if text:
                    yield text_piece()
                    text, items = [], []
                    last = time.monotonic()
                elif not state.engine.alive():
                    request.cancelled = True
                    raise unavailable(state.engine.error or "the engine thread stopped") from None
                elif time.monotonic() - last >= keepalive:
                    last = time.monotonic()
                    yield "idle", None, None
                continue
            last = time.monotonic()
            _raise_if_failed(event)
            if event[0] == "text":
                text.append(event[1])
                items.extend(event[2])
                clock.tokens(request.completion_tokens - counted)
                counted = request.completion_tokens
                continue
            # "done", the last event there is.
            state.metrics.finished(len(request.prompt), request.completion_tokens, request.cached_tokens)
            if text:
                yield text_piece()
            pieces = chat.finish(event[1]) if chat else _plain("")
            called = chat is not None and chat.made_tool_call and event[1] == "stop"
            yield "done", pieces, "tool_calls" if called else event[1]
            return
    except (ClientGone, asyncio.CancelledError, GeneratorExit):
        # Nobody will read the rest of the answer: free the session on both ranks.
        request.cancelled = True
        raise


def _raise_if_failed(event: tuple) -> None:
    """The ApiError of an event that ends the answer short: the pair down, the queue full, this
    request's own failure (its cause in one line)."""
    if event[0] == "error":
        raise unavailable(event[1])
    if event[0] == "busy":
        raise ApiError(429, event[1], None, "server_busy", "rate_limit_error")
    if event[0] == "failed":
        raise ApiError(500, f"generating this answer failed ({_one_line(event[1])}); the server goes "
                       "on serving", None, GENERATION_FAILED, "server_error")


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


async def send_whole(conn: Connection, state: ServeState, request: Request, chat: Optional[ChatText],
                     body: Callable[[Answer], Dict[str, Any]]) -> None:
    """The answer of a request that does not stream, once the engine is done with it: `body`
    (each API's shape of the Answer) with 200; nothing when the client left; ApiError raised."""
    text, reasoning, calls, items, finish = [], [], [], [], "stop"
    try:
        async for kind, piece, extra in answer_pieces(conn, state, request, chat):
            if kind != "idle":
                text.append(piece["content"])
                reasoning.append(piece["reasoning"])
                calls.extend(piece["tool_calls"])
                if kind == "text":
                    items.extend(extra)
                else:
                    finish = extra
    except ClientGone:
        return
    await conn.send_json(200, body(Answer("".join(text), "".join(reasoning), calls,
                                          items if request.logprobs is not None else None, finish)))
