"""Streamed answers as server-sent events: a dialect's events (serve/dialects/answer.py's
SseEvent) framed into the bytes of the stream, an error once the stream is open sent as the
dialect's error event."""

from __future__ import annotations

import json
from typing import AsyncIterator

from ...base.log import log
from ..dialects.answer import Answering, Piece, SseEvent
from ..errors import ApiError


def frame(event: SseEvent) -> bytes:
    """One event as the stream carries it; data None is an SSE comment (clients skip it; proxies
    and timeouts see the stream alive)."""
    if event.data is None:
        return b": keep-alive\n\n"
    data = event.data if isinstance(event.data, str) else json.dumps(event.data)
    return ((f"event: {event.name}\n" if event.name else "") + f"data: {data}\n\n").encode()


async def stream_bytes(answering: Answering, first: Piece, pieces: AsyncIterator[Piece],
                       path: str) -> AsyncIterator[bytes]:
    """The stream's bytes, one write per piece, from the answer's first piece (already read: the
    status line waited for it) and the rest. The status line is out: an ApiError ends the stream
    with the dialect's error event; a fault of ours ends it short (no [DONE]), logged."""

    async def all_pieces() -> AsyncIterator[Piece]:
        yield first
        async for piece in pieces:
            yield piece

    try:
        async for events in answering.events(all_pieces()):
            data = b"".join(frame(e) for e in events)
            if data:
                yield data
    except ApiError as err:
        yield frame(answering.error_event(err))
    except Exception as exc:  # noqa: BLE001 - logged: the client sees the stream end short
        log(f"serve: a streamed answer to {path} failed: {type(exc).__name__}: {exc}")


async def failed_stream(answering: Answering, err: ApiError) -> AsyncIterator[bytes]:
    """The stream of an answer that failed before its first piece: only its error event."""
    yield frame(answering.error_event(err))
