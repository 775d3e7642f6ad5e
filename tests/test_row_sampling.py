"""lockstep.sampling.row_sampling: the one sampler, which both ranks run alike inside a step and the
leader alone runs on a verify round's rows. Its draws equal mlx-lm's samplers and processors
after mx.random.seed, lazily, row by row of a batch and all rows of a round at once; its
frame travels whole and a bad one is refused naming what is wrong."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_ds4tp.errors import FrameError
from mlx_ds4tp.lockstep.protocol.commands import Sampler
from mlx_ds4tp.lockstep.sampling.options import SamplingOptions, mlx_processors
from mlx_ds4tp.lockstep.sampling.row_sampling import RowSampler, sample_batch, seed_of_key

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
def test_lazy_draws_equal_mlx_lms_samplers(options):
    prompt = [1, 2, 3, 3, 7]
    lazy = RowSampler(options, prompt, options.seed or 0, VOCAB)
    drawn = [lazy.draw(_logits(k)) for k in range(12)]  # nothing evaluated until here
    mx.eval(drawn)
    assert [int(t.item()) for t in drawn] == _mlx_lm_draws(options, prompt, [_logits(k) for k in range(12)])


def _mlx_lm_draws(options: SamplingOptions, prompt: list, rows: list) -> list:
    """What mlx_lm.generate draws: its processors over the whole history, its sampler over the
    normalised log-probabilities, MLX's generator seeded once."""
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(options.seed or 0)
    sampler = make_sampler(options.temperature, top_p=options.top_p, min_p=options.min_p, top_k=options.top_k)
    history, out = list(prompt), []
    for logits in rows:
        for processor in mlx_processors(options):
            logits = processor(mx.array(history), logits)
        out.append(int(sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item()))
        history.append(out[-1])
    return out


def test_a_rounds_rows_are_one_draw_as_mlx_lms_speculative_sampler_draws_them():
    from mlx_lm.sample_utils import make_sampler

    options = SamplingOptions(temperature=0.8, top_k=20, seed=7)
    rows = mx.random.normal((4, VOCAB), key=mx.random.key(3)) * 3
    lazy = RowSampler(options, [1], 7, VOCAB)
    drafts = [lazy.draw(_logits(k)) for k in range(3)] + [lazy.draw(rows)]
    mx.random.seed(7)
    sampler = make_sampler(0.8, top_k=20)
    want = [sampler(x - mx.logsumexp(x, axis=-1, keepdims=True)).tolist()
            for x in [_logits(k) for k in range(3)] + [rows]]
    assert [t.tolist() for t in drafts] == want and len(want[-1]) == 4
    # A stream can start where MLX's generator stands (mlx-lm's, after a draft model's load).
    mx.random.seed(11)
    mx.random.normal((3,))
    later = RowSampler(options, [1], seed_of_key(mx.random.state[0]), VOCAB).draw(rows)
    assert later.tolist() == sampler(rows - mx.logsumexp(rows, axis=-1, keepdims=True)).tolist()
    with pytest.raises(ValueError, match="one row at a time, not 4"):
        RowSampler(SamplingOptions(repetition_penalty=1.2), [1], 0, VOCAB).draw(rows)


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
    payload = Sampler.pack(7, options, [9, 8, 7, 6, 5], 1234)
    assert Sampler.unpack(payload) == (7, options, [7, 6, 5], 1234)  # the penalty's context only
    every = SamplingOptions(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.3, repetition_context_size=4,
                            logit_bias=((3, -2.5), (7, 1.0)), seed=11)
    assert Sampler.unpack(Sampler.pack(9, every, list(range(20)), 12345)) == (9, every, [16, 17, 18, 19], 12345)
    assert Sampler.unpack(Sampler.pack(7, SamplingOptions(), [9, 8], 0))[2] == [8]
    with pytest.raises(FrameError, match="shorter than its"):
        Sampler.unpack(payload[:5])
    with pytest.raises(FrameError, match="context tokens"):
        Sampler.unpack(payload + b"!")
    with pytest.raises(FrameError, match="SAMPLER: sampling options"):
        Sampler.unpack(Sampler.header.pack(1, 0, 1, 2) + b"\x01\x00\x00\x00" + b"[]")
    with pytest.raises(FrameError, match="top_p=2.0"):
        Sampler.unpack(Sampler.header.pack(1, 0, 1, 14) + b"\x01\x00\x00\x00" + b'{"top_p": 2.0}')
