"""The pipelined decode of one session (lockstep.generate.pair_generate: SAMPLER, then
EVAL_BATCH steps whose input is each rank's own sample), on both ranks with each sampling for
itself (two groups over tcp in this process, scripted models, so what is checked is the loop:
where it stops, what the tables hold after, when the next step is built, and that ranks which
would draw different tokens fail loudly on both)."""

from __future__ import annotations

import types

import mlx.core as mx

from mlx_ds4tp.errors import LockstepDivergenceError
from mlx_ds4tp.lockstep.generate import pair_generate
from mlx_ds4tp.lockstep.protocol.sessions import LeaderSessions, serve_worker
from mlx_ds4tp.lockstep.sampling.options import SamplingOptions
from pairutil import make_groups, run_both

VOCAB = 16


class Successor:
    """A model whose next token is always (input + shift) % VOCAB, with a real KV cache (one
    layer), counting its forwards and the tokens it was fed."""

    def __init__(self, shift: int = 1, peak: float = 10.0):
        self.shift, self.peak = shift, peak
        self.args = types.SimpleNamespace(vocab_size=VOCAB)
        self.calls = 0
        self.fed = []

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def __call__(self, ids, cache=None):
        self.calls += 1
        length = ids.shape[1]
        if cache:
            kv = mx.zeros((1, 1, length, 4))
            cache[0].update_and_fetch(kv, kv)
        self.fed.append(ids)
        nxt = (ids + self.shift) % VOCAB
        return self.peak * (mx.arange(VOCAB)[None, None, :] == nxt[..., None]).astype(mx.float32)


def _pair(leader_model, worker_model, lead, transport="tcp"):
    lg, wg = make_groups(transport)
    sessions = LeaderSessions(lg, leader_model)

    # MLX's streams are per thread: what a model was fed is read in the thread that ran it.
    def leader():
        try:
            return lead(sessions)
        finally:
            sessions.stop()
            leader_model.fed = [a.tolist() for a in leader_model.fed]

    worker_table = {}

    def worker():
        try:
            worker_table["t"] = serve_worker(wg, worker_model)
            return worker_table["t"]
        finally:
            worker_model.fed = [a.tolist() for a in worker_model.fed]

    try:
        (value, le), (_, we) = run_both(leader, worker)
    finally:
        lg.close()
        wg.close()
    return value, le, we, sessions.table, worker_table.get("t")


def test_both_ranks_stop_at_the_end_of_sequence():
    lm, wm = Successor(), Successor()
    stats, le, we, lt, wt = _pair(lm, wm, lambda s: pair_generate(s, [1, 2, 3], 10, eos={6}))
    assert le is None and we is None, (le, we)
    assert stats.tokens == [4, 5, 6]
    # The step after the end of sequence ran on both (it was queued before 6 was read) ...
    assert lt.batch.step_count == wt.batch.step_count == 4
    assert lm.fed == wm.fed == [[[1, 2]], [[3]], [[4]], [[5]], [[6]]]
    # ... and finished on both before the session ended.
    assert lt.ended == wt.ended == 1


def test_max_tokens_stops_without_a_step_ahead():
    lm, wm = Successor(), Successor()
    stats, le, we, lt, wt = _pair(lm, wm, lambda s: pair_generate(s, [1, 2, 3], 4))
    assert le is None and we is None, (le, we)
    assert stats.tokens == [4, 5, 6, 7] and stats.decode_tokens == 3
    assert lt.batch.step_count == wt.batch.step_count == 4 and lm.calls == wm.calls == 5


def test_a_generation_leaves_nothing_behind_in_either_table():
    lm, wm = Successor(), Successor()
    stats, le, we, lt, wt = _pair(lm, wm, lambda s: pair_generate(s, [1, 2, 3], 10, eos={6}))
    assert le is None and we is None, (le, we)
    for table in (lt, wt):
        batch = table.batch
        assert (batch.rows, table.caches.sessions, batch.batch_cache, batch.samplers, batch.drawn) == \
            ([], {}, None, {}, None)


def test_the_next_step_is_built_before_this_token_is_read():
    lm, wm = Successor(), Successor()
    calls_when_read = []

    def lead(s):
        return pair_generate(s, [3], 5, on_token=lambda t: calls_when_read.append(lm.calls))

    stats, le, we, _, _ = _pair(lm, wm, lead)
    assert le is None and we is None, (le, we)
    assert stats.tokens == [4, 5, 6, 7, 8]
    # When token k is handed on, the forward of step k+1 already exists (one graph ahead);
    # the last token has no step after it.
    assert calls_when_read == [2, 3, 4, 5, 5]


def test_seeded_sampling_draws_the_same_tokens_on_both_ranks_and_repeats():
    options = SamplingOptions(temperature=1.0, seed=7)

    def run():
        return _pair(Successor(peak=0.5), Successor(peak=0.5),
                     lambda s: pair_generate(s, [3], 12, options))

    first, le, we, _, _ = run()
    assert le is None and we is None, (le, we)
    again, _, _, _, _ = run()
    assert first.tokens == again.tokens
    # A flat distribution: the draws are not the model's successor chain.
    assert first.tokens != [(3 + k) % VOCAB for k in range(1, 13)]


def test_ranks_that_draw_different_tokens_both_fail_naming_the_divergence():
    stats, le, we, _, _ = _pair(Successor(shift=1), Successor(shift=2), lambda s: pair_generate(s, [3], 6))
    for exc in (le, we):
        assert isinstance(exc, LockstepDivergenceError) and "the tokens decoded differ" in str(exc), exc


def test_debug_hash_catches_logits_that_differ_with_the_same_tokens():
    stats, le, we, _, _ = _pair(Successor(peak=10.0), Successor(peak=9.0),
                                lambda s: pair_generate(s, [3], 6, debug_hash=2))
    for exc in (le, we):
        assert isinstance(exc, LockstepDivergenceError) and "LOCKSTEP DIVERGENCE at seq 2: the logits differ" \
            in str(exc), exc
    # Without the per-token check the tokens agree, so the pair finishes.
    stats, le, we, _, _ = _pair(Successor(peak=10.0), Successor(peak=9.0), lambda s: pair_generate(s, [3], 6))
    assert le is None and we is None and stats.tokens == [4, 5, 6, 7, 8, 9]
