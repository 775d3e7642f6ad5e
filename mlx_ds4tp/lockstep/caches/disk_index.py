"""The files of one rank's prompt-cache directory as the rank keeps count of them
(lockstep.caches.disk_cache): the tokens each covers and its size, least recently used first,
their bytes bounded (the file being written counted too, so the directory never holds more
than its bound), and the leader's choice of the file that reuses most of a prompt.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Tuple

import numpy as np

from .disk_files import remove_file


@dataclasses.dataclass
class DiskEntry:
    tokens: np.ndarray  # int32
    nbytes: int


class DiskIndex:
    """The entries of one directory's files, by name. They change on the owner's thread (find,
    load, discard) and on the disk writer's: `lock` guards them (hold it across a read of a
    file that must not be removed meanwhile). nbytes() and len() are read without it (/health,
    from another thread: one int each). Forgetting an entry removes its file."""

    def __init__(self, directory: Path, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"prompt cache disk bytes {max_bytes} must be > 0")
        self.directory = directory
        self.max_bytes = max_bytes
        self.lock = threading.RLock()
        self._entries: "OrderedDict[str, DiskEntry]" = OrderedDict()  # least recently used first
        self._total = 0
        self._writing = 0  # bytes of the file being written, counted against the bound

    def nbytes(self) -> int:
        """Bytes of the files (kept as a total: /health reads it from another thread)."""
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def add(self, name: str, entry: DiskEntry, trimmable: bool = False) -> None:
        """A file written or found; `trimmable`: the files whose tokens its own extend are
        covered by it (a trimmable cache of the longer sequence serves every prompt theirs
        would) and removed."""
        with self.lock:
            self.forget(name, remove=False)
            self._entries[name] = entry
            self._total += entry.nbytes
            if trimmable:
                for other, old in list(self._entries.items()):
                    n = len(old.tokens)
                    if other != name and n < len(entry.tokens) and np.array_equal(old.tokens, entry.tokens[:n]):
                        self.forget(other)

    def forget(self, name: str, remove: bool = True) -> None:
        """Drop the entry and (remove) its file; none: nothing to do."""
        with self.lock:
            entry = self._entries.pop(name, None)
            if entry is not None:
                self._total -= entry.nbytes
                if remove:
                    remove_file(self.directory / name)

    def used(self, name: str) -> bool:
        """Whether the file is known, and if so, it becomes the most recently used."""
        with self.lock:
            if name in self._entries:
                self._entries.move_to_end(name)
                return True
        return False

    def make_room(self, size: int) -> None:
        """Remove the least recently used files until `size` more bytes fit the bound."""
        with self.lock:
            while self._entries and self._total + self._writing + size > self.max_bytes:
                self.forget(next(iter(self._entries)))

    @contextmanager
    def writing(self, name: str, size: int) -> Iterator[None]:
        """Room for a file of `size` bytes being written under `name` (a file of that name
        written meanwhile is replaced), held against the bound until the write ends."""
        with self.lock:
            self.forget(name)
            self.make_room(size)
            self._writing += size
        try:
            yield
        finally:
            with self.lock:
                self._writing -= size

    def find(self, prompt: Sequence[int], trimmable: bool,
             also: Iterable[np.ndarray] = ()) -> Tuple[Optional[np.ndarray], int]:
        """The stored tokens to load for `prompt` and how many of them it reuses (at most all
        but its last token: the session needs that token's logits); (None, 0) when none.
        Without trimming only a file whose tokens all prefix the prompt will do. `also`: the
        tokens of files still being written (they count: a load waits for them), after the
        files'; of two that reuse as much, the later."""
        want = np.asarray(prompt, dtype=np.int32)
        best, best_keep = None, 0
        with self.lock:
            stored = [e.tokens for e in self._entries.values()]
        for tokens in stored + list(also):
            n = min(len(tokens), len(want) - 1)
            if n < best_keep or n <= 0:
                continue
            differ = np.flatnonzero(tokens[:n] != want[:n])
            common = int(differ[0]) if len(differ) else n
            if not trimmable and common < len(tokens):
                continue
            if common and common >= best_keep:
                best, best_keep = tokens, common
        return best, best_keep
