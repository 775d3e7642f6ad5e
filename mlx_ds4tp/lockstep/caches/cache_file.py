"""One stored prompt cache as a file in mlx-lm's prompt-cache format (a safetensors file that
mlx_lm.models.cache.load_prompt_cache reads back), made in two halves so the slow one can run
on a background thread (lockstep.caches.disk_writer):

  - `snapshot`, on the thread that owns the cache (the rank's engine or command loop): the
    cache's state laid out as mlx-lm's save_prompt_cache lays it out, each array evaluated and
    seen through a NumPy view of its own buffer (no copy);
  - `write_snapshot`, on any thread: the bytes, the header and the CRC of the data section
    (data_crc reads it back), to a file, synced.

Why the split: MLX is not made to be driven from two threads at once (streams are per thread,
evaluation and the graph are the owner's), so every MLX call (the state's arrays, their
evaluation, the bfloat16 views) stays on the owner. What the writer holds is NumPy views, each
of an mx.array handle of its own on the cache's buffer, so the buffer stays alive and MLX never
reuses it in place (it donates a buffer to a later operation only when no other array holds
it), even when the session that reuses the cache writes into it at once (snapshot says how;
tests/test_disk_writer.py holds it to that). Reading those bytes and writing them
out calls no MLX at all; dropping a view frees through MLX's allocator, which takes its own
lock (MLX frees buffers from its stream threads the same way).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

# mlx.core dtypes as safetensors names them (MLX's own save_safetensors).
_DTYPES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
           mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.float16: "F16",
           mx.bfloat16: "BF16", mx.float32: "F32", mx.complex64: "C64"}
CRC_KEY = "0.crc"  # our metadata's CRC, flattened as save_prompt_cache flattens it
_CRC_WIDTH = 10  # fixed: the header's size is known before the CRC is


@dataclasses.dataclass
class _Array:
    name: str
    dtype: str  # safetensors name
    shape: Tuple[int, ...]
    data: np.ndarray  # a view of the MLX buffer (bfloat16 seen as uint16: same bytes)


@dataclasses.dataclass
class Snapshot:
    """A cache's file-to-be: its arrays (views) and its flattened metadata, CRC pending."""

    arrays: List[_Array]
    metadata: Dict[str, str]

    def nbytes(self) -> int:
        """Bytes of the arrays."""
        return sum(a.data.nbytes for a in self.arrays)

    def _header(self, crc: int) -> bytes:
        entries: Dict[str, object] = {}
        offset = 0
        for a in self.arrays:
            end = offset + a.data.nbytes
            entries[a.name] = {"dtype": a.dtype, "shape": list(a.shape), "data_offsets": [offset, end]}
            offset = end
        metadata = dict(self.metadata)
        if CRC_KEY in metadata:
            metadata[CRC_KEY] = f"{crc:0{_CRC_WIDTH}d}"
        entries["__metadata__"] = metadata
        raw = json.dumps(entries, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)  # the arrays start 8-byte aligned

    def size(self) -> int:
        """The file's size in bytes (known before it is written)."""
        return 8 + len(self._header(0)) + self.nbytes()


def snapshot(cache: list, metadata: Dict[str, str]) -> Snapshot:
    """The cache (its layers as mlx-lm's classes) as save_prompt_cache would write it, with our
    `metadata`; its "crc" entry is filled in by write_snapshot. On the cache's own thread."""
    from mlx.utils import tree_flatten

    scalars: list = [""]  # as mlx-lm: never empty, or tree_flatten would drop it
    arrays: List[Tuple[str, mx.array]] = []
    for key, value in tree_flatten([c.state for c in cache]):
        if isinstance(value, mx.array):
            arrays.append((key, value))
            continue
        if isinstance(value, (int, float, bool)):
            kind, value = "scalar", mx.array(value)
        elif isinstance(value, str):
            kind, value = "string", mx.array([ord(ch) for ch in value])
        elif value is None:
            kind, value = "none", mx.array([])
        else:
            raise ValueError(f"the cache's state holds {type(value).__name__}, which a prompt-cache "
                             "file cannot")
        scalars.append((key, kind))
        arrays.append((key, value))
    for _, value in arrays:
        if value.dtype not in _DTYPES:
            raise ValueError(f"a cache array of dtype {value.dtype} cannot be saved")
    # Each view through a handle of its own (copy.copy: a second mx.array on the same
    # buffer, no copy of the data): NumPy's view keeps the Python object it was made from,
    # and the cache's own object is rebound in place when the cache is written to
    # (KVCache's `keys[...] = ...`), which would leave the old buffer with no other holder,
    # free for MLX to update in place under the writer.
    views = [v.view(mx.uint16) if v.dtype == mx.bfloat16 else copy.copy(v) for _, v in arrays]
    mx.eval(views)
    ours = {**metadata, "crc": "0" * _CRC_WIDTH}
    flat = dict(tree_flatten([ours, [type(c).__name__ for c in cache], scalars]))
    return Snapshot([_Array(key, _DTYPES[value.dtype], tuple(value.shape), np.asarray(view))
                     for (key, value), view in zip(arrays, views)], flat)


def write_snapshot(snap: Snapshot, path: Path) -> int:
    """Write the file (the CRC of its data section computed on the way, data_crc's) and sync
    it to the disk; its size. Any thread: NumPy and the file system only."""
    header = snap._header(0)
    crc = 0
    with open(path, "wb") as f:
        f.seek(8 + len(header))
        for a in snap.arrays:
            data = np.ascontiguousarray(a.data)
            crc = zlib.crc32(data, crc)
            if data.nbytes:
                f.write(data.reshape(-1).view(np.uint8))
        header = snap._header(crc)
        f.seek(0)
        f.write(struct.pack("<Q", len(header)) + header)
        f.flush()
        os.fsync(f.fileno())
        size = f.seek(0, os.SEEK_END)
    return size


def data_crc(path: Path, start: int, chunk: int = 8 << 20) -> int:
    """CRC-32 of the file's bytes from `start` (its data section: every array, the scalars
    too) to its end."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            block = f.read(chunk)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


@contextlib.contextmanager
def as_mlx_classes(cache: list):
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


def as_session_classes(cache: list) -> list:
    """A loaded cache as the sessions use it: quantized layers batchable again."""
    from mlx_lm.models.cache import QuantizedKVCache

    from .quantized_cache import SessionQuantizedKVCache

    for c in cache:
        if type(c) is QuantizedKVCache:
            c.__class__ = SessionQuantizedKVCache
    return cache


__all__ = ["Snapshot", "as_mlx_classes", "as_session_classes", "cache_blocker", "data_crc", "snapshot",
           "sync_directory", "write_snapshot"]
