"""A request's events, as the engine's one thread hands them to the HTTP face's event loop:
put from the engine thread (a queue.Queue, so the engine and the tests use it as one), awaited
on the loop without a thread per waiting request."""

from __future__ import annotations

import asyncio
import queue
from typing import Optional, Tuple


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

    def poll(self) -> Optional[tuple]:
        """The next event if one is there, else None (events are never None)."""
        try:
            return self.get_nowait()
        except queue.Empty:
            return None

    async def next(self, timeout: float) -> Optional[tuple]:
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
