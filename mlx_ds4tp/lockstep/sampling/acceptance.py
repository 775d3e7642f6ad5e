"""What a speculative round keeps of its drafts: the rule that leaves the target's own
distribution (docs/architecture.md, "Speculative decoding").

A greedy row keeps the drafts the target's argmax agrees with, then the target's own next
token: the plain greedy tokens, whatever was drafted. A sampled row follows speculative
sampling (Leviathan et al. 2023; Chen et al. 2023): draft x at a position, drawn from q, is
kept with probability min(1, p(x) / q(x)), p the target's distribution there as the row's
sampler makes it (filters, temperature: RowSampler.probabilities); at the first draft it
rejects it draws from norm(max(0, p - q)) instead, and when every draft is kept it draws one
more token from p at the position after them. Each token it yields is then distributed as
plain sampling's. A drafter that proposes without a distribution (prompt lookup, a greedy
draft model, a recorded continuation) is a point mass at its token: the draft is kept with
probability p(x), and a rejected one is redrawn from p without x.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx

from .row_sampling import RowSampler


def accepted_prefix(targets: Sequence[int], drafts: Sequence[int]) -> List[int]:
    """The tokens a greedy round yields: the drafts the target agrees with, then the target's
    own next token (targets[j] is its choice after the input and the first j drafts)."""
    kept = 0
    while kept < len(drafts) and targets[kept] == drafts[kept]:
        kept += 1
    return list(targets[: kept + 1])


def greedy_rounds(logits: mx.array, drafts: List[List[int]]) -> List[List[int]]:
    """Each greedy drafted row's tokens from a verify forward's logits [rows, width, vocab]:
    the argmax of the normalised log-probabilities (mlx-lm's greedy sampler) at every position,
    then the accepted prefix."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.argmax(logprobs, axis=-1).tolist()
    return [accepted_prefix(row[: len(d) + 1], d) for row, d in zip(targets, drafts)]


def sampled_round(sampler: RowSampler, logits: mx.array, drafts: Sequence[int],
                  draft_probs: Optional[mx.array] = None) -> List[int]:
    """The tokens a sampled row's round yields (see the module docstring). logits: the row's
    [len(drafts) + 1, vocab], the target's after the input and after each draft; draft_probs:
    [len(drafts), vocab], the distribution each draft was drawn from (None: point masses)."""
    n = len(drafts)
    p = sampler.probabilities(logits)
    where = mx.arange(n)
    chosen = mx.array(list(drafts), dtype=mx.int32)
    p_x = p[where, chosen] if n else mx.zeros((0,))
    if draft_probs is None:
        q_x = mx.ones((n,))
        # p less the point mass at the draft, where it was rejected.
        rest = mx.where(mx.arange(p.shape[-1])[None] == chosen[:, None], 0.0, p[:n])
    else:
        q_x = draft_probs[where, chosen]
        rest = mx.maximum(p[:n] - draft_probs, 0.0)
    keep = sampler.uniform(n) < mx.minimum(p_x / q_x, 1.0)
    # A residual with no mass (p == q to the last bit) is never reached by a rejection; p then
    # stands in, so every row of the draw is a distribution.
    mass = rest.sum(axis=-1, keepdims=True)
    rest = mx.where(mass > 0, rest / mx.maximum(mass, 1e-30), p[:n])
    redraw = sampler.draw_from(mx.concatenate([rest, p[n:]]))
    kept, fallback = keep.tolist(), redraw.tolist()
    m = kept.index(False) if False in kept else n
    return list(drafts[:m]) + [fallback[m]]
