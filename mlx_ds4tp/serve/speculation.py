"""Speculative decoding in `ds4tp serve`'s batch (docs/serving.md, "Speculative decoding in the batch"):
which sessions draft, with what, and what a verify round yields for each of them.

A session drafts only when it decodes greedily with no logits processor, no grammar and no
logprobs: then any draft leaves its text exactly the plain greedy text (a draft the target
disagrees with is dropped). The others decode one token a step as rows of the VERIFY_BATCH
that carry no drafts, so no draft is ever checked against a grammar. The drafts come from the
leader alone (the worker never decides).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx

from ..lockstep.batch_verify import accepted_prefix
from ..lockstep.speculative import Drafter, DraftModel, PromptLookup


class Speculation:
    """The server's drafting. `k`: drafts a round unless a request asks for fewer."""

    def __init__(self, k: int, prompt_lookup: int = 0, draft_model=None):
        if not 1 <= k <= 64:
            raise ValueError(f"--num-draft-tokens {k}: give 1 to 64 drafted tokens a round")
        if bool(prompt_lookup) == (draft_model is not None):
            raise ValueError("give exactly one drafter: --draft-model or --prompt-lookup")
        self.k = k
        self.lookup = PromptLookup(prompt_lookup) if prompt_lookup else None
        self.draft_model = draft_model

    def drafter(self, request) -> Optional[Drafter]:
        """The drafter of a new session, or None when it decodes one token a step."""
        if request.num_draft_tokens == 0 or request.logprobs is not None or not request.options.greedy:
            return None
        if self.lookup is not None:
            return self.lookup
        return DraftModel(self.draft_model, request.prompt)

    def propose(self, drafter: Optional[Drafter], history: Sequence[int], k_asked: Optional[int],
                room: int) -> List[int]:
        """This round's drafts for a session with `room` tokens still to generate: at most
        room - 1, since the round yields one more than it accepts."""
        if drafter is None:
            return []
        k = min(self.k if k_asked is None else k_asked, room - 1)
        return drafter.propose(history, k) if k > 0 else []


def verified_tokens(logits: mx.array, drafts: List[List[int]]) -> List[List[int]]:
    """Each drafted row's tokens from a verify forward's logits [rows, width, vocab]: the
    greedy target at every position (argmax of the normalised log-probabilities, as mlx-lm's
    greedy sampler), then the accepted prefix."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.argmax(logprobs, axis=-1).tolist()
    return [accepted_prefix(row[: len(d) + 1], d) for row, d in zip(targets, drafts)]
