"""Speculative decoding on the pair (docs/two-macs.md, "Speculative decoding"): several tokens per round
of gates. A drafter on the leader proposes k tokens; both ranks verify the input token and the
drafts in one VERIFY_BATCH of one row (lockstep.batch_verify, as `ds4tp serve` verifies its
sessions'), and keep the accepted prefix and the target's own next token on the leader's word
(COMMIT_BATCH). The worker never decides.

Acceptance is mlx-lm's (`speculative_generate_step`): the target's tokens for all k+1 positions
are drawn at once by the sampler and compared with the drafts; greedy output is then token for
token the plain greedy output, whatever the drafter proposes, and a seeded sampled run with a
draft model draws mlx-lm's numbers in mlx-lm's order (the draft tokens and the verify rows are
draws of one RowSampler's stream).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Collection, List, Optional, Protocol, Sequence

import mlx.core as mx

from .batch_verify import accepted_prefix
from .compute import fill_cache
from .generate import SESSION, GenerationStats, open_session
from .row_sampling import RowSampler
from .sampling import SamplingOptions
from .sessions import LeaderSessions


class Drafter(Protocol):
    def propose(self, history: Sequence[int], k: int) -> List[int]:
        """Up to k tokens expected to follow `history` (prompt and generated tokens so far)."""

    def accepted(self, drafted: int, kept: int) -> None:
        """The target kept `kept` of the `drafted` tokens last proposed (a drafter without a
        state of its own inherits this, which ignores it)."""


class PromptLookup(Drafter):
    """Draft the tokens that followed the last earlier occurrence of the history's final
    `ngram` tokens (no model)."""

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


class Recorded(Drafter):
    """Proposes a known continuation of the prompt (a plain run's tokens: the benchmark's
    ceiling, every draft accepted, drafting free)."""

    def __init__(self, prompt_len: int, continuation: Sequence[int]):
        self.prompt_len, self.continuation = prompt_len, list(continuation)

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        done = len(history) - self.prompt_len
        return self.continuation[done:done + k]


def load_draft(path: str, target) -> object:
    """The draft model at `path`, loaded whole: ValueError naming the fix when it cannot draft
    for `target` (another vocabulary, or a cache that cannot drop rejected drafts)."""
    from mlx_lm.utils import load_model

    from .compute import make_cache, trims_at_any_length

    draft, _ = load_model(Path(path))
    mine, theirs = (int(m.args.vocab_size) for m in (target, draft))
    if mine != theirs:
        raise ValueError(f"the draft model {path} has a vocabulary of {theirs} tokens, the model "
                         f"{mine}: a draft must share the model's tokenizer")
    if not trims_at_any_length(make_cache(draft)):
        raise ValueError(f"the draft model {path}'s cache cannot drop rejected drafts; give a draft "
                         "model with plain attention layers")
    return draft


class DraftModel:
    """A small model with the target's vocabulary (load_draft), run whole on the leader, with
    its own cache. `sampler` draws each draft token (greedy by default; a sampled run draws
    with the target's own sampler, as mlx-lm's speculative decoding does)."""

    def __init__(self, model, prompt: Sequence[int], sampler: Optional[RowSampler] = None):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.cache = make_prompt_cache(model)
        self.sampler = sampler or RowSampler(SamplingOptions(), prompt[-1:], 0, 0)
        head = list(prompt[:-1])
        fill_cache(model, head, self.cache)
        self.fed = len(head)  # history tokens the draft cache holds

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        pending = list(history[self.fed:])
        drafts: List[int] = []
        for _ in range(k):
            logits = self.model(mx.array(pending)[None], cache=self.cache)[:, -1]
            token = int(self.sampler.draw(logits).item())
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
                         sampler: RowSampler, drafter: Drafter, k: int,
                         on_token: Optional[Callable[[int], None]] = None,
                         eos: Collection[int] = frozenset()) -> GenerationStats:
    """The leader's side of one speculative generation on the pair, as one session; `sampler`
    draws the target's token at every position of a round (a sampled DraftModel shares it)."""
    if not 1 <= k <= 64:
        raise ValueError(f"--num-draft-tokens {k}: give 1 to 64 drafted tokens a round")
    history = list(prompt)
    stats = GenerationStats(prompt_tokens=len(prompt))
    stats.drafted = stats.accepted = stats.rounds = 0
    t0 = time.perf_counter()
    open_session(sessions, history, max_tokens)
    stats.prompt_sec = time.perf_counter() - t0  # the first round is the first decode
    t1 = time.perf_counter()
    exchanged = sessions.group.exchange_seconds()
    done = False
    while not done:
        # As mlx-lm: up to the tokens still wanted (a sampled run then draws its numbers in
        # mlx-lm's order, round for round).
        drafts = drafter.propose(history, min(k, max_tokens - len(stats.tokens)))
        logits = sessions.verify_batch([(SESSION, [history[-1]] + drafts)])
        new = accepted_prefix(sessions.read(sampler.draw(logits[0].astype(mx.float32))), drafts)
        kept = len(new) - 1
        stats.rounds += 1
        stats.drafted += len(drafts)
        stats.accepted += kept
        drafter.accepted(len(drafts), kept)
        # The cache holds the input token and every draft; keep the input and the accepted drafts.
        sessions.commit_batch([kept + 1])
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
    sessions.destroy(SESSION)
    return stats


__all__ = ["DraftModel", "Drafter", "PromptLookup", "Recorded", "load_draft", "speculative_generate"]
