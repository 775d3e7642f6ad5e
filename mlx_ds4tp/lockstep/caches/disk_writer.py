"""The background writer of one rank's prompt-cache files (lockstep.caches.disk_cache's write-through):
one thread writes them in the order they were handed over, off the path of the engine and of
the worker's command loop. The owner may wait for one file (a load about to read it), for all
of them (a stop), or close the writer. The jobs hold NumPy views, never MLX calls
(lockstep.caches.cache_file says why)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from ...base.log import log

# Files handed over and not written yet, at most: past them the owner waits for the writer
# (a disk far slower than the stores), so the views it holds stay bounded.
MAX_PENDING = 16


class DiskWriter:
    """Jobs (a name and what `write` takes) written one at a time by a thread of their own,
    started with the first job; see the module docstring."""

    def __init__(self, write: Callable[[str, Any], None], max_pending: int = MAX_PENDING):
        if max_pending < 1:
            raise ValueError(f"max_pending {max_pending} must be >= 1")
        self._write = write
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self._queue: "collections.deque[Tuple[str, Any]]" = collections.deque()
        self._busy: Optional[Tuple[str, Any]] = None  # the job being written
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def put(self, name: str, job: Any, timeout: float) -> bool:
        """Queue a job; False when the writer is closed, or still has max_pending jobs after
        `timeout` seconds."""
        with self._cond:
            if not self._wait(lambda: self._closed or len(self._queue) < self.max_pending, timeout):
                return False
            if self._closed:
                return False
            self._queue.append((name, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ds4tp-disk-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def jobs(self) -> List[Tuple[str, Any]]:
        """The jobs not written yet (the one being written first)."""
        with self._cond:
            return ([self._busy] if self._busy else []) + list(self._queue)

    def pending(self, name: str) -> bool:
        """Whether a job of this name is queued or being written."""
        return any(n == name for n, _ in self.jobs())

    def wait_for(self, name: str, timeout: float) -> bool:
        """Until no job of this name is left; False when `timeout` passed first."""
        with self._cond:
            return self._wait(lambda: not self._has(name), timeout)

    def flush(self, timeout: float) -> bool:
        """Until every job handed over is written; False when `timeout` passed first."""
        with self._cond:
            return self._wait(lambda: not self._queue and self._busy is None, timeout)

    def close(self, timeout: float) -> int:
        """Write what is left (for at most `timeout` seconds), then end the thread; the jobs
        left unwritten (0: all written)."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            left = len(self._queue) + (self._busy is not None)
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(timeout, 1.0) if left else timeout)
        return left

    def _has(self, name: str) -> bool:
        return (self._busy is not None and self._busy[0] == name) or any(n == name for n, _ in self._queue)

    def _wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                self._busy = self._queue.popleft()
            try:
                self._write(*self._busy)
            except Exception as exc:  # noqa: BLE001 - `write` reports its own failures; never end the thread
                log(f"prompt cache: writing {self._busy[0]} failed: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()


__all__ = ["DiskWriter", "MAX_PENDING"]
