"""Speculative decoding on the pair: several tokens per round of gates.

A drafter on the leader proposes k tokens; the split target verifies the input token and the k
drafts in one forward on both ranks (VERIFY: the gates are paid once for k+1 rows, and decode of
a big model is bound by memory bandwidth, so k+1 rows cost little more than one); the leader
keeps the longest prefix of drafts the target agrees with, plus the target's own next token, and
both ranks trim their caches to exactly that on its word (REWIND). The worker never decides.

Acceptance is mlx-lm's (`speculative_generate_step`): the target's tokens for all k+1 positions
are drawn at once by the sampler and compared with the drafts; greedy output is then token for
token the plain greedy output, whatever the drafter proposes, and a seeded sampled run with a
draft model draws mlx-lm's numbers in mlx-lm's order.

Drafters:
- DraftModel: a small model of the same vocabulary, whole on the leader, with its own cache
  (trimmed as mlx-lm trims it);
- PromptLookup: the tokens that followed the last earlier occurrence of the history's final
  n-gram (no model: strong on edits and retrieval-style prompts);
- Recorded: a known continuation (the benchmark's ceiling: every draft accepted, drafting free).
"""

from __future__ import annotations

import time
from typing import Callable, Collection, List, Optional, Protocol, Sequence

import mlx.core as mx

from .generate import PREFILL_STEP, GenerationStats
from .sessions import LeaderSessions


class Drafter(Protocol):
    def propose(self, history: Sequence[int], k: int) -> List[int]:
        """Up to k tokens expected to follow `history` (prompt and generated tokens so far)."""

    def accepted(self, drafted: int, kept: int) -> None:
        """The target kept `kept` of the `drafted` tokens last proposed."""


class PromptLookup:
    """Draft by matching the history's last `ngram` tokens against earlier text."""

    def __init__(self, ngram: int):
        if ngram < 1:
            raise ValueError(f"--prompt-lookup {ngram}: give an n-gram size of at least 1")
        self.ngram = ngram

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        n = self.ngram
        if len(history) <= n:
            return []
        tail = list(history[-n:])
        for start in range(len(history) - n - 1, -1, -1):  # the most recent earlier match
            if list(history[start:start + n]) == tail:
                return list(history[start + n:start + n + k])
        return []

    def accepted(self, drafted: int, kept: int) -> None:
        pass


class Recorded:
    """Proposes a known continuation of the prompt (a plain run's tokens)."""

    def __init__(self, prompt_len: int, continuation: Sequence[int]):
        self.prompt_len, self.continuation = prompt_len, list(continuation)

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        done = len(history) - self.prompt_len
        return self.continuation[done:done + k]

    def accepted(self, drafted: int, kept: int) -> None:
        pass


class DraftModel:
    """A small model with the target's vocabulary, run whole on the leader. `sample` draws a
    draft token from one row of normalised log-probabilities (greedy by default; a sampled run
    draws with the target's sampler, as mlx-lm's speculative decoding does)."""

    def __init__(self, model, prompt: Sequence[int], sample: Optional[Callable[[mx.array], int]] = None):
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        self.model = model
        self.cache = make_prompt_cache(model)
        if not can_trim_prompt_cache(self.cache):
            raise ValueError("the draft model's cache cannot be trimmed; speculative decoding needs "
                             "a draft model with a plain KV cache (attention layers only)")
        self.fed = 0  # history tokens the draft cache holds
        self.sample = sample or (lambda logprobs: int(mx.argmax(logprobs).item()))
        head = list(prompt[:-1])
        for start in range(0, len(head), PREFILL_STEP):
            self.model(mx.array(head[start:start + PREFILL_STEP])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.fed = len(head)

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        pending = list(history[self.fed:])
        drafts: List[int] = []
        for _ in range(k):
            logits = self.model(mx.array(pending)[None], cache=self.cache)[:, -1]
            token = self.sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            self.fed += len(pending)
            drafts.append(token)
            pending = [token]
        return drafts

    def accepted(self, drafted: int, kept: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        # The cache holds every draft but the last (never fed back): drop the rejected ones.
        fed_drafts = max(drafted - 1, 0)
        drop = max(fed_drafts - kept, 0)
        if drop:
            trim_prompt_cache(self.cache, drop)
        self.fed -= drop


def speculative_generate(sessions: LeaderSessions, prompt: Sequence[int], max_tokens: int,
                         sample_rows: Callable[[mx.array], List[int]], drafter: Drafter, k: int, *,
                         on_token: Optional[Callable[[int], None]] = None, eos: Collection[int] = frozenset(),
                         session: int = 1, prefill_step: int = PREFILL_STEP) -> GenerationStats:
    """The leader's side of one speculative generation on the pair, as one session.
    `sample_rows` draws one token per row of a [rows, vocab] float32 logits array."""
    if not prompt:
        raise ValueError("the prompt encodes to zero tokens; give a non-empty prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    if not 1 <= k <= 64:
        raise ValueError(f"--num-draft-tokens {k}: give 1 to 64 drafted tokens a round")
    history = list(prompt)
    stats = GenerationStats(prompt_tokens=len(prompt))
    stats.drafted = stats.accepted = stats.rounds = 0
    sessions.create(session)
    t0 = time.perf_counter()
    head = history[:-1]
    for start in range(0, len(head), prefill_step):
        sessions.prefill(session, head[start:start + prefill_step])
    stats.prompt_sec = time.perf_counter() - t0  # the first round is the first decode
    t1 = time.perf_counter()
    exchanged = sessions.group.exchange_seconds()
    done = False
    while not done:
        # As mlx-lm: up to the tokens still wanted (a sampled run then draws its numbers in
        # mlx-lm's order, round for round).
        room = max_tokens - len(stats.tokens)
        drafts = drafter.propose(history, min(k, room))
        held = sessions.table.size(session)
        logits = sessions.verify(session, [history[-1]] + drafts).astype(mx.float32)
        targets = sample_rows(logits)
        kept = 0
        while kept < len(drafts) and targets[kept] == drafts[kept]:
            kept += 1
        new = targets[:kept + 1]
        stats.rounds += 1
        stats.drafted += len(drafts)
        stats.accepted += kept
        drafter.accepted(len(drafts), kept)
        # The cache holds the input token and every draft; keep the input and the accepted drafts.
        if len(drafts) > kept:
            sessions.rewind(session, held + kept + 1)
        for token in new:
            stats.tokens.append(token)
            history.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos or len(stats.tokens) == max_tokens:
                done = True
                break
    # Every token came out of a verify round (the first one too): all count as decoded.
    stats.decode_tokens = len(stats.tokens)
    stats.decode_sec = time.perf_counter() - t1
    stats.decode_exchange_sec = sessions.group.exchange_seconds() - exchanged
    sessions.destroy(session)
    return stats


def greedy_rows(logits: mx.array) -> List[int]:
    """Greedy tokens of each row (the argmax of the normalised log-probabilities, as mlx-lm)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [int(t) for t in mx.argmax(logprobs, axis=-1).tolist()]


def sampled(options) -> tuple:
    """(rows sampler, one-row draft sampler) drawing with mlx-lm's sampler for `options` from
    MLX's generator, seeded once with options.seed as mlx_lm.generate is: all k+1 verify rows
    in one draw, each draft token in one draw, in mlx-lm's speculative order."""
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(options.temperature, top_p=options.top_p, min_p=options.min_p, top_k=options.top_k)
    if options.seed is not None:
        mx.random.seed(options.seed)

    def rows(logits: mx.array) -> List[int]:
        return [int(t) for t in sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()]

    def one(logprobs: mx.array) -> int:
        return int(sampler(logprobs).reshape(-1)[0].item())

    return rows, one


__all__ = ["DraftModel", "Drafter", "PromptLookup", "Recorded", "greedy_rows", "sampled", "speculative_generate"]
