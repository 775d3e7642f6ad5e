"""The commands of stored prompt caches on disk: DISK_SAVE (each rank writes its half to its
--prompt-cache-dir) and DISK_LOAD (each reads its half back; the worker answers whether it
could)."""

from __future__ import annotations

import struct
from typing import Sequence, Tuple

import numpy as np

from ....errors import FrameError
from .base import Command, F, Fixed, check_tokens, command
from .limits import MAX_TOKENS_PER_FRAME


@command
class DiskSave(Command):
    """The stored cache, whether it leaves memory, the tokens it covers."""

    frame = F.DISK_SAVE
    bound = 16 + 4 * MAX_TOKENS_PER_FRAME  # header, tokens
    header = struct.Struct("<QII")  # stored cache id, 1: drop it from memory after, tokens; then the tokens

    @classmethod
    def pack(cls, cache_id: int, tokens: Sequence[int], drop: bool) -> bytes:
        return cls.header.pack(cache_id, int(drop), len(tokens)) + np.asarray(tokens, dtype="<i4").tobytes()

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> Tuple[int, np.ndarray, bool]:
        """(cache id, tokens, drop)."""
        if len(payload) < cls.header.size:
            raise FrameError(f"DISK_SAVE payload of {len(payload)} bytes is shorter than its header")
        cache_id, drop, count = cls.header.unpack_from(payload)
        if drop not in (0, 1) or not 0 < count <= MAX_TOKENS_PER_FRAME or \
                len(payload) != cls.header.size + 4 * count:
            raise FrameError(f"DISK_SAVE says {count} tokens (1 to {MAX_TOKENS_PER_FRAME}) and drop "
                                f"{drop} (0 or 1) in a {len(payload)}-byte payload")
        tokens = np.frombuffer(payload, dtype="<i4", offset=cls.header.size)
        check_tokens(tokens, vocab)
        return cache_id, tokens, bool(drop)

    @classmethod
    def apply(cls, table, cache_id: int, tokens: np.ndarray, drop: bool) -> None:
        table.caches.save(cache_id, tokens, drop)


@command
class DiskLoad(Fixed):
    """Read this rank's half of the cache of the tokens of `digest` as a stored cache; the
    worker answers with the same layout, `loaded` set when it could."""

    frame = F.DISK_LOAD
    bound = 64
    answers = True
    layout = struct.Struct("<QII16s")  # cache id to store under, tokens, 1: loaded (the answer), digest

    @classmethod
    def apply(cls, table, cache_id: int, count: int, _loaded: int, digest: bytes) -> bool:
        return table.caches.load(cache_id, digest, count)

    @classmethod
    def answer(cls, table, cache_id: int, count: int, loaded: int, digest: bytes) -> bytes:
        return cls.pack(cache_id, count, int(cls.apply(table, cache_id, count, loaded, digest)), digest)
