"""One stage of a part's transfer run beside the caller: its items handed to a thread through a
queue of at most `depth` items, so reading and cutting the next arrays overlaps their send on
the leader, and receiving the next chunk over the RDMA bulk path overlaps writing and hashing
the last on a worker (sockets, exchanges, file writes, the digest and MLX all release the GIL),
while neither side holds more than a few chunks it has not dealt with; and the pool of chunk
buffers those stages pass along and hand back."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Tuple, Union

_DONE = object()


class Overlap:
    """put(item) hands item to `stage` on the stage's thread (waiting while `depth` items are
    queued); finish() waits for every item and re-raises the first error the stage met, which
    put also raises as soon as it is known. Use it as a context manager: leaving it early (an
    error of the caller's) stops the thread without waiting for the queue."""

    def __init__(self, stage: Callable[[Any], None], depth: int = 4, name: str = "ds4tp-overlap"):
        self.stage = stage
        self.items: "queue.Queue[Any]" = queue.Queue(maxsize=depth)
        self.error: Optional[BaseException] = None
        self.abandoned = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.items.get()
            if item is _DONE:
                return
            if self.error is not None or self.abandoned:
                continue  # drained without work, so the caller's put never waits on a dead stage
            try:
                self.stage(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self.error = exc

    def put(self, item: Any) -> None:
        if self.error is not None:
            raise self.error
        self.items.put(item)

    def finish(self) -> None:
        self.items.put(_DONE)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def __enter__(self) -> "Overlap":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.abandoned = True
            self.items.put(_DONE)
            self.thread.join()


class BufferPool:
    """`count` buffers of `size` bytes passed along a transfer's stages and handed back at the
    end, so a part moves with no allocation a chunk and a bounded few chunks in memory. take()
    waits for one while the stages are behind, and raises a stage's error (of `stages`) instead
    of waiting on a stage that died holding the buffers."""

    def __init__(self, size: int, count: int):
        self.free: "queue.Queue[bytearray]" = queue.Queue()
        for _ in range(count):
            self.free.put(bytearray(size))
        self.stages: Tuple[Overlap, ...] = ()

    def take(self) -> bytearray:
        while True:
            try:
                return self.free.get(timeout=1.0)
            except queue.Empty:
                for stage in self.stages:
                    if stage.error is not None:
                        raise stage.error from None

    def give_back(self, buffer: Union[bytearray, memoryview]) -> None:
        """`buffer`, or the buffer a view of it is of, free again."""
        self.free.put(buffer.obj if isinstance(buffer, memoryview) else buffer)


__all__ = ["BufferPool", "Overlap"]
