"""Speculative decoding's drafting (docs/two-macs.md, "Speculative decoding"): several tokens
per round of gates. A drafter on the leader proposes up to k tokens; both ranks verify the
input token and the drafts in one VERIFY_BATCH row (lockstep.batch), and keep what the
acceptance rule keeps (lockstep.sampling.acceptance) on the leader's word (COMMIT_BATCH). The worker
never decides.

Which sessions draft (Speculation.drafter): those without logits processors, a grammar or
logprobs, greedy or sampled. A greedy one yields the plain greedy tokens whatever is drafted;
a sampled one draws as plain sampling draws, in distribution (a draft model drafts with the
session's own sampler, and its distributions go to the acceptance rule). The others decode a
token a step as rows of the VERIFY_BATCH that carry no drafts.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Protocol, Sequence

import mlx.core as mx

from .compute import fill_cache
from .sampling.row_sampling import RowSampler
from .settings import DraftSettings, draft_tokens_problem


class Drafter(Protocol):
    def propose(self, history: Sequence[int], k: int) -> List[int]:
        """Up to k tokens expected to follow `history` (prompt and generated tokens so far)."""

    def accepted(self, drafted: int, kept: int) -> None:
        """The target kept `kept` of the `drafted` tokens last proposed (a drafter without a
        state of its own inherits this, which ignores it)."""

    # The distributions the last proposal was drawn from ([drafts, vocab]), or None: a point
    # mass at each proposed token (lockstep.sampling.acceptance).
    probs: Optional[mx.array] = None


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


class DraftModel(Drafter):
    """A small model with the target's vocabulary (load_draft), run whole on the leader, with
    its own cache. `sampler`: the session's own (a sampled one draws each draft from its
    distribution, kept in `probs` for the acceptance rule); None or greedy: argmax drafts."""

    def __init__(self, model, prompt: Sequence[int], sampler: Optional[RowSampler] = None):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.cache = make_prompt_cache(model)
        self.sampler = sampler if sampler is not None and sampler.key is not None else None
        head = list(prompt[:-1])
        fill_cache(model, head, self.cache)
        self.fed = len(head)  # history tokens the draft cache holds
        self.probs = None

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        pending = list(history[self.fed:])
        drafts, probs = [], []
        for _ in range(k):
            logits = self.model(mx.array(pending)[None], cache=self.cache)[:, -1].astype(mx.float32)
            if self.sampler is None:
                token = int(mx.argmax(logits, axis=-1).item())
            else:
                probs.append(self.sampler.probabilities(logits))
                token = int(self.sampler.draw_from(probs[-1]).item())
            self.fed += len(pending)
            drafts.append(token)
            pending = [token]
        self.probs = mx.concatenate(probs) if probs else None
        return drafts

    def accepted(self, drafted: int, kept: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        # The cache holds every draft but the last (never fed back): drop the rejected ones.
        fed_drafts = max(drafted - 1, 0)
        drop = max(fed_drafts - kept, 0)
        if drop:
            trim_prompt_cache(self.cache, drop)
        self.fed -= drop


class Speculation:
    """How the leader drafts for its sessions: `k` drafts a round unless a request asks for
    fewer, from prompt lookup, a draft model (loaded: load_draft) or a recorded continuation
    (the bench's ceiling: every draft right, drafting free)."""

    def __init__(self, settings: DraftSettings, draft_model=None, recorded: Optional[Sequence[int]] = None):
        k = settings.num_draft_tokens
        problem = draft_tokens_problem(k)
        if problem:
            raise ValueError(f"--num-draft-tokens {problem}")
        if sum(map(bool, (settings.prompt_lookup, draft_model is not None, recorded is not None))) != 1:
            raise ValueError("give exactly one drafter: --draft-model, --prompt-lookup or a recorded draft")
        self.k = k
        self.lookup = PromptLookup(settings.prompt_lookup) if settings.prompt_lookup else None
        self.draft_model = draft_model
        self.recorded = None if recorded is None else list(recorded)

    @staticmethod
    def drafts_for(options, logprobs: bool, num_draft_tokens: Optional[int]) -> bool:
        """Whether a session with these sampling options drafts: not one whose logits a
        processor or grammar changes (its drafts would be checked against another distribution
        than the one it samples), nor one that reports logprobs, nor one that asked for none."""
        return num_draft_tokens != 0 and not logprobs and not options.processed

    def drafter(self, prompt: Sequence[int], sampler: RowSampler) -> Drafter:
        """The drafter of a new session that drafts (drafts_for)."""
        if self.lookup is not None:
            return self.lookup
        if self.recorded is not None:
            return Recorded(len(prompt), self.recorded)
        return DraftModel(self.draft_model, prompt, sampler)

    def round_size(self, asked: Optional[int], room: int) -> int:
        """Drafts this round for a session with `room` tokens still to generate: at most
        room - 1, since the round yields one more than it accepts."""
        return max(min(self.k if asked is None else asked, room - 1), 0)


__all__ = ["DraftModel", "Drafter", "PromptLookup", "Recorded", "Speculation", "load_draft"]
