"""lockstep.row_sampling: the sampler both ranks run alike inside a step. Its draws equal the
leader-side sampler's (mlx-lm's samplers after mx.random.seed), lazily, row by row of a batch;
its frame travels whole and a bad one is refused naming what is wrong."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_ds4tp.errors import FrameError
from mlx_ds4tp.link.wire import SAMPLER_HEADER
from mlx_ds4tp.lockstep.row_sampling import RowSampler, pack_sampler, sample_batch, unpack_sampler
from mlx_ds4tp.lockstep.sampling import SamplingOptions, SessionSampler

VOCAB = 64


def _logits(step: int) -> mx.array:
    return mx.random.normal((1, VOCAB), key=mx.random.key(100 + step)) * 3


@pytest.mark.parametrize("options", [
    SamplingOptions(temperature=0.8, seed=5),
    SamplingOptions(temperature=1.0, top_p=0.9, min_p=0.05, top_k=20, seed=9),
    SamplingOptions(temperature=0.7, repetition_penalty=1.5, repetition_context_size=4,
                    frequency_penalty=0.5, logit_bias=((3, 4.0),), seed=2),
    SamplingOptions(repetition_penalty=1.3),  # greedy, penalised
    SamplingOptions(),
], ids=["temp", "filters", "penalties", "greedy-penalised", "greedy"])
def test_lazy_draws_equal_the_leader_side_samplers(options):
    prompt = [1, 2, 3, 3, 7]
    eager = SessionSampler(options, prompt)
    lazy = RowSampler(options, prompt, options.seed or 0, VOCAB)
    want = [eager.sample(_logits(k)) for k in range(12)]
    drawn = [lazy.draw(_logits(k)) for k in range(12)]  # nothing evaluated until here
    mx.eval(drawn)
    assert [int(t.item()) for t in drawn] == want


def test_a_batch_shares_one_argmax_and_a_failing_row_gets_token_0_and_its_error():
    greedy = RowSampler(SamplingOptions(), [1], 0, VOCAB)
    sampled = RowSampler(SamplingOptions(temperature=0.9), [1], 4, VOCAB)
    broken = RowSampler(SamplingOptions(temperature=0.9), [1], 4, VOCAB)
    broken.draw = lambda logits: (_ for _ in ()).throw(RuntimeError("injected"))
    greedy.keep_logprobs = True
    logits = mx.concatenate([_logits(0), _logits(1), _logits(2)])
    errors: dict = {}
    tokens = sample_batch(logits, [greedy, sampled, broken], errors)
    assert tokens.shape == (3,) and tokens.dtype == mx.int32
    assert tokens[0].item() == mx.argmax(logits[0]).item() and tokens[2].item() == 0
    assert errors == {2: "sampling failed: RuntimeError: injected"}
    assert greedy.last_logprobs.shape == (VOCAB,)


def test_the_sampler_frame_travels_whole_and_a_bad_one_is_named():
    options = SamplingOptions(temperature=0.5, presence_penalty=0.5, presence_context_size=3, seed=1)
    payload = pack_sampler(7, options, [9, 8, 7, 6, 5], 1234)
    assert unpack_sampler(payload) == (7, options, [7, 6, 5], 1234)  # the penalty's context only
    assert unpack_sampler(pack_sampler(7, SamplingOptions(), [9, 8], 0))[2] == [8]
    with pytest.raises(FrameError, match="shorter than its"):
        unpack_sampler(payload[:5])
    with pytest.raises(FrameError, match="context tokens"):
        unpack_sampler(payload + b"!")
    with pytest.raises(FrameError, match="SAMPLER: sampling options"):
        unpack_sampler(SAMPLER_HEADER.pack(1, 0, 1, 2) + b"\x01\x00\x00\x00" + b"[]")
