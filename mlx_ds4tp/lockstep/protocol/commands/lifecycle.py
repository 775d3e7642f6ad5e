"""The commands of a session's life and of the stored prompt caches: SESSION_CREATE, REWIND,
SESSION_DESTROY, INVALIDATE."""

from __future__ import annotations

import struct

from ....errors import FrameError
from .base import F, Fixed, command


@command
class Create(Fixed):
    """A session's cache: a fresh one (its KV quantization, session_caches.kv_code), or stored
    cache `cache_id` moved or copied (lockstep.caches.prompt_cache's FRESH, MOVE, COPY)."""

    frame = F.SESSION_CREATE
    bound = 4096
    layout = struct.Struct("<QQII")  # session id, stored cache id, mode, KV code

    @classmethod
    def apply(cls, table, session: int, cache_id: int, mode: int, kv: int) -> None:
        if session in table.caches.sessions or session in table.batch.rows:
            raise FrameError(f"SESSION_CREATE for session {session}, which already exists")
        table.caches.create(session, cache_id, mode, kv)


@command
class Rewind(Fixed):
    """Trim a reused cache to the tokens it keeps."""

    frame = F.REWIND
    bound = 64
    layout = struct.Struct("<QII")  # session id, tokens to keep, reserved

    @classmethod
    def apply(cls, table, session: int, keep: int, _reserved: int) -> None:
        table.caches.rewind(session, keep)


@command
class Destroy(Fixed):
    """Leave the batch and free the session's cache, or store it under a cache id."""

    frame = F.SESSION_DESTROY
    bound = 64
    layout = struct.Struct("<QQ")  # session id, cache id to store it under (0: drop)

    @classmethod
    def apply(cls, table, session: int, store_as: int) -> None:
        table.destroy(session, store_as)


@command
class Invalidate(Fixed):
    """Drop a stored cache."""

    frame = F.INVALIDATE
    bound = 64
    layout = struct.Struct("<Q")  # stored cache id

    @classmethod
    def apply(cls, table, cache_id: int) -> None:
        table.caches.invalidate(cache_id)
