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

from typing import Optional, Sequence

import mlx.core as mx

from ..errors import FrameError

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
