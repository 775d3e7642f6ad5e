"""One rank's stored prompt caches on disk (`ds4tp serve --prompt-cache-dir`, docs/serving.md's "Prompt
cache on disk"): its own half of each KV cache, in mlx-lm's prompt-cache file format.

A file is named by this rank's key (rank_key: each rank holds its own part of the heads) and
the tokens' digest, and checked before it is used (lockstep.caches.disk_files), so a file cut
short, damaged, renamed or made for another model, share or rank is skipped with one log line,
never used. The leader picks the file both ranks load (DiskCache.find) by the rank-neutral
digest; each rank confirms its own by its own key. The files are kept count of, bounded in
bytes, least recently used first (lockstep.caches.disk_index). Every stored cache is written
through (save_later: a writer thread, lockstep.caches.disk_writer; the file's bytes,
lockstep.caches.cache_file), so a stop of any kind keeps what was written.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np

from ...base.log import log
from ..errors import ForeignFileError
from .cache_file import Snapshot, as_mlx_classes, snapshot, sync_directory, write_snapshot
from .disk_files import (
    SUFFIX,
    file_metadata,
    file_name,
    load_checked,
    remove_file,
    scanned_tokens,
    tokens_digest,
    touch,
)
from .disk_index import DiskEntry, DiskIndex
from .disk_writer import DiskWriter

# How long the owner waits for the writer: for room in its queue, for a file a load is about
# to read, for the files left at a stop.
WAIT_SEC = 60.0


class DiskCache:
    """The files of one rank in one directory, bounded in bytes (see the module docstring).
    Written through: save_later hands a stored cache to a writer thread at once, so a stop of
    any kind (Ctrl-C, kill -9, a crash) loses at most the files still being written; each is
    written under a temporary name and renamed into place, so a kill leaves the old file or
    the new one, never a torn one. `trimmable`: the model's caches trim to any length, so a
    file whose tokens a newer file's extend is covered by it and removed."""

    def __init__(self, directory: Path, max_bytes: int, key: str, trimmable: bool = False):
        self.directory = Path(directory)
        self.index = DiskIndex(self.directory, max_bytes)
        self.key = key
        self.trimmable = trimmable
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stats = {"disk_writes": 0, "disk_write_failures": 0, "disk_skipped_files": 0,
                      "disk_writes_put_off": 0}
        self._said_full = self._said_behind = False
        self._writer = DiskWriter(self._write)
        self._scan()

    def name(self, digest: bytes) -> str:
        """This rank's file name for the tokens of `digest` (tokens_digest)."""
        return file_name(self.key, digest)

    def nbytes(self) -> int:
        """Bytes of this rank's files (/health reads it from another thread)."""
        return self.index.nbytes()

    def __len__(self) -> int:
        return len(self.index)

    # -- the leader's choice ------------------------------------------------------
    def find(self, prompt: Sequence[int], trimmable: bool) -> Tuple[Optional[np.ndarray], int]:
        """The stored tokens to load for `prompt` and how many of them it reuses (DiskIndex.find):
        a file still being written counts (its load waits for it)."""
        return self.index.find(prompt, trimmable, [job[0] for _, job in self._writer.jobs()])

    def discard(self, tokens: Sequence[int]) -> None:
        """Remove the file of `tokens`: the other rank could not load its half, so it would
        never be used again."""
        name = self.name(tokens_digest(tokens))
        self._writer.wait_for(name, WAIT_SEC)
        self.index.forget(name)

    # -- writing --------------------------------------------------------------------
    def save(self, tokens: Sequence[int], cache: list) -> bool:
        """Write this rank's half of `cache` (covering `tokens`) now, unless a file holds it
        already; False when it could not be written (logged; serving goes on from memory)."""
        name = self.name(tokens_digest(tokens))
        if self.index.used(name):
            return True
        job = self._snapshot(name, tokens, cache)
        return job is not None and self._write(name, job)

    def save_later(self, tokens: Sequence[int], cache: list, wait: bool = True) -> bool:
        """save, by the writer thread: the cache is seen now, on the caller's thread (the one
        that owns it), and written soon after; False when it will not be (logged). With the
        writer's queue full (a disk slower than the stores), `wait` waits for room (a cache
        about to leave memory); without it the write is put off (a cache that stays in memory:
        its eviction writes it), so a slow disk never holds up the decode steps."""
        name = self.name(tokens_digest(tokens))
        if self.index.used(name) or self._writer.pending(name):
            return True
        job = self._snapshot(name, tokens, cache)
        if job is None:
            return False
        if self._writer.put(name, job, WAIT_SEC if wait else 0.0):
            return True
        if not wait:
            self.stats["disk_writes_put_off"] += 1
            if not self._said_behind:
                log(f"prompt cache: the disk writer of {self.directory} is {self._writer.max_pending} "
                    "files behind; caches it has no room for are written when they leave memory")
                self._said_behind = True
            return False
        self.stats["disk_write_failures"] += 1
        log(f"prompt cache: the disk writer of {self.directory} is {WAIT_SEC:g} s behind; "
            f"a {len(tokens)}-token cache is kept in memory only")
        return False

    def flush(self, timeout: float = WAIT_SEC) -> bool:
        """Until every file handed to the writer is written; False when `timeout` passed first."""
        return self._writer.flush(timeout)

    def close(self, timeout: float = WAIT_SEC) -> int:
        """Write what is left (for at most `timeout` seconds) and end the writer; how many files
        were left unwritten (0: none)."""
        return self._writer.close(timeout)

    def _snapshot(self, name: str, tokens: Sequence[int], cache: list) -> Optional[Tuple[np.ndarray, Snapshot]]:
        """The job the writer takes: the tokens and the cache's file-to-be (cache_file.snapshot,
        on this thread: it calls MLX); None when the cache cannot be saved (logged)."""
        try:
            with as_mlx_classes(cache):
                snap = snapshot(cache, file_metadata(self.key, tokens))
        except (ValueError, RuntimeError) as exc:
            self.stats["disk_write_failures"] += 1
            log(f"prompt cache: could not save {self.directory / name}: {exc}; serving goes on from memory")
            return None
        return np.array(tokens, dtype=np.int32), snap

    def _write(self, name: str, job: Tuple[np.ndarray, Snapshot]) -> bool:
        """Write one file (any thread: no MLX): room first, for its exact size, so the directory
        holds no more than its bound even while the file is being written; then the bytes
        under a temporary name, synced, renamed into place."""
        tokens, snap = job
        path = self.directory / name
        # A leading dot keeps it out of the scan; the suffix as mlx-lm's files have it.
        tmp = self.directory / f".{name}.{os.getpid()}-{threading.get_ident()}.tmp{SUFFIX}"
        size = snap.size()
        if size > self.index.max_bytes:
            self.stats["disk_write_failures"] += 1
            log(f"prompt cache: a {len(tokens)}-token cache takes {size} bytes on disk, more than "
                f"--prompt-cache-disk-bytes {self.index.max_bytes}; kept in memory only")
            return False
        try:
            with self.index.writing(name, size):
                write_snapshot(snap, tmp)
                os.replace(tmp, path)
            sync_directory(self.directory)
        except (OSError, ValueError, RuntimeError) as exc:
            remove_file(tmp)
            self.stats["disk_write_failures"] += 1
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            if not (full and self._said_full):
                log(f"prompt cache: could not write {path}: {exc}; "
                    f"{'the disk is full: ' if full else ''}serving goes on from memory")
            self._said_full = self._said_full or full
            return False
        self.index.add(name, DiskEntry(tokens, size), self.trimmable)
        self.stats["disk_writes"] += 1
        return True

    # -- reading --------------------------------------------------------------------
    def load(self, digest: bytes, count: int) -> Optional[list]:
        """This rank's half of the cache of the `count` tokens of `digest`, checked
        (disk_files.load_checked); None (one log line, a bad file removed) when it has no such
        file or the file does not check out. A file the writer still has is waited for."""
        name = self.name(digest)
        path = self.directory / name
        if not self._writer.wait_for(name, WAIT_SEC):
            log(f"prompt cache: {path} was not written within {WAIT_SEC:g} s; both recompute the "
                f"{count}-token prefix")
            return None
        # Under the lock: the writer makes room by removing the least recently used files,
        # never this one while it is read.
        with self.index.lock:
            if not self.index.used(name):
                log(f"prompt cache: no file {path} on this rank for the {count}-token prefix; both recompute")
                return None
            try:
                cache = load_checked(path, self.key, digest, count)
            except Exception as exc:  # noqa: BLE001 - whatever a damaged file raises, it is not used
                self._skip(path, exc)
                self.index.forget(name)
                return None
        touch(path)
        return cache

    def _skip(self, path: Path, exc: BaseException) -> None:
        self.stats["disk_skipped_files"] += 1
        log(f"prompt cache: skipping {path}: {exc}; the prefix is recomputed")

    def _scan(self) -> None:
        """The files already here, oldest use first; one log line for each that is not ours
        to use (damaged ones named as ours are removed, other models' left alone)."""
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            if path.name.startswith("."):
                continue
            try:
                tokens = scanned_tokens(path, self.key)
            except Exception as exc:  # noqa: BLE001 - an unreadable file is skipped, never used
                self._skip(path, exc)
                if not isinstance(exc, ForeignFileError):
                    remove_file(path)
                continue
            stat = path.stat()
            found.append((stat.st_mtime, path.name, DiskEntry(tokens, stat.st_size)))
        for _, name, entry in sorted(found, key=lambda f: f[0]):
            self.index.add(name, entry)
        self.index.make_room(0)
        for tmp in self.directory.glob(".*.tmp" + SUFFIX):  # a write a crash interrupted
            remove_file(tmp)
        if len(self.index):
            log(f"prompt cache: {len(self.index)} stored prefixes ({self.nbytes()} bytes) "
                f"in {self.directory}")

