"""serve.decoding on its own: the decode batch's steps (pipelined, stepped, speculative, mixed)
and what each returns for its rows, over recorded sessions whose model continues t with t + 1
(engine_fakes)."""

from __future__ import annotations

from engine_fakes import FakeSessions, FakeTokenizer, next_token
from mlx_ds4tp.lockstep.commands import EVAL_PENDING
from mlx_ds4tp.lockstep.prompt_cache import Reuse
from mlx_ds4tp.lockstep.row_sampling import RowSampler
from mlx_ds4tp.serve.decoding import DecodeStepper
from mlx_ds4tp.serve.generation import Request, RunningSession
from mlx_ds4tp.serve.limits import ServeLimits
from mlx_ds4tp.serve.mixing import MixChoice
from mlx_ds4tp.serve.speculation import Speculation


def _session(sid: int, prompt, max_tokens: int = 8) -> RunningSession:
    """A session as the stepper's prepare() leaves a stepped one: its leader-side sampler."""
    session = RunningSession(sid, Request(list(prompt), max_tokens), Reuse(), FakeTokenizer())
    session.sampler = RowSampler(session.request.options, list(prompt), 0, 0)
    return session


def _stepper(speculation=None, **limits):
    sessions = FakeSessions()
    return DecodeStepper(sessions, ServeLimits(**limits), MixChoice(), speculation), sessions


def _take(out):
    """What the engine's finishing does to the rows that run on: their next input."""
    for session, result in zip(out.rows, out.results):
        if result.tokens:
            session.next_input = result.tokens[-1]
            session.generated += result.tokens


def test_a_pipelined_step_returns_the_tokens_of_the_step_before_it():
    stepper, sessions = _stepper()
    first, second = _session(1, [3]), _session(2, [7])
    for session in (first, second):
        sessions.create(session.sid)
        stepper.prepare(session)
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
    _take(out)
    stepper.drop([second])
    assert stepper.step([]) is None
    assert sessions.commands[-1] == ("sampled_step", [(1, 5)])
    assert stepper.stats["decode_steps"] == 3 and stepper.stats["decode_batch_rows"] == 2
    assert stepper.stats["prefilled_tokens"] == 2  # each joining row's last prompt token


def test_the_batch_takes_at_most_max_batch_rows_and_the_rest_wait():
    stepper, sessions = _stepper(speculation=Speculation(2, prompt_lookup=1), max_batch=2)
    rows = [_session(i, [10 + i]) for i in (1, 2, 3)]
    stepper.join(rows)
    assert stepper.free_rows() == 0
    out = stepper.step([])
    assert out.rows == rows[:2] and stepper.ready == rows[2:]
    assert [r.tokens for r in out.results] == [[12], [13]]  # the leader's own greedy sampling
    assert sessions.commands[-1] == ("step", [(1, 11), (2, 12)])
    rows[2].request.cancelled = True
    assert stepper.take_cancelled() == rows[2:] and not stepper.ready


class _Drafter:
    """Drafts the model's next token, then a wrong one."""

    def __init__(self):
        self.kept = []

    def propose(self, history, k):
        return [next_token(history[-1]), 0][:k]

    def accepted(self, drafted, kept):
        self.kept.append((drafted, kept))


def test_a_verify_step_returns_each_rows_accepted_drafts_and_the_targets_next():
    stepper, sessions = _stepper(speculation=Speculation(2, prompt_lookup=1))
    drafting, plain = _session(1, [3]), _session(2, [9])
    drafting.drafter = _Drafter()
    stepper.join([drafting, plain])
    out = stepper.step([])
    assert sessions.commands[-1] == ("verify", [(1, [3, 4, 0]), (2, [9])])
    assert out.verify and [r.tokens for r in out.results] == [[4, 5], [10]]
    assert drafting.drafter.kept == [(2, 1)]
    assert stepper.stats["drafted_tokens"] == 2 and stepper.stats["accepted_tokens"] == 1
    stepper.commit(out, [2, 1])
    assert sessions.commands[-1] == ("commit", [2, 1])
    # A session one token from its end drafts nothing: the round yields one more than it keeps.
    _take(out)
    drafting.generated = [0] * 7
    out = stepper.step([])
    assert sessions.commands[-1][0] == "step" and not out.verify
    stepper.commit(out, [1, 1])
    assert sessions.commands[-1][0] == "step"  # no commit after a plain step


def test_a_mixed_step_carries_prompt_chunks_beside_the_decode_rows():
    stepper, sessions = _stepper(mixed_prefill=2)
    decoding, prompt = _session(1, [3]), _session(2, [20, 21, 22, 23])
    assert not stepper.pipelined and prompt.todo == [20, 21, 22]
    stepper.join([decoding])
    out = stepper.step([prompt])
    assert sessions.commands[-1] == ("verify", [(1, [3]), (2, [20, 21])])
    assert out.results[0].tokens == [4] and (out.results[1].tokens, out.results[1].chunk) == ([], 2)
    assert prompt.todo == [22] and stepper.running == [decoding, prompt]
    # The prompt's last chunk, one token: a plain step; it decodes from the next one.
    out = stepper.step([])
    assert sessions.commands[-1] == ("step", [(1, 3), (2, 22)]) and out.results[1].chunk == 1
    assert prompt.todo == [] and stepper.stats["mixed_steps"] == 2
    # The decode row joining (its last prompt token), the chunks, and the prompt's last token.
    assert stepper.stats["prefilled_tokens"] == 1 + 2 + 1 + 1
    assert stepper.mixing.mixed_per_token is None  # no plain decode step to set it beside yet
