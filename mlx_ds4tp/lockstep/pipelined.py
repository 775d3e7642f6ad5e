"""One session decoded alone, pipelined: both ranks sample the same tokens for themselves, and
each step's graph is built and queued while the last one computes (the DECODE command).

The stepped protocol (EVAL_BATCH) makes the worker wait for each token the leader samples, so
every step starts from an empty queue: the host reads the token, sends it, and only then are
the next step's ops built. Both ranks hold the same logits bits (the gates sum rank 0's
partial first, the logits are gathered whole on both), so both can run the same sampler on
them: with the same options and the same random seed they draw the same token, and neither
needs the other's. Each rank then runs mlx-lm's generate_step loop: build step n+1 from step
n's token while it is still lazy, `mx.async_eval` it, and only then read step n's token. The
host meets the graph once a token, and the queue (on a Mac, the GPU's) is never empty while
it does. Written here rather than calling generate_step because the session's cache already
holds its prompt (prefilled by SYNC or PREFILL_BATCH) and the penalties must see the whole
prompt's latest tokens, which generate_step would take as a prompt to prefill again.

Both ranks stop at the same token: the end-of-sequence tokens and max_tokens travel in the
command. Where the token read is an end of sequence, the step after it is already running on
both; it is finished and its cache entry trimmed, so the cache holds what the stepped path
leaves (prompt and every token but the last), where the cache can be trimmed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, FrozenSet, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import transport as tr
from ..link.wire import DECODE_HEADER, MAX_DECODE_EOS, MAX_DECODE_OPTIONS_BYTES, MAX_TOKENS_PER_FRAME
from .row_sampling import RowSampler
from .sampling import SamplingOptions, options_from_json, options_to_json, processor_context

# As mlx-lm's generate_step: MLX's buffer cache is released every so many tokens.
CLEAR_EVERY = 256


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What both ranks need to decode one session to its end alike."""

    session: int
    step: int  # the decode step number of the first step (the table's step_count + 1)
    max_tokens: int
    context: Tuple[int, ...]  # the prompt's latest tokens; its last one is the first input
    options: SamplingOptions = SamplingOptions()
    seed: int = 0  # the random stream both ranks draw from (when the options sample)
    eos: FrozenSet[int] = frozenset()
    hash_every: int = 0  # compare the logits' hashes every N decode tokens (0: never)

    @classmethod
    def for_prompt(cls, session: int, step: int, prompt, max_tokens: int, options: SamplingOptions,
                   seed: int, eos=frozenset(), hash_every: int = 0) -> "DecodePlan":
        """The plan of a prompt whose every token but the last is in the session's cache:
        the context is as much of its end as the penalties look at (at least the last)."""
        keep = max(1, processor_context(options))
        return cls(session, step, max_tokens, tuple(int(t) for t in prompt[-keep:]), options, seed,
                   frozenset(int(t) for t in eos), hash_every)

    def pack(self) -> bytes:
        options = options_to_json(self.options)
        eos = sorted(self.eos)
        return (DECODE_HEADER.pack(self.session, self.step, self.seed, self.max_tokens, self.hash_every,
                                   len(eos), len(self.context), len(options))
                + np.asarray(eos, dtype="<i4").tobytes() + np.asarray(self.context, dtype="<i4").tobytes()
                + options)

    @classmethod
    def unpack(cls, payload: bytes) -> "DecodePlan":
        """A DECODE payload's plan; FrameError naming what is wrong, counts checked first."""
        if len(payload) < DECODE_HEADER.size:
            raise tr.FrameError(f"DECODE payload of {len(payload)} bytes is shorter than its "
                                f"{DECODE_HEADER.size}-byte header")
        session, step, seed, max_tokens, every, n_eos, n_context, n_options = \
            DECODE_HEADER.unpack_from(payload)
        if n_eos > MAX_DECODE_EOS or not 0 < n_context <= MAX_TOKENS_PER_FRAME \
                or n_options > MAX_DECODE_OPTIONS_BYTES or max_tokens < 1:
            raise tr.FrameError(f"DECODE says {n_eos} eos tokens (at most {MAX_DECODE_EOS}), "
                                f"{n_context} context tokens (1 to {MAX_TOKENS_PER_FRAME}), "
                                f"{n_options} option bytes (at most {MAX_DECODE_OPTIONS_BYTES}) and "
                                f"max_tokens {max_tokens} (at least 1)")
        expected = DECODE_HEADER.size + 4 * (n_eos + n_context) + n_options
        if len(payload) != expected:
            raise tr.FrameError(f"DECODE payload is {len(payload)} bytes, its counts say {expected}")
        ints = np.frombuffer(payload, dtype="<i4", count=n_eos + n_context, offset=DECODE_HEADER.size)
        try:
            options = options_from_json(payload[expected - n_options:])
        except ValueError as exc:
            raise tr.FrameError(f"DECODE: {exc}") from None
        return cls(session, step, max_tokens, tuple(ints[n_eos:].tolist()), options, seed,
                   frozenset(ints[:n_eos].tolist()), every)


@dataclasses.dataclass
class Decoded:
    tokens: List[int]
    steps: int  # forwards run: one a token, and one more when an end of sequence cut it short
    last_logits: Optional[mx.array] = None


def tokens_hash(tokens: List[int]) -> int:
    """64-bit hash of a token sequence: what both ranks compare once a DECODE is done."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def decode(model, cache: list, plan: DecodePlan, *, vocab: int = 0,
           on_token: Optional[Callable[[int], None]] = None,
           check: Optional[Callable[[int, mx.array], None]] = None) -> Decoded:
    """Decode the plan on this rank (see the module docstring); the same call on both ranks
    pairs their gates. on_token sees each token as it is read; check(step, logits) runs every
    plan.hash_every decode tokens, with that step's number and logits (both ranks at once)."""
    # The serving batch's sampler, one row: a seeded draw is mlx-lm's after mx.random.seed.
    sampler = RowSampler(plan.options, plan.context, plan.seed, vocab)

    def step(token: mx.array) -> Tuple[mx.array, mx.array]:
        logits = model(token[None], cache=cache)[:, -1, :].astype(mx.float32)
        return sampler.draw(logits), logits

    token, logits = step(mx.array(plan.context[-1:], dtype=mx.int32))
    mx.async_eval(token)
    out = Decoded(tokens=[], steps=1)
    while True:
        ahead = None
        if len(out.tokens) + 1 < plan.max_tokens:
            ahead = step(token)  # built, and queued, while `token` may still be computing
            mx.async_eval(ahead[0])
        value = int(token.item())
        out.tokens.append(value)
        out.last_logits = logits
        decoded = len(out.tokens) - 1
        if check is not None and plan.hash_every and decoded and decoded % plan.hash_every == 0:
            check(plan.step + out.steps - 1, logits)
        if on_token is not None:
            on_token(value)
        if ahead is None or value in plan.eos:
            break
        token, logits = ahead
        out.steps += 1
        if len(out.tokens) % CLEAR_EVERY == 0:
            mx.clear_cache()
    if ahead is not None:
        # The step after the end of sequence: both ranks queued it, both finish it.
        mx.eval(ahead[0])
        out.steps += 1
        _trim_one(cache)
    return out


def _trim_one(cache: list) -> None:
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if cache and can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, 1)
