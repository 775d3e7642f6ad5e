"""The forward passes both ranks run: the prompt into a cache, one token's logits, their hash.

Pure functions of (model, tokens, cache): the same calls on both ranks pair their gates up,
whichever rank makes them. No wire, no session state here.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from typing import List, Sequence

import mlx.core as mx

from ..split.layers import gates_skipped

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


def forward(model, tokens: List[int], cache) -> mx.array:
    """Last position's logits (float32) for tokens appended to the cache."""
    logits = model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)
    last = logits[0, -1].astype(mx.float32)
    mx.eval(last)
    return last


def argmax_token(logits: mx.array) -> int:
    """Greedy sampling: the most likely token of 1-D logits."""
    return int(mx.argmax(logits).item())


def fill_cache(model, tokens: Sequence[int], cache, step: int = PREFILL_STEP) -> None:
    """Append tokens to the cache, computing nothing past the last block.

    mlx-lm's generate_step calls the whole model on the prefix and evaluates only the cache,
    so MLX never runs the lazy vocabulary projection. A split model's logits gather is eager
    (its bytes leave when it is called), so here the prefix goes through the inner model
    (`model.model`: embedding and blocks, which every supported family has) and the projection
    and the gather of every position's logits are never built. Both ranks call this with the
    same tokens, so their gates pair up chunk by chunk."""
    if step < 1:
        raise ValueError(f"prefill step {step} must be >= 1")
    inner = model.model
    # The last block's output is never read here: only its keys and values enter the cache.
    # Its gates are skipped so the eager exchange does not force the rest of it (gates_skipped).
    layers = getattr(inner, "layers", None)
    last_block = gates_skipped(layers[-1]) if isinstance(layers, (list, tuple)) and layers else nullcontext()
    with last_block:
        for start in range(0, len(tokens), step):
            inner(mx.array(tokens[start:start + step], dtype=mx.int32)[None], cache)
            mx.eval([c.state for c in cache])


def prefill(model, tokens: Sequence[int], cache, step: int = PREFILL_STEP) -> mx.array:
    """The prompt into the cache; returns the last position's logits (float32).

    As mlx-lm's generate_step: every token but the last only fills the cache (fill_cache),
    the last one is the one full forward, whose logits pick the first generated token."""
    if len(tokens) == 0:
        raise ValueError("the prompt has zero tokens; prefill needs at least one")
    fill_cache(model, tokens[:-1], cache, step)
    return forward(model, tokens[-1:], cache)
