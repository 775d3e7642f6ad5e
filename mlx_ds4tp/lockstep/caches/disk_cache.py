"""One rank's stored prompt caches on disk (`ds4tp serve --prompt-cache-dir`, docs/serving.md's "Prompt
cache on disk"): its own half of each KV cache, in mlx-lm's prompt-cache file format.

A file is named by this rank's key (rank_key: each rank holds its own part of the heads) and
the tokens' digest; its metadata repeats both, the tokens themselves and a CRC of the arrays'
bytes, so a file cut short, damaged, renamed or made for another model, share or rank is
skipped with one log line, never used. The leader picks the file both ranks load
(DiskCache.find) by the rank-neutral digest; each rank confirms its own by its own key.
Every stored cache is written through (save_later: a writer thread, lockstep.caches.disk_writer;
the file's bytes, lockstep.caches.cache_file), so a stop of any kind keeps what was written.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ...base.log import log
from ...checkpoint.header import read_header_file
from ..errors import ForeignFileError
from .cache_file import Snapshot, data_crc, snapshot, sync_directory, write_snapshot
from .disk_writer import DiskWriter

SUFFIX = ".safetensors"
# 2: the CRC covers the file's whole data section (1: the state's arrays only, read through
# MLX); a file of format 1 is skipped and removed, its prefix recomputed once.
_FORMAT = "ds4tp-prompt-cache-2"
# How long the owner waits for the writer: for room in its queue, for a file a load is about
# to read, for the files left at a stop.
WAIT_SEC = 60.0


def tokens_digest(tokens: Sequence[int]) -> bytes:
    """The 16-byte digest of a token sequence, the same on both ranks (DISK_LOAD carries it)."""
    return hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


def rank_key(fingerprint: str, share: str, rank: int) -> str:
    """What a file of this rank must have been made by: its model, split share and rank."""
    return f"{fingerprint}/{share}/{rank}"


def cache_blocker(cache: list) -> Optional[str]:
    """Why mlx-lm's prompt-cache file format cannot hold this (fresh) cache, or None: a layer
    load_prompt_cache cannot rebuild (it makes each layer by its class name in
    mlx_lm.models.cache) or one without a state of its own."""
    from mlx_lm.models import cache as mlx_cache

    from .quantized_cache import SessionQuantizedKVCache

    for layer in cache:
        kind = type(layer)
        if kind is SessionQuantizedKVCache:
            continue
        if getattr(mlx_cache, kind.__name__, None) is not kind or "state" not in _own_attrs(kind):
            return f"its cache layers of kind {kind.__name__} cannot be saved in mlx-lm's prompt-cache files"
    return None


def _own_attrs(kind: type) -> set:
    from mlx_lm.models.cache import _BaseCache

    names: set = set()
    for k in kind.__mro__:
        if k is _BaseCache:
            break
        names |= set(vars(k))
    return names


@dataclasses.dataclass
class _Entry:
    tokens: np.ndarray  # int32
    nbytes: int


class DiskCache:
    """The files of one rank in one directory, bounded in bytes (see the module docstring).
    Written through: save_later hands a stored cache to a writer thread at once, so a stop of
    any kind (Ctrl-C, kill -9, a crash) loses at most the files still being written; each is
    written under a temporary name and renamed into place, so a kill leaves the old file or
    the new one, never a torn one. `trimmable`: the model's caches trim to any length, so a
    file whose tokens a newer file's extend is covered by it and removed."""

    def __init__(self, directory: Path, max_bytes: int, key: str, trimmable: bool = False):
        if max_bytes <= 0:
            raise ValueError(f"prompt cache disk bytes {max_bytes} must be > 0")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.key = key
        self.trimmable = trimmable
        self.directory.mkdir(parents=True, exist_ok=True)
        # The entries change on the owner's thread (find, load, discard) and on the writer's:
        # one lock. /health reads nbytes() and the stats without it (one int each).
        self._lock = threading.RLock()
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()  # least recently used first
        self._total = 0
        self._writing = 0  # bytes of the file being written, counted against the bound
        self.stats = {"disk_writes": 0, "disk_write_failures": 0, "disk_skipped_files": 0,
                      "disk_writes_put_off": 0}
        self._said_full = self._said_behind = False
        self._writer = DiskWriter(self._write)
        self._scan()

    # -- names ----------------------------------------------------------------
    def name(self, digest: bytes) -> str:
        """This rank's file name for the tokens of `digest` (tokens_digest)."""
        return hashlib.blake2b(self.key.encode() + digest, digest_size=16).hexdigest() + SUFFIX

    def nbytes(self) -> int:
        """Bytes of this rank's files (kept as a total: /health reads it from another thread)."""
        return self._total

    def _add(self, name: str, entry: "_Entry") -> None:
        self._forget(name, remove=False)
        self._entries[name] = entry
        self._total += entry.nbytes

    def _forget(self, name: str, remove: bool = True) -> None:
        """Remove the file and its entry (none: nothing to do)."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._total -= entry.nbytes
            if remove:
                _remove(self.directory / name)

    def __len__(self) -> int:
        return len(self._entries)

    # -- the leader's choice ------------------------------------------------------
    def find(self, prompt: Sequence[int], trimmable: bool) -> Tuple[Optional[np.ndarray], int]:
        """The stored tokens to load for `prompt` and how many of them it reuses (at most all
        but its last token: the session needs that token's logits); (None, 0) when none.
        Without trimming only a file whose tokens all prefix the prompt will do. A file still
        being written counts (its load waits for it); of two that reuse as much, the newer."""
        want = np.asarray(prompt, dtype=np.int32)
        best, best_keep = None, 0
        with self._lock:
            stored = [e.tokens for e in self._entries.values()]
        stored += [job[0] for _, job in self._writer.jobs()]
        for tokens in stored:
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

    def discard(self, tokens: Sequence[int]) -> None:
        """Remove the file of `tokens`: the other rank could not load its half, so it would
        never be used again."""
        name = self.name(tokens_digest(tokens))
        self._writer.wait_for(name, WAIT_SEC)
        with self._lock:
            self._forget(name)

    # -- writing --------------------------------------------------------------------
    def save(self, tokens: Sequence[int], cache: list) -> bool:
        """Write this rank's half of `cache` (covering `tokens`) now, unless a file holds it
        already; False when it could not be written (logged; serving goes on from memory)."""
        name = self.name(tokens_digest(tokens))
        if self._known(name):
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
        if self._known(name) or self._writer.pending(name):
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

    def _known(self, name: str) -> bool:
        with self._lock:
            if name in self._entries:
                self._entries.move_to_end(name)
                return True
        return False

    def _snapshot(self, name: str, tokens: Sequence[int], cache: list) -> Optional[Tuple[np.ndarray, Snapshot]]:
        """The job the writer takes: the tokens and the cache's file-to-be (cache_file.snapshot,
        on this thread: it calls MLX); None when the cache cannot be saved (logged)."""
        metadata = {"format": _FORMAT, "key": self.key, "count": str(len(tokens)),
                    "tokens": base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode()}
        try:
            with _as_mlx_classes(cache):
                snap = snapshot(cache, metadata)
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
        if size > self.max_bytes:
            self.stats["disk_write_failures"] += 1
            log(f"prompt cache: a {len(tokens)}-token cache takes {size} bytes on disk, more than "
                f"--prompt-cache-disk-bytes {self.max_bytes}; kept in memory only")
            return False
        try:
            with self._lock:
                self._forget(name)  # a file of the same name written meanwhile is replaced
                self._make_room(size)
                self._writing += size
            try:
                write_snapshot(snap, tmp)
                os.replace(tmp, path)
            finally:
                with self._lock:
                    self._writing -= size
            sync_directory(self.directory)
        except (OSError, ValueError, RuntimeError) as exc:
            _remove(tmp)
            self.stats["disk_write_failures"] += 1
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            if not (full and self._said_full):
                log(f"prompt cache: could not write {path}: {exc}; "
                    f"{'the disk is full: ' if full else ''}serving goes on from memory")
            self._said_full = self._said_full or full
            return False
        with self._lock:
            self._add(name, _Entry(tokens, size))
            if self.trimmable:
                self._forget_covered(name, tokens)
        self.stats["disk_writes"] += 1
        return True

    def _forget_covered(self, name: str, tokens: np.ndarray) -> None:
        """Remove the files whose tokens `tokens` extend: a trimmable cache of the longer
        sequence serves every prompt theirs would."""
        for other, entry in list(self._entries.items()):
            n = len(entry.tokens)
            if other != name and n < len(tokens) and np.array_equal(entry.tokens, tokens[:n]):
                self._forget(other)

    def _make_room(self, size: int) -> None:
        while self._entries and self._total + self._writing + size > self.max_bytes:
            self._forget(next(iter(self._entries)))

    # -- reading --------------------------------------------------------------------
    def load(self, digest: bytes, count: int) -> Optional[list]:
        """This rank's half of the cache of the `count` tokens of `digest`, checked against its
        own key, the tokens and the CRC; None (one log line, a bad file removed) when it has no
        such file or the file does not check out. A file the writer still has is waited for."""
        from mlx_lm.models.cache import load_prompt_cache

        name = self.name(digest)
        path = self.directory / name
        if not self._writer.wait_for(name, WAIT_SEC):
            log(f"prompt cache: {path} was not written within {WAIT_SEC:g} s; both recompute the "
                f"{count}-token prefix")
            return None
        # Under the lock: the writer makes room by removing the least recently used files,
        # never this one while it is read.
        with self._lock:
            if name not in self._entries:
                log(f"prompt cache: no file {path} on this rank for the {count}-token prefix; both recompute")
                return None
            try:
                header, start = read_header_file(path)
                meta = _our_metadata(header.get("__metadata__") or {})
                if f"{data_crc(path, start):010d}" != meta.get("crc"):
                    raise ValueError("its arrays fail their CRC: the file is damaged")
                cache, meta = load_prompt_cache(str(path), return_metadata=True)
                tokens = self._check(meta, path)
                if len(tokens) != count or tokens_digest(tokens) != digest:
                    raise ValueError(f"it holds another prefix ({len(tokens)} tokens, not {count})")
            except Exception as exc:  # noqa: BLE001 - whatever a damaged file raises, it is not used
                self._skip(path, exc)
                self._forget(name)
                return None
            self._entries.move_to_end(name)
        _touch(path)
        return _as_session_classes(cache)

    def _check(self, meta: dict, path: Path) -> np.ndarray:
        if meta.get("format") != _FORMAT:
            raise ValueError("it is not a ds4tp prompt-cache file")
        if meta.get("key") != self.key:
            raise ForeignFileError(f"it was made for another model, share or rank ({meta.get('key')}, "
                             f"this rank is {self.key})")
        tokens = np.frombuffer(base64.b64decode(meta.get("tokens", "")), dtype="<i4")
        if str(len(tokens)) != meta.get("count"):
            raise ValueError("its token list is damaged")
        if self.name(tokens_digest(tokens)) != path.name:
            raise ValueError("its name is not its tokens' (renamed or copied from another prefix)")
        return tokens.astype(np.int32)

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
                header, start = read_header_file(path)
                meta = header.get("__metadata__") or {}
                if not isinstance(meta, dict):
                    raise ValueError("its metadata is damaged")
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                if start + max(ends, default=0) != path.stat().st_size:
                    raise ValueError("it is cut short or has bytes past its arrays")
                tokens = self._check(_our_metadata(meta), path)
            except Exception as exc:  # noqa: BLE001 - an unreadable file is skipped, never used
                self._skip(path, exc)
                if not isinstance(exc, ForeignFileError):
                    _remove(path)
                continue
            stat = path.stat()
            found.append((stat.st_mtime, path.name, _Entry(tokens, stat.st_size)))
        for _, name, entry in sorted(found, key=lambda f: f[0]):
            self._add(name, entry)
        self._make_room(0)
        for tmp in self.directory.glob(".*.tmp" + SUFFIX):  # a write a crash interrupted
            _remove(tmp)
        if self._entries:
            log(f"prompt cache: {len(self._entries)} stored prefixes ({self.nbytes()} bytes) "
                f"in {self.directory}")


def _our_metadata(header_metadata: dict) -> dict:
    """The metadata save_prompt_cache was given, out of the safetensors header's: it stores
    [ours, the layers' classes, scalars] flattened (mlx.utils.tree_flatten), ours as "0.<key>"."""
    from mlx.utils import tree_unflatten

    ours = tree_unflatten(list(header_metadata.items()))
    if not isinstance(ours, list) or not ours or not isinstance(ours[0], dict):
        raise ValueError("its metadata is not a prompt cache's")
    return ours[0]


@contextlib.contextmanager
def _as_mlx_classes(cache: list):
    """Our SessionQuantizedKVCache layers saved as mlx-lm's QuantizedKVCache (the same state;
    load_prompt_cache rebuilds a layer by its class name, which must be mlx-lm's)."""
    from mlx_lm.models.cache import QuantizedKVCache

    from .quantized_cache import SessionQuantizedKVCache

    layers = [c for c in cache if type(c) is SessionQuantizedKVCache]
    for c in layers:
        c.__class__ = QuantizedKVCache
    try:
        yield
    finally:
        for c in layers:
            c.__class__ = SessionQuantizedKVCache


def _as_session_classes(cache: list) -> list:
    """A loaded cache as the sessions use it: quantized layers batchable again."""
    from mlx_lm.models.cache import QuantizedKVCache

    from .quantized_cache import SessionQuantizedKVCache

    for c in cache:
        if type(c) is QuantizedKVCache:
            c.__class__ = SessionQuantizedKVCache
    return cache


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _touch(path: Path) -> None:
    """The file's time is its last use, so a restart keeps the LRU order."""
    try:
        os.utime(path)  # no times: now
    except OSError:
        pass


__all__: List[str] = ["DiskCache", "cache_blocker", "rank_key", "tokens_digest"]
