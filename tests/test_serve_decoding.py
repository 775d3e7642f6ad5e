"""The leader's batch (lockstep/batch.py) as the serving engine drives it (serve/engine/decoding.py):
its steps (pipelined, stepped, speculative, mixed) and what each returns for its rows, over
recorded sessions whose model continues t with t + 1 (engine_fakes)."""

from __future__ import annotations

from engine_fakes import FakeTokenizer, fake_batch, next_token
from mlx_ds4tp.lockstep.caches.prompt_cache import Reuse
from mlx_ds4tp.lockstep.protocol.commands import EVAL_PENDING
from mlx_ds4tp.lockstep.settings import DraftSettings
from mlx_ds4tp.lockstep.speculative import Speculation
from mlx_ds4tp.serve.engine.decoding import DecodeStepper
from mlx_ds4tp.serve.engine.generation import Request, RunningSession, batch_request
from mlx_ds4tp.serve.engine.mixing import MixChoice

LOOKUP = Speculation(DraftSettings(prompt_lookup=1, num_draft_tokens=2))


def _stepper(speculation=None, **settings):
    batch, sessions = fake_batch(speculation, **settings)
    return DecodeStepper(batch, MixChoice()), batch, sessions


def _session(batch, prompt, max_tokens: int = 8) -> RunningSession:
    request = Request(list(prompt), max_tokens)
    return RunningSession(batch.row(batch.insert(batch_request(request, Reuse(), 0))), request, FakeTokenizer())


def test_a_pipelined_step_returns_the_tokens_of_the_step_before_it():
    stepper, batch, sessions = _stepper(max_batch=8)
    first, second = _session(batch, [3]), _session(batch, [7])
    assert sessions.kinds() == ["create", "sampler", "create", "sampler"]
    stepper.join([first])
    assert stepper.step([]) is None  # nothing was unread: the step is only sent
    assert sessions.commands[-1] == ("sampled_step", [(1, 3)]) and stepper.first_unread
    stepper.join([second])
    out = stepper.step([])  # sent with the first row's own sample, then step 1 read
    assert sessions.commands[-1] == ("sampled_step", [(1, EVAL_PENDING), (2, 7)])
    assert out.rows == [first] and out.results[0].tokens == [4] and not out.verify
    assert first.fed_all and second.fed_all and stepper.running == [first, second]
    # Read ahead (a prompt waits): step 2's tokens now; the next step sends them itself.
    out = stepper.read_ahead()
    assert [r.tokens for r in out.results] == [[5], [8]] and not first.fed_all
    assert stepper.read_ahead() is None
    batch.remove(second.sid)
    stepper.drop([second])
    assert stepper.step([]) is None
    assert sessions.commands[-1] == ("sampled_step", [(1, 5)])
    assert stepper.stats["decode_steps"] == 3 and stepper.stats["decode_batch_rows"] == 2
    assert stepper.stats["prefilled_tokens"] == 2  # each joining row's last prompt token


def test_a_lone_row_with_its_last_token_in_flight_is_read_without_another_step():
    stepper, batch, sessions = _stepper()
    lone = _session(batch, [3], max_tokens=2)
    stepper.join([lone])
    assert stepper.step([]) is None
    assert stepper.step([]).results[0].tokens == [4]  # step 2 (its last token) sent, step 1 read
    out = stepper.step([])  # nothing more to send: step 2 is read
    assert out.results[0].tokens == [5] and sessions.kinds().count("sampled_step") == 2


def test_the_batch_takes_at_most_max_batch_rows_and_the_rest_wait():
    stepper, batch, sessions = _stepper(LOOKUP, max_batch=2)
    rows = [_session(batch, [10 + i]) for i in (1, 2, 3)]
    stepper.join(rows)
    assert stepper.free_rows() == 0
    out = stepper.step([])
    assert out.rows == rows[:2] and stepper.ready == rows[2:]
    assert [r.tokens for r in out.results] == [[12], [13]]  # the leader's own greedy sampling
    assert sessions.commands[-1] == ("step", [(1, 11), (2, 12)])
    rows[2].request.cancelled = True
    assert stepper.take_cancelled() == rows[2:]


class _Drafter:
    """Drafts the model's next token, then a wrong one."""

    probs = None

    def __init__(self):
        self.kept = []

    def propose(self, history, k):
        return [next_token(history[-1]), 0][:k]

    def accepted(self, drafted, kept):
        self.kept.append((drafted, kept))


def test_a_verify_step_returns_each_rows_accepted_drafts_and_the_targets_next():
    stepper, batch, sessions = _stepper(LOOKUP, max_batch=8)
    drafting, plain = _session(batch, [3]), _session(batch, [9])
    drafting.row.drafter, plain.row.drafter = _Drafter(), None
    stepper.join([drafting, plain])
    out = stepper.step([])
    assert sessions.commands[-1] == ("verify", [(1, [3, 4, 0]), (2, [9])])
    assert out.verify and [r.tokens for r in out.results] == [[4, 5], [10]]
    assert drafting.row.drafter.kept == [(2, 1)]
    assert stepper.stats["drafted_tokens"] == 2 and stepper.stats["accepted_tokens"] == 1
    stepper.commit(out, [2, 1])
    assert sessions.commands[-1] == ("commit", [2, 1])
    # A session one token from its end drafts nothing: the round yields one more than it keeps.
    drafting.row.generated = [0] * 7
    out = stepper.step([])
    assert sessions.commands[-1][0] == "step" and not out.verify
    stepper.commit(out, [1, 1])
    assert sessions.commands[-1][0] == "step"  # no commit after a plain step


def test_a_sampled_request_drafts_too():
    """Speculation takes sampled sessions (lockstep/sampling/acceptance.py keeps their distribution);
    a logprobs request and one that asks for no drafts decode a token a step."""
    from mlx_ds4tp.lockstep.sampling.options import SamplingOptions

    _, batch, _ = _stepper(LOOKUP, max_batch=8)
    sampled = batch.insert(batch_request(Request([1, 2, 1], 8, SamplingOptions(temperature=0.8, seed=3)),
                                         Reuse(), 0))
    logprobs = batch.insert(batch_request(Request([1, 2, 1], 8, logprobs=2), Reuse(), 0))
    no_drafts = batch.insert(batch_request(Request([1, 2, 1], 8, num_draft_tokens=0), Reuse(), 0))
    assert batch.row(sampled).drafter is not None
    assert batch.row(logprobs).drafter is None and batch.row(no_drafts).drafter is None


def test_a_mixed_step_carries_prompt_chunks_beside_the_decode_rows():
    stepper, batch, sessions = _stepper(mixed_prefill=2, max_batch=8)
    decoding, prompt = _session(batch, [3]), _session(batch, [20, 21, 22, 23])
    assert not batch.pipelined and prompt.todo == [20, 21, 22]
    stepper.join([decoding])
    out = stepper.step([prompt])
    assert sessions.commands[-1] == ("verify", [(1, [3]), (2, [20, 21])])
    assert out.results[0].tokens == [4] and (out.results[1].tokens, out.results[1].chunk) == ([], 2)
    assert prompt.todo == [22] and stepper.running == [decoding, prompt]
    # The prompt's last chunk, one token: a plain step; it decodes from the next one.
    out = stepper.step([])
    assert sessions.commands[-1] == ("step", [(1, 4), (2, 22)]) and out.results[1].chunk == 1
    assert prompt.todo == [] and stepper.stats["mixed_steps"] == 2
    # The decode row joining (its last prompt token), the chunks, and the prompt's last token.
    assert stepper.stats["prefilled_tokens"] == 1 + 2 + 1 + 1
    assert stepper.mixing.mixed_per_token is None  # no plain decode step to set it beside yet
