"""A rank's part of a saved tensor as byte runs of its file, and the one reader of such runs.

A tensor of shape [A..., n, B...] cut along the n axis is, for each index of A... (a *row*), the
same few byte spans of that row: a vocabulary or output-feature cut (axis 0) is one row and one
span, a cut along the last axis a short span of every row. `TensorRuns` says which bytes; the
part is those bytes in order, row after row.

`RunsReader` lays parts end to end into buffers of a fixed size, so the same code reads a whole
part into one array (checkpoint/parts.py, the loader) and streams a worker's part files out in
equal chunks (split/part_send.py, the leader: the file's bytes go from the page cache into the
chunk that is hashed and sent, with no array library in between). Long spans are read straight
into the buffer (one pread each); short ones would be a syscall each (a cut of a 2048-wide row
keeps 2 KiB of it), so whole rows are read a couple of MiB at a time and the spans gathered.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

READ_CHUNK_BYTES = 2 << 20  # whole rows read per step when the spans are short
SEEK_MIN_BYTES = 16 << 10  # spans at least this long are read one by one


@dataclasses.dataclass(frozen=True)
class TensorRuns:
    """`rows` rows of `row_bytes` each from byte `start` of `file`, of each row the `spans`
    ((first byte in the row, bytes), in the order the part holds them)."""

    file: str
    start: int
    rows: int
    row_bytes: int
    spans: Tuple[Tuple[int, int], ...]

    @property
    def kept(self) -> int:
        """The bytes kept of one row."""
        return sum(width for _, width in self.spans)

    @property
    def nbytes(self) -> int:
        return self.rows * self.kept

    @property
    def seeks(self) -> bool:
        """Whether each span is read on its own (long spans, or one row), not gathered from rows."""
        return self.rows == 1 or min(width for _, width in self.spans) >= SEEK_MIN_BYTES


def tensor_runs(file: str, start: int, shape: Sequence[int], itemsize: int, axis: int,
                runs: Sequence[Tuple[int, int]]) -> TensorRuns:
    """The bytes of a tensor saved at byte `start` of `file` (its `shape`, `itemsize` bytes an
    element) that its [start, stop) `runs` of `axis` keep, in their order."""
    axis = axis % len(shape)
    rows = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64)) * itemsize
    spans = tuple((a * inner, (b - a) * inner) for a, b in runs)
    return TensorRuns(str(file), int(start), rows, int(shape[axis]) * inner, spans)


class RunsReader:
    """Parts (TensorRuns) and plain bytes laid end to end into buffers of `chunk` bytes that
    `buffer()` hands out: add() yields each buffer as it fills (a memoryview of all of it),
    flush() the last one's filled bytes. A caller holding a yielded buffer must be done with it
    before it hands that buffer out again."""

    def __init__(self, chunk: int, buffer: Callable[[], bytearray]):
        self.chunk, self.buffer = chunk, buffer
        self.current: Optional[memoryview] = None
        self.filled = 0
        self._files: Dict[str, int] = {}
        self._rows: Optional[np.ndarray] = None  # the scratch for short spans' whole rows

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> "RunsReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _room(self) -> memoryview:
        if self.current is None:
            self.current = memoryview(self.buffer()).cast("B")
            if len(self.current) < self.chunk:
                raise ValueError(f"a buffer of {len(self.current)} bytes for chunks of {self.chunk}")
            self.filled = 0
        return self.current[self.filled: self.chunk]

    def _full(self) -> Iterator[memoryview]:
        if self.filled == self.chunk:
            out, self.current = self.current[: self.chunk], None
            yield out

    def flush(self) -> Iterator[memoryview]:
        """The last buffer's filled bytes, if any."""
        if self.current is not None and self.filled:
            out, self.current = self.current[: self.filled], None
            yield out
        self.current = None

    def add_bytes(self, data: memoryview) -> Iterator[memoryview]:
        data = memoryview(data).cast("B")
        while len(data):
            room = self._room()
            n = min(len(room), len(data))
            room[:n] = data[:n]
            self.filled += n
            data = data[n:]
            yield from self._full()

    def add(self, runs: TensorRuns) -> Iterator[memoryview]:
        """The part `runs` keeps, read into the buffers."""
        if runs.nbytes == 0:
            return
        fd = self._fd(runs.file)
        if runs.seeks:
            for row in range(runs.rows):
                base = runs.start + row * runs.row_bytes
                for lo, width in runs.spans:
                    at = base + lo
                    while width:
                        room = self._room()
                        n = min(len(room), width)
                        _pread_exactly(fd, room[:n], at, runs.file)
                        self.filled += n
                        at, width = at + n, width - n
                        yield from self._full()
            return
        kept = runs.kept
        step = max(1, READ_CHUNK_BYTES // runs.row_bytes)
        rows = self._scratch(step * runs.row_bytes)
        row = 0
        while row < runs.rows:
            # Whole rows gathered straight into the buffer as far as it holds them; a row that
            # straddles two buffers goes through a row of its own (one a buffer at most).
            room = self._room()
            fit = min(step, runs.rows - row, len(room) // kept)
            n = max(fit, 1)
            block = rows[: n * runs.row_bytes]
            _pread_exactly(fd, memoryview(block), runs.start + row * runs.row_bytes, runs.file)
            block = block.reshape(n, runs.row_bytes)
            if fit:
                out = np.frombuffer(room, np.uint8, count=n * kept).reshape(n, kept)
                _gather(block, runs.spans, out)
                self.filled += n * kept
                yield from self._full()
            else:
                one = np.empty((1, kept), np.uint8)
                _gather(block, runs.spans, one)
                yield from self.add_bytes(memoryview(one).cast("B"))
            row += n

    def _fd(self, file: str) -> int:
        fd = self._files.get(file)
        if fd is None:
            fd = self._files[file] = os.open(file, os.O_RDONLY)
        return fd

    def _scratch(self, nbytes: int) -> np.ndarray:
        if self._rows is None or self._rows.nbytes < nbytes:
            self._rows = np.empty(nbytes, np.uint8)
        return self._rows


def _gather(rows: np.ndarray, spans: Tuple[Tuple[int, int], ...], out: np.ndarray) -> None:
    col = 0
    for lo, width in spans:
        out[:, col: col + width] = rows[:, lo: lo + width]
        col += width


def _pread_exactly(fd: int, view: memoryview, at: int, file: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], at + got)
        if not n:
            raise ValueError(f"{file} ends at byte {at + got}, inside a tensor it lists; the file is "
                             "truncated: save or download the model again")
        got += n


def read_runs(parts: Sequence[TensorRuns], out: np.ndarray) -> np.ndarray:
    """`parts` one after the other into `out` (a contiguous array of exactly their bytes)."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    total = sum(p.nbytes for p in parts)
    if len(view) != total:
        raise ValueError(f"{len(view)} bytes of room for {total} bytes of runs")
    if total == 0:
        return out
    handed = [False]

    def the_buffer() -> bytearray:
        if handed[0]:
            raise ValueError("read_runs reads into one buffer")
        handed[0] = True
        return view  # type: ignore[return-value]

    with RunsReader(total, the_buffer) as reader:
        for part in parts:
            for _ in reader.add(part):
                pass
    return out


__all__ = ["READ_CHUNK_BYTES", "SEEK_MIN_BYTES", "RunsReader", "TensorRuns", "read_runs", "tensor_runs"]
