"""One rank's stored prompt caches on disk (`ds4tp serve --prompt-cache-dir`, README "Prompt
cache on disk"): its own half of each KV cache, in mlx-lm's prompt-cache file format.

A file is named by this rank's key (rank_key: each rank holds its own part of the heads) and
the tokens' digest; its metadata repeats both, the tokens themselves and a CRC of the arrays'
bytes, so a file cut short, damaged, renamed or made for another model, share or rank is
skipped with one log line, never used. The leader picks the file both ranks load
(DiskCache.find) by the rank-neutral digest; each rank confirms its own by its own key.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import hashlib
import os
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..base.log import log
from ..checkpoint.header import read_header_file

SUFFIX = ".safetensors"
_FORMAT = "ds4tp-prompt-cache-1"


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


class ForeignFile(ValueError):
    """A sound file made for another model, share or rank: left alone, never used."""


@dataclasses.dataclass
class _Entry:
    tokens: np.ndarray  # int32
    nbytes: int


class DiskCache:
    """The files of one rank in one directory, bounded in bytes (see the module docstring)."""

    def __init__(self, directory: Path, max_bytes: int, key: str):
        if max_bytes <= 0:
            raise ValueError(f"prompt cache disk bytes {max_bytes} must be > 0")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.key = key
        self.directory.mkdir(parents=True, exist_ok=True)
        self._entries: "OrderedDict[str, _Entry]" = OrderedDict()  # least recently used first
        self._total = 0
        self.stats = {"disk_writes": 0, "disk_write_failures": 0, "disk_skipped_files": 0}
        self._said_full = False
        self._scan()

    # -- names ----------------------------------------------------------------
    def name(self, digest: bytes) -> str:
        """This rank's file name for the tokens of `digest` (tokens_digest)."""
        return hashlib.blake2b(self.key.encode() + digest, digest_size=16).hexdigest() + SUFFIX

    def nbytes(self) -> int:
        """Bytes of this rank's files (kept as a total: /health reads it from another thread)."""
        return self._total

    def _add(self, name: str, entry: "_Entry") -> None:
        self._entries[name] = entry
        self._total += entry.nbytes

    def _forget(self, name: str) -> None:
        """Remove the file and its entry (none: nothing to do)."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._total -= entry.nbytes
            _remove(self.directory / name)

    def __len__(self) -> int:
        return len(self._entries)

    # -- the leader's choice ------------------------------------------------------
    def find(self, prompt: Sequence[int], trimmable: bool) -> Tuple[Optional[np.ndarray], int]:
        """The stored tokens to load for `prompt` and how many of them it reuses (at most all
        but its last token: the session needs that token's logits); (None, 0) when none.
        Without trimming only a file whose tokens all prefix the prompt will do."""
        want = np.asarray(prompt, dtype=np.int32)
        best, best_keep = None, 0
        for entry in self._entries.values():
            n = min(len(entry.tokens), len(want) - 1)
            if n <= best_keep:
                continue
            differ = np.flatnonzero(entry.tokens[:n] != want[:n])
            common = int(differ[0]) if len(differ) else n
            if not trimmable and common < len(entry.tokens):
                continue
            if common > best_keep:
                best, best_keep = entry.tokens, common
        return best, best_keep

    def discard(self, tokens: Sequence[int]) -> None:
        """Remove the file of `tokens`: the other rank could not load its half, so it would
        never be used again."""
        self._forget(self.name(tokens_digest(tokens)))

    # -- writing --------------------------------------------------------------------
    def save(self, tokens: Sequence[int], cache: list) -> bool:
        """Write this rank's half of `cache` (covering `tokens`) unless a file holds it already;
        False when it could not be written (logged; serving goes on from memory)."""
        from mlx_lm.models.cache import save_prompt_cache

        name = self.name(tokens_digest(tokens))
        if name in self._entries:
            self._entries.move_to_end(name)
            return True
        path = self.directory / name
        # A leading dot keeps it out of the scan; mx.save_safetensors wants the suffix.
        tmp = self.directory / f".{name}.{os.getpid()}.tmp{SUFFIX}"
        try:
            metadata = {"format": _FORMAT, "key": self.key, "count": str(len(tokens)),
                        "tokens": base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode(),
                        # Fixed width: both ranks' files of an even split are the same size, so
                        # their bounds evict the same files.
                        "crc": f"{_crc(cache):010d}"}
            # Room first, for an upper bound of the file's size, so the directory holds no more
            # than its bound even while the new file is being written.
            self._make_room(_size_bound(cache, metadata))
            with _as_mlx_classes(cache):
                save_prompt_cache(str(tmp), cache, metadata)
            size = tmp.stat().st_size
            if size > self.max_bytes:
                tmp.unlink()
                log(f"prompt cache: a {len(tokens)}-token cache takes {size} bytes on disk, more than "
                    f"--prompt-cache-disk-bytes {self.max_bytes}; kept in memory only")
                return False
            self._make_room(size)
            os.replace(tmp, path)
        except (OSError, ValueError, RuntimeError) as exc:
            _remove(tmp)
            self.stats["disk_write_failures"] += 1
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            if not (full and self._said_full):
                log(f"prompt cache: could not write {path}: {exc}; "
                    f"{'the disk is full: ' if full else ''}serving goes on from memory")
            self._said_full = self._said_full or full
            return False
        self._add(name, _Entry(np.asarray(tokens, dtype=np.int32), size))
        self.stats["disk_writes"] += 1
        return True

    def _make_room(self, size: int) -> None:
        while self._entries and self.nbytes() + size > self.max_bytes:
            self._forget(next(iter(self._entries)))

    # -- reading --------------------------------------------------------------------
    def load(self, digest: bytes, count: int) -> Optional[list]:
        """This rank's half of the cache of the `count` tokens of `digest`, checked against its
        own key, the tokens and the CRC; None (one log line, a bad file removed) when it has no
        such file or the file does not check out."""
        from mlx_lm.models.cache import load_prompt_cache

        name = self.name(digest)
        path = self.directory / name
        if name not in self._entries:
            log(f"prompt cache: no file {path} on this rank for the {count}-token prefix; both recompute")
            return None
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            tokens = self._check(meta, path)
            if len(tokens) != count or tokens_digest(tokens) != digest:
                raise ValueError(f"it holds another prefix ({len(tokens)} tokens, not {count})")
            if f"{_crc(cache):010d}" != meta.get("crc"):
                raise ValueError("its arrays fail their CRC: the file is damaged")
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
            raise ForeignFile(f"it was made for another model, share or rank ({meta.get('key')}, "
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
                if not isinstance(exc, ForeignFile):
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


def _arrays(cache: list) -> List[mx.array]:
    """Every array of the cache's state, in order (what save_prompt_cache writes)."""
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


def _size_bound(cache: list, metadata: dict) -> int:
    """At least the bytes save_prompt_cache writes for `cache`: the arrays, our metadata, and
    a generous allowance per array for the header's JSON and the layers' classes."""
    arrays = _arrays(cache)
    data = sum(a.nbytes for a in arrays)
    return data + sum(len(k) + len(v) + 8 for k, v in metadata.items()) + 256 * (len(arrays) + len(cache)) + 1024


def _crc(cache: list) -> int:
    """CRC-32 of every array of the cache's state, in order (raw bytes, any dtype)."""
    arrays = _arrays(cache)
    mx.eval(arrays)
    crc = 0
    for a in arrays:
        # bfloat16 has no numpy twin: the bytes are read through an integer view of the same size.
        raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        crc = zlib.crc32(np.asarray(raw).tobytes(), crc)
    return crc


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
