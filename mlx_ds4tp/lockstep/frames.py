"""The lockstep commands' payloads as bytes: packed by the leader, unpacked (every count checked
against the payload's size first) by both ranks. The layouts are link.wire's."""

from __future__ import annotations

import struct
from typing import List, Sequence, Tuple

import numpy as np

from .. import transport as tr
from ..link.wire import (
    DISK_SAVE_HEADER,
    EVAL_BATCH_HEADER as BATCH_HEADER,
    EVAL_BATCH_ROW,
    MAX_BATCH_ROWS,
    MAX_PREFILL_ROWS,
    MAX_TOKENS_PER_FRAME,
    PREFILL_BATCH_HEADER as PREFILL_HEADER,
    PREFILL_BATCH_ROW,
)

# The rows of an EVAL_BATCH as one numpy record array: the layout of wire.EVAL_BATCH_ROW.
BATCH_ROW = np.dtype([("session", "<u8"), ("token", "<i4"), ("reserved", "<u4")])
if BATCH_ROW.itemsize != EVAL_BATCH_ROW.size:
    raise ImportError(f"BATCH_ROW is {BATCH_ROW.itemsize} bytes, wire.EVAL_BATCH_ROW {EVAL_BATCH_ROW.size}")
# The rows of a PREFILL_BATCH: the layout of wire.PREFILL_BATCH_ROW.
PREFILL_ROW = np.dtype([("session", "<u8"), ("count", "<u4"), ("reserved", "<u4")])
if PREFILL_ROW.itemsize != PREFILL_BATCH_ROW.size:
    raise ImportError(f"PREFILL_ROW is {PREFILL_ROW.itemsize} bytes, wire.PREFILL_BATCH_ROW {PREFILL_BATCH_ROW.size}")


def unpack(fmt: struct.Struct, payload: bytes, ftype) -> tuple:
    """A fixed-size payload's fields; FrameError naming the frame when its size is not fmt's."""
    if len(payload) != fmt.size:
        raise tr.FrameError(f"{ftype.name} payload is {len(payload)} bytes, expected {fmt.size}")
    return fmt.unpack(payload)


def pack_prefill_batch(rows: Sequence[Tuple[int, Sequence[int]]]) -> bytes:
    """A PREFILL_BATCH payload: one prefill chunk of each (session, tokens) row."""
    items = np.zeros(len(rows), dtype=PREFILL_ROW)
    items["session"] = [s for s, _ in rows]
    items["count"] = [len(t) for _, t in rows]
    tokens = b"".join(np.asarray(t, dtype="<i4").tobytes() for _, t in rows)
    return PREFILL_HEADER.pack(len(rows), 0, 0) + items.tobytes() + tokens


def unpack_prefill_batch(payload: bytes) -> Tuple[List[int], List[np.ndarray]]:
    """A PREFILL_BATCH's sessions and their token chunks (views of the payload); FrameError
    naming what is wrong, every count checked against the payload's size first."""
    if len(payload) < PREFILL_HEADER.size:
        raise tr.FrameError(f"PREFILL_BATCH payload of {len(payload)} bytes is shorter than its "
                            f"{PREFILL_HEADER.size}-byte header")
    count, _, _ = PREFILL_HEADER.unpack_from(payload)
    if not 0 < count <= MAX_PREFILL_ROWS:
        raise tr.FrameError(f"PREFILL_BATCH says {count} rows (1 to {MAX_PREFILL_ROWS})")
    end = PREFILL_HEADER.size + count * PREFILL_ROW.itemsize
    if len(payload) < end:
        raise tr.FrameError(f"PREFILL_BATCH says {count} rows, but its {len(payload)} bytes cannot "
                            f"hold their {count} x {PREFILL_ROW.itemsize}-byte entries")
    items = np.frombuffer(payload, dtype=PREFILL_ROW, count=count, offset=PREFILL_HEADER.size)
    counts = items["count"].astype(np.int64)
    sessions = items["session"].tolist()
    if counts.min() == 0:
        row = int(np.argmin(counts))
        raise tr.FrameError(f"PREFILL_BATCH row {row} (session {sessions[row]}) has 0 tokens "
                            "(a prompt needs at least one token per row)")
    total = int(counts.sum())
    if total > MAX_TOKENS_PER_FRAME or len(payload) - end != 4 * total:
        raise tr.FrameError(f"PREFILL_BATCH rows say {total} tokens (at most {MAX_TOKENS_PER_FRAME}), "
                            f"but {len(payload) - end} bytes follow them ({4 * total} expected)")
    if len(set(sessions)) != count:
        raise tr.FrameError(f"PREFILL_BATCH names a session twice: {sessions}")
    tokens = np.frombuffer(payload, dtype="<i4", offset=end)
    return sessions, np.split(tokens, np.cumsum(counts)[:-1])


def pack_batch(step: int, rows: Sequence[Tuple[int, int]]) -> bytes:
    """An EVAL_BATCH payload: the step number, then (session, token) per row."""
    items = np.zeros(len(rows), dtype=BATCH_ROW)
    items["session"] = [s for s, _ in rows]
    items["token"] = [t for _, t in rows]
    return BATCH_HEADER.pack(step, len(rows), 0) + items.tobytes()


def unpack_batch(payload: bytes) -> Tuple[int, List[int], np.ndarray]:
    """(step, sessions, input tokens) of an EVAL_BATCH; FrameError when malformed."""
    if len(payload) < BATCH_HEADER.size:
        raise tr.FrameError(f"EVAL_BATCH payload of {len(payload)} bytes is malformed")
    step, count, _ = BATCH_HEADER.unpack_from(payload)
    items = np.frombuffer(payload, dtype=BATCH_ROW, offset=BATCH_HEADER.size) \
        if (len(payload) - BATCH_HEADER.size) % BATCH_ROW.itemsize == 0 else None
    if items is None or len(items) != count or not 0 < count <= MAX_BATCH_ROWS:
        raise tr.FrameError(f"EVAL_BATCH says {count} rows in a {len(payload)}-byte payload "
                            f"(1 to {MAX_BATCH_ROWS} rows of {BATCH_ROW.itemsize} bytes)")
    return step, items["session"].tolist(), items["token"]


def pack_disk_save(cache_id: int, tokens: Sequence[int], drop: bool) -> bytes:
    """A DISK_SAVE payload: the stored cache, whether it leaves memory, the tokens it covers."""
    return DISK_SAVE_HEADER.pack(cache_id, int(drop), len(tokens)) + np.asarray(tokens, dtype="<i4").tobytes()


def unpack_disk_save(payload: bytes, vocab: int) -> Tuple[int, np.ndarray, bool]:
    """(cache id, tokens, drop) of a DISK_SAVE; FrameError when malformed."""
    if len(payload) < DISK_SAVE_HEADER.size:
        raise tr.FrameError(f"DISK_SAVE payload of {len(payload)} bytes is shorter than its header")
    cache_id, drop, count = DISK_SAVE_HEADER.unpack_from(payload)
    if drop not in (0, 1) or not 0 < count <= MAX_TOKENS_PER_FRAME or \
            len(payload) != DISK_SAVE_HEADER.size + 4 * count:
        raise tr.FrameError(f"DISK_SAVE says {count} tokens (1 to {MAX_TOKENS_PER_FRAME}) and drop "
                            f"{drop} (0 or 1) in a {len(payload)}-byte payload")
    tokens = np.frombuffer(payload, dtype="<i4", offset=DISK_SAVE_HEADER.size)
    check_tokens(tokens, vocab)
    return cache_id, tokens, bool(drop)


def check_tokens(tokens: np.ndarray, vocab: int) -> None:
    """FrameError unless every id is in [0, vocab) (vocab 0: unknown, not checked). Token ids
    index the embedding, which MLX does not bounds-check (an id past the table reads other
    memory or crashes), so every id from the wire is checked before the model sees it."""
    if vocab and len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
        raise tr.FrameError(f"token id {bad}, outside the model's vocabulary [0, {vocab}): "
                            "the leader runs another model or the frame is corrupt")
