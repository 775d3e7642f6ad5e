"""A request's events, as the engine's one thread hands them to the HTTP face's event loop:
what happened (one frozen type per kind, matched by type), and the queue they travel in, put
from the engine thread (a queue.Queue, so the engine and the tests use it as one), awaited on
the loop without a thread per waiting request."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
from typing import Optional, Tuple, Union


@dataclasses.dataclass(frozen=True)
class StartedEvent:
    """The engine started the request (it had room in the KV budget): the prompt tokens it
    reuses from a stored prompt cache. The first event of a request that starts."""

    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class TextEvent:
    """Text the request generated, the tokens it generated so far in all (text or not), and
    the logprobs entries (OpenAI's shape) of its tokens since the last text event (empty
    unless logprobs were asked for)."""

    text: str
    completion_tokens: int
    items: tuple = ()


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    """The request ended as asked: "stop" (EOS or a stop string) or "length", after generating
    completion_tokens tokens; the last event."""

    finish: str
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class FailedEvent:
    """This request alone failed (its cause, perhaps with a state dump after the first line);
    the server goes on serving the others. The last event."""

    cause: str


@dataclasses.dataclass(frozen=True)
class PairDownEvent:
    """The pair is down (the worker gone, a gate failed): every request under way ends with
    this. The last event."""

    cause: str


@dataclasses.dataclass(frozen=True)
class BusyEvent:
    """The request was refused before it started: too many already wait for KV room. The last
    event."""

    reason: str


EngineEvent = Union[StartedEvent, TextEvent, DoneEvent, FailedEvent, PairDownEvent, BusyEvent]
ENDING_EVENTS = (DoneEvent, FailedEvent, PairDownEvent, BusyEvent)


class EventQueue(queue.Queue):
    """queue.Queue whose puts also wake the coroutine awaiting `next` (at most one: the answer
    being written for this request)."""

    def __init__(self) -> None:
        super().__init__()
        self._waiter: Optional[Tuple[asyncio.AbstractEventLoop, asyncio.Event]] = None

    def _put(self, item) -> None:  # under the queue's lock, in the putting thread
        super()._put(item)
        waiter = self._waiter
        if waiter is not None:
            try:
                waiter[0].call_soon_threadsafe(waiter[1].set)
            except RuntimeError:
                pass  # the loop has closed (the server stopped): nobody waits any more

    def poll(self) -> Optional[EngineEvent]:
        """The next event if one is there, else None (events are never None)."""
        try:
            return self.get_nowait()
        except queue.Empty:
            return None

    async def next(self, timeout: float) -> Optional[EngineEvent]:
        """The next event, or None when none came within `timeout` seconds."""
        woken = asyncio.Event()
        self._waiter = (asyncio.get_running_loop(), woken)
        try:
            # Looked for once the waiter is registered: a put before it is seen here, one after wakes it.
            event = self.poll()
            if event is not None:
                return event
            try:
                await asyncio.wait_for(woken.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        finally:
            self._waiter = None
        return self.poll()
