"""The forward passes both ranks run: the prompt into a cache, one token's logits, their hash.

Pure functions of (model, tokens, cache): the same calls on both ranks pair their gates up,
whichever rank makes them. No wire, no session state here.
"""

from __future__ import annotations

import hashlib
from typing import List, Sequence

import mlx.core as mx

# mlx-lm's generate_step default (prefill_step_size): the prompt's prefix enters the cache in
# chunks of this many tokens, so a long prompt's attention scores never take more memory than
# one chunk's.
PREFILL_STEP = 2048


def logits_hash(logits: mx.array) -> int:
    """64-bit hash of the logits' bytes (identical on both ranks when in step)."""
    mx.eval(logits)
    return int.from_bytes(hashlib.blake2b(memoryview(logits).cast("B"), digest_size=8).digest(), "little")


def make_cache(model) -> list:
    """A fresh KV cache for one sequence (mlx-lm's make_prompt_cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def trims_at_any_length(cache: list) -> bool:
    """Whether caches like this fresh one can drop their last tokens however many they hold (a
    prompt cache reused for a prompt it only partly shares, rejected drafts). mlx-lm's
    is_trimmable says so of a fresh cache, but a layer that forgets its oldest tokens (a
    RotatingKVCache window, a ChunkedKVCache chunk) cannot once the prompt is past them: its
    is_trimmable then turns False, or its trim stops short."""
    from mlx_lm.models.cache import CacheList, ChunkedKVCache, RotatingKVCache, can_trim_prompt_cache

    def forgets(layer) -> bool:
        if isinstance(layer, CacheList):
            return any(forgets(c) for c in layer.caches)
        return isinstance(layer, (RotatingKVCache, ChunkedKVCache))

    return can_trim_prompt_cache(cache) and not any(forgets(c) for c in cache)


def forward(model, tokens: List[int], cache) -> mx.array:
    """Last position's logits (float32) for tokens appended to the cache."""
    logits = model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)
    last = logits[0, -1].astype(mx.float32)
    mx.eval(last)
    return last


def fill_cache(model, tokens: Sequence[int], cache, step: int = PREFILL_STEP) -> None:
    """Append tokens to the cache in chunks of `step`, evaluating only the cache, as mlx-lm's
    generate_step prefills: MLX then never runs what no cache entry needs (the last block's
    output, the vocabulary projection and its logits gather), and since both ranks build the
    same graph, the gates it does run pair up chunk by chunk. One evaluation per chunk."""
    if step < 1:
        raise ValueError(f"prefill step {step} must be >= 1")
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start:start + step], dtype=mx.int32)[None], cache=cache)
        mx.eval([c.state for c in cache])
