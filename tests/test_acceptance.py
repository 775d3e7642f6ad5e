"""Speculative sampling keeps the target's distribution (lockstep/sampling/acceptance.py): the tokens a
sampled round yields are distributed as plain sampling's, measured over many seeds against the
exact distribution, for the rule on its own and for a batch of one with a draft model.

The bounds are total-variation distances: each test also checks that its draft's distribution
is far from the target's (an "always keep the draft" rule would then be off by that much), so
a wrong rule fails them while the sampling noise of a right one stays well inside: measured,
the right rule's first-token distances were 0.004 (bound 0.04) and 0.010-0.014 (bound 0.06),
the two-token ones 0.022-0.025 (bound 0.12); with the rule broken to keep every draft all three
tests failed at 0.62-0.63, and with rejected drafts redrawn from p instead of norm(max(0, p - q))
the rule's own test failed at 0.20 and the batch's at temperature 1 at 0.085."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ds4tp.lockstep.generate import pair_generate
from mlx_ds4tp.lockstep.one_rank import OneRank
from mlx_ds4tp.lockstep.sampling.acceptance import sampled_round
from mlx_ds4tp.lockstep.sampling.options import SamplingOptions
from mlx_ds4tp.lockstep.sampling.row_sampling import RowSampler
from mlx_ds4tp.lockstep.settings import DraftSettings
from mlx_ds4tp.lockstep.speculative import Speculation


def _distance(counts: np.ndarray, exact: np.ndarray) -> float:
    """Total variation between the empirical distribution of `counts` and `exact`."""
    return 0.5 * float(np.abs(counts / counts.sum() - exact).sum())


def test_the_rule_on_its_own_yields_the_targets_distribution():
    """Context-free target logits and draft distributions (so plain sampling's tokens at each
    position are independent draws from p): the first token over 8000 rounds, the second over
    the rounds that kept the first draft, each against p exactly."""
    vocab, rounds = 6, 8000
    logits = mx.array([[2.0, 1.0, 0.0, -1.0, 0.5, 0.0], [0.0, 0.0, 2.0, 1.0, 0.0, -1.0],
                       [1.0, -1.0, 0.0, 2.0, 0.0, 0.0]])
    q = mx.softmax(mx.array([[-1.0, 1.0, 2.0, 0.0, -1.0, 1.5], [1.5, 0.0, 0.0, 1.0, 2.0, 0.0]]), axis=-1)
    p = np.array(mx.softmax(logits, axis=-1))
    assert _distance(np.array(q[0]) * rounds, p[0]) > 0.4  # keeping every draft would be caught
    first, second = np.zeros(vocab), np.zeros(vocab)
    drafter = np.random.default_rng(5)
    for seed in range(rounds):
        drafts = [int(drafter.choice(vocab, p=np.array(q[j], dtype=np.float64) / float(q[j].sum())))
                  for j in range(2)]
        tokens = sampled_round(RowSampler(SamplingOptions(temperature=1.0), [0], seed, vocab), logits, drafts, q)
        assert 1 <= len(tokens) <= 3 and tokens[:-1] == drafts[:len(tokens) - 1]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    assert _distance(first, p[0]) < 0.04, first
    assert second.sum() > 1000 and _distance(second, p[1]) < 0.06, second


def _tiny(seed: int, vocab: int, sharpen: float):
    """A two-layer llama of `vocab` tokens, random weights, its head scaled by `sharpen` (a
    peaked distribution, unlike the flat one of raw random weights)."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                                        intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                                        vocab_size=vocab, num_key_value_heads=4, tie_word_embeddings=False))
    model.lm_head.weight = model.lm_head.weight * sharpen
    mx.eval(model.parameters())
    return model


def _next(model, tokens) -> np.ndarray:
    return np.array(mx.softmax(model(mx.array([tokens]))[0, -1].astype(mx.float32)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_batch_of_one_with_a_draft_model_samples_as_plain_sampling(temperature):
    """The first two tokens of a seeded generation with a draft model, over 1500 seeds, against
    plain sampling's exact distribution of them (p(t1) p(t2 | t1), from the model itself)."""
    vocab, runs, prompt = 8, 1500, [1, 2, 3]
    target, draft = _tiny(1, vocab, 3.0), _tiny(2, vocab, 3.0)
    first = _next(target, prompt) ** (1 / temperature)
    first /= first.sum()
    exact = np.zeros((vocab, vocab))
    for t1 in range(vocab):
        after = _next(target, prompt + [t1]) ** (1 / temperature)
        exact[t1] = first[t1] * after / after.sum()
    q = _next(draft, prompt) ** (1 / temperature)
    assert _distance(q / q.sum() * runs, first) > 0.3  # keeping every draft would be caught
    counts = np.zeros((vocab, vocab))
    speculation = Speculation(DraftSettings(num_draft_tokens=2), draft_model=draft)
    drafted = accepted = 0
    for seed in range(runs):
        stats = pair_generate(OneRank(target), prompt, 3, SamplingOptions(temperature=temperature, seed=seed),
                              speculation=speculation)
        counts[stats.tokens[0], stats.tokens[1]] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert accepted > 0.2 * drafted > 0, (accepted, drafted)  # drafts are kept, not only redrawn
    assert _distance(counts.sum(axis=1), first) < 0.06, counts.sum(axis=1)
    assert _distance(counts.ravel(), exact.ravel()) < 0.12, counts
