"""Streamed answers as server-sent events: the framing, and a stream's life (opened on the
answer's first event, an error after that sent as an event, a client gone cancels the request)."""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Optional

from ..connection import Connection
from ..dialects.answer import answer_pieces
from ..dialects.chat import ChatText
from ..errors import GENERATION_FAILED, ApiError, ClientGone
from ..generation import Request
from ..state import ServeState


class EventStream:
    """One answer's events, written once the status line is out."""

    def __init__(self, write: Callable[[bytes], None]):
        self.write = write

    def data(self, obj: Dict[str, Any]) -> None:
        self.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def event(self, name: str, obj: Dict[str, Any]) -> None:
        self.write(f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode())

    def keep_alive(self) -> None:
        # An SSE comment: clients skip it; proxies and timeouts see the stream alive.
        self.write(b": keep-alive\n\n")


async def stream_answer(conn: Connection, state: ServeState, request: Request, chat: Optional[ChatText],
                        write_events: Callable[[AsyncIterator[tuple], EventStream], Awaitable[None]],
                        write_error: Callable[[EventStream, ApiError], None]) -> None:
    """Stream the answer's pieces (serve/dialects/answer.py) through write_events; write_error frames an error
    once the stream is open (each API has its own). One before is raised: the status line waits for
    the first piece, so a pair that is already down is a plain 503, as for an answer not streamed."""
    pieces = answer_pieces(conn, state, request, chat)
    try:
        first = await pieces.__anext__()
    except ClientGone:
        return
    except ApiError as err:
        if err.code != GENERATION_FAILED:
            raise  # the pair down (503), the queue full (429): a status the client retries on
        # This request's own sampling or grammar failed on its first token: the stream opens
        # and ends with the error event naming the cause, as it would on any later token.
        await conn.start_events()
        with contextlib.suppress(OSError):
            write_error(EventStream(conn.write), err)
        return
    await conn.start_events()
    stream = EventStream(conn.write)

    async def all_pieces() -> AsyncIterator[tuple]:
        yield first
        async for piece in pieces:
            yield piece

    try:
        await write_events(all_pieces(), stream)
    except ApiError as err:
        # The status line is already out: the error travels as an event.
        with contextlib.suppress(OSError):
            write_error(stream, err)
    except (OSError, ClientGone):
        # The client went away (broken pipe, reset, closed): the engine frees its
        # session on both ranks at its next step.
        request.cancelled = True
