"""Streamed answers as server-sent events: the framing, and a stream's life (opened on the
answer's first event, an error after that sent as an event, a client gone cancels the request)."""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Dict, Iterator

from .connection import Connection
from .errors import ApiError, ClientGone
from .requests import Request


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


def stream_answer(conn: Connection, request: Request, pieces: Iterator[tuple],
                  write_events: Callable[[Iterator[tuple], EventStream], None],
                  write_error: Callable[[EventStream, ApiError], None]) -> None:
    """Stream the answer's `pieces` (serve/answer.py) through write_events; write_error
    frames an error that comes once the stream is open (each API has its own). An error
    before that is raised: the status line waits for the first event, so a pair that is
    already down is a plain 503, like a request that does not stream."""
    try:
        first = next(pieces)
    except ClientGone:
        return
    conn.start_events()
    stream = EventStream(conn.write)
    try:
        write_events(itertools.chain([first], pieces), stream)
    except ApiError as err:
        # The status line is already out: the error travels as an event.
        try:
            write_error(stream, err)
        except OSError:
            pass
    except (OSError, ClientGone):
        # The client went away (broken pipe, reset, closed): the engine frees its
        # session on both ranks at its next step.
        request.cancelled = True
