"""Speculative rows in the decode batch: one forward over rows of different lengths, then each
row's cache cut back to what its session kept.

`ds4tp serve` verifies the drafts of several sessions, and decodes the plain ones, in one
forward (VERIFY_BATCH; `ds4tp run` verifies its one session's the same way, a batch of one
row): row i carries its input token and its k_i drafts, right-padded to the longest row.
Causal attention never lets a real token see the padding after it, so every
row's logits are those of its own tokens. The leader then says how many of each row's
positions its session keeps (COMMIT_BATCH); the rest (rejected drafts, padding) leave the
cache as mlx-lm's batched prefill drops its right padding: BatchKVCache.prepare(right_padding)
and finalize() roll them to the row's left padding, which the mask hides. Rows of one batch
share the cache's length, so a row that kept less carries more left padding; it is cut once
every row has a step's worth (the compaction filter() does).

Only caches that can be cut back per row take part: plain and quantized KV caches. Rotating
windows and recurrent state (ArraysCache) cannot forget a token, so a model with them is
refused speculation when the server starts (speculation_blocker).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import FrameError
from ..link.wire import COMMIT_BATCH_HEADER, MAX_BATCH_ROWS, MAX_VERIFY_WIDTH, VERIFY_BATCH_HEADER, VERIFY_BATCH_ROW

# Left padding every row carries before a commit compacts the batch (one growth step of
# mlx-lm's BatchKVCache: compacting copies the whole cache, so not every round).
COMPACT_AT = 256


def speculation_blocker(cache: Sequence, flags: str = "--draft-model / --prompt-lookup") -> Optional[str]:
    """Why a session cache like this one cannot take rows of different lengths in the batch
    (speculation, the mixed batch), naming `flags` to leave out; None: it can."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    bad = sorted({type(c).__name__ for c in cache if not isinstance(c, (KVCache, QuantizedKVCache))})
    if bad:
        return (f"the model's {', '.join(bad)} layers cannot drop the positions a row does not keep "
                "(a rotating window or recurrent state cannot forget a token); serve it without "
                f"{flags}")
    return None


def pad_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    """The rows right-padded with token 0 to the longest: [len(rows), width] int32."""
    width = max(len(r) for r in rows)
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def pack_verify_batch(step: int, rows: Sequence[Tuple[int, Sequence[int]]]) -> bytes:
    """A VERIFY_BATCH payload: (session, its input token and drafts) per row."""
    head = VERIFY_BATCH_HEADER.pack(step, len(rows), max(len(t) for _, t in rows))
    table = b"".join(VERIFY_BATCH_ROW.pack(s, len(t), 0) for s, t in rows)
    return head + table + pad_rows([np.asarray(t, dtype=np.int32) for _, t in rows]).astype("<i4").tobytes()


def unpack_verify_batch(payload: bytes) -> Tuple[int, List[int], List[np.ndarray]]:
    """(step, sessions, each row's tokens) of a VERIFY_BATCH; FrameError naming what is wrong
    (every count is checked against the payload before anything is read)."""
    if len(payload) < VERIFY_BATCH_HEADER.size:
        raise FrameError(f"VERIFY_BATCH payload of {len(payload)} bytes is shorter than its header")
    step, count, width = VERIFY_BATCH_HEADER.unpack_from(payload)
    if not 0 < count <= MAX_BATCH_ROWS or not 0 < width <= MAX_VERIFY_WIDTH:
        raise FrameError(f"VERIFY_BATCH says {count} rows of width {width} (1 to {MAX_BATCH_ROWS} "
                         f"rows, width 1 to {MAX_VERIFY_WIDTH})")
    table_end = VERIFY_BATCH_HEADER.size + count * VERIFY_BATCH_ROW.size
    if len(payload) != table_end + 4 * count * width:
        raise FrameError(f"VERIFY_BATCH of {count} rows of width {width} is {len(payload)} bytes, "
                         f"expected {table_end + 4 * count * width}")
    sessions, lengths = [], []
    for i in range(count):
        session, n, _ = VERIFY_BATCH_ROW.unpack_from(payload, VERIFY_BATCH_HEADER.size + i * VERIFY_BATCH_ROW.size)
        if not 0 < n <= width:
            raise FrameError(f"VERIFY_BATCH row {i} says {n} tokens in rows of width {width}")
        sessions.append(session)
        lengths.append(n)
    if max(lengths) != width:
        raise FrameError(f"VERIFY_BATCH width {width} but its longest row has {max(lengths)} tokens")
    tokens = np.frombuffer(payload, dtype="<i4", offset=table_end).reshape(count, width)
    return step, sessions, [tokens[i, :n] for i, n in enumerate(lengths)]


def pack_commit(step: int, keep: Sequence[int]) -> bytes:
    """A COMMIT_BATCH payload: the positions each row of the last VERIFY_BATCH keeps."""
    return COMMIT_BATCH_HEADER.pack(step, len(keep), 0) + np.asarray(keep, dtype="<u4").tobytes()


def unpack_commit(payload: bytes) -> Tuple[int, List[int]]:
    """(step, positions kept per row) of a COMMIT_BATCH; FrameError when malformed."""
    if len(payload) < COMMIT_BATCH_HEADER.size:
        raise FrameError(f"COMMIT_BATCH payload of {len(payload)} bytes is shorter than its header")
    step, count, _ = COMMIT_BATCH_HEADER.unpack_from(payload)
    if not 0 < count <= MAX_BATCH_ROWS or len(payload) != COMMIT_BATCH_HEADER.size + 4 * count:
        raise FrameError(f"COMMIT_BATCH says {count} rows in {len(payload)} bytes (1 to "
                         f"{MAX_BATCH_ROWS} rows of 4 bytes)")
    return step, np.frombuffer(payload, dtype="<u4", offset=COMMIT_BATCH_HEADER.size).tolist()


def commit_rows(batch_cache: list, merged: bool, width: int, keep: Sequence[int]) -> None:
    """Keep the first keep[i] of row i's `width` positions (the input token and the drafts its
    session accepted); drop the others from every layer's cache."""
    from mlx_lm.models.cache import trim_prompt_cache

    drop = [width - k for k in keep]
    if not merged:  # a lone session's own cache: one row, an ordinary trim
        if drop[0]:
            trim_prompt_cache(batch_cache, drop[0])
        return
    if max(drop) == 0:
        return
    for layer in batch_cache:
        layer.prepare(right_padding=drop)
        layer.finalize()
    pad = batch_cache[0].left_padding
    if int(mx.min(pad).item()) >= COMPACT_AT:
        rows = list(range(pad.shape[0]))
        for layer in batch_cache:
            layer.filter(rows)


def check_commit(keep: Sequence[int], lengths: Sequence[int]) -> None:
    """FrameError unless a commit fits the last verify's rows."""
    if len(keep) != len(lengths):
        raise FrameError(f"COMMIT_BATCH has {len(keep)} rows, the last VERIFY_BATCH {len(lengths)}")
    for i, (k, n) in enumerate(zip(keep, lengths)):
        if not 1 <= k <= n:
            raise FrameError(f"COMMIT_BATCH keeps {k} positions of row {i}, which carried {n} (1 to {n})")


def accepted_prefix(targets: Sequence[int], drafts: Sequence[int]) -> List[int]:
    """The tokens a greedy round yields: the drafts the target agrees with, then the target's
    own next token (targets[j] is its choice after the input and the first j drafts)."""
    kept = 0
    while kept < len(drafts) and targets[kept] == drafts[kept]:
        kept += 1
    return list(targets[: kept + 1])
