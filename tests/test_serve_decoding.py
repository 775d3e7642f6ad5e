"""The leader's batch (lockstep/batch.py) as the serving engine drives it: its steps (pipelined,
stepped, speculative, mixed) carried out as a StepPlan says, and what each returns for its rows,
over recorded sessions whose model continues t with t + 1 (engine_fakes)."""

from __future__ import annotations

import pytest

from engine_fakes import fake_batch, next_token
from mlx_ds4tp.lockstep.batch import StepPlan
from mlx_ds4tp.lockstep.protocol.commands import EVAL_PENDING
from mlx_ds4tp.lockstep.request import GenerationRequest as Request
from mlx_ds4tp.lockstep.settings import DraftSettings
from mlx_ds4tp.lockstep.speculative import Speculation

LOOKUP = Speculation(DraftSettings(prompt_lookup=1, num_draft_tokens=2))


def _row(batch, prompt, max_tokens: int = 8):
    return batch.row(batch.insert(Request(list(prompt), max_tokens)))


def test_a_pipelined_step_returns_the_tokens_of_the_step_before_it():
    batch, sessions = fake_batch()
    first, second = _row(batch, [3]), _row(batch, [7])
    assert sessions.kinds() == ["create", "sampler", "create", "sampler"]
    assert batch.step(StepPlan(join=(first.id,))) is None  # nothing was unread: the step is only sent
    assert sessions.commands[-1] == ("sampled_step", [(1, 3)]) and batch.first_unread and batch.unread
    out = batch.step(StepPlan(join=(second.id,)))  # sent with the first row's own sample, then step 1 read
    assert sessions.commands[-1] == ("sampled_step", [(1, EVAL_PENDING), (2, 7)])
    assert out.rows == [first] and out.results[0].tokens == [4] and not out.verify
    assert first.fed_all and second.fed_all and batch.running == [first, second]
    # Read ahead (a prompt waits): step 2's tokens now; the next step sends them itself.
    out = batch.read_ahead()
    assert [r.tokens for r in out.results] == [[5], [8]] and not first.fed_all
    assert batch.read_ahead() is None
    batch.remove(second.id)
    assert batch.step() is None
    assert sessions.commands[-1] == ("sampled_step", [(1, 5)])
    assert batch.stats["decode_steps"] == 3 and batch.stats["decode_batch_rows"] == 2
    assert batch.stats["prefilled_tokens"] == 2  # each joining row's last prompt token


def test_a_lone_row_with_its_last_token_in_flight_is_read_without_another_step():
    batch, sessions = fake_batch()
    lone = _row(batch, [3], max_tokens=2)
    assert batch.step(StepPlan(join=(lone.id,))) is None
    assert not batch.all_in_flight()
    assert batch.step().results[0].tokens == [4]  # step 2 (its last token) sent, step 1 read
    assert batch.all_in_flight()  # the caller reads ahead rather than send a step
    out = batch.read_ahead()
    assert out.results[0].tokens == [5] and sessions.kinds().count("sampled_step") == 2


def test_a_stepped_batch_decodes_the_rows_the_plan_joins():
    batch, sessions = fake_batch(LOOKUP)
    rows = [_row(batch, [10 + i]) for i in (1, 2, 3)]
    out = batch.step(StepPlan(join=(rows[0].id, rows[1].id)))
    assert out.rows == rows[:2] and batch.running == rows[:2]
    assert [r.tokens for r in out.results] == [[12], [13]]  # the leader's own greedy sampling
    assert sessions.commands[-1] == ("step", [(1, 11), (2, 12)])


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
    batch, sessions = fake_batch(LOOKUP)
    drafting, plain = _row(batch, [3]), _row(batch, [9])
    drafting.drafter, plain.drafter = _Drafter(), None
    out = batch.step(StepPlan(join=(drafting.id, plain.id), drafts=((drafting.id, 2),)))
    assert sessions.commands[-1] == ("verify", [(1, [3, 4, 0]), (2, [9])])
    assert out.verify and [r.tokens for r in out.results] == [[4, 5], [10]]
    assert drafting.drafter.kept == [(2, 1)]
    assert batch.stats["drafted_tokens"] == 2 and batch.stats["accepted_tokens"] == 1
    batch.commit(out, [2, 1])
    assert sessions.commands[-1] == ("commit", [2, 1])
    # A plan with no drafts for it: the row decodes one token, and nothing is committed.
    out = batch.step()
    assert sessions.commands[-1][0] == "step" and not out.verify
    batch.commit(out, [1, 1])
    assert sessions.commands[-1][0] == "step"


def test_a_sampled_request_drafts_too():
    """Speculation takes sampled sessions (lockstep/sampling/acceptance.py keeps their distribution);
    a logprobs request and one that asks for no drafts decode a token a step."""
    from mlx_ds4tp.lockstep.sampling.options import SamplingOptions

    batch, _ = fake_batch(LOOKUP)
    sampled = batch.insert(Request([1, 2, 1], 8, SamplingOptions(temperature=0.8, seed=3)))
    logprobs = batch.insert(Request([1, 2, 1], 8, logprobs=2))
    no_drafts = batch.insert(Request([1, 2, 1], 8, num_draft_tokens=0))
    assert batch.row(sampled).drafter is not None
    assert batch.row(logprobs).drafter is None and batch.row(no_drafts).drafter is None


def test_a_mixed_step_carries_the_planned_prompt_chunks_beside_the_decode_rows():
    batch, sessions = fake_batch(mixed_prefill=True)
    decoding, prompt = _row(batch, [3]), _row(batch, [20, 21, 22, 23])
    assert not batch.pipelined and prompt.todo == [20, 21, 22]
    out = batch.step(StepPlan(join=(decoding.id,), enter=(prompt.id,), chunks=((prompt.id, 2),)))
    assert sessions.commands[-1] == ("verify", [(1, [3]), (2, [20, 21])])
    assert out.results[0].tokens == [4] and (out.results[1].tokens, out.results[1].chunk) == ([], 2)
    assert prompt.todo == [22] and batch.running == [decoding, prompt]
    # A row still prefilling with no chunk planned is the caller's mistake, named.
    with pytest.raises(ValueError, match=r"rows \[2\] still prefill"):
        batch.step()
    # The prompt's last chunk, one token: a plain step; it decodes from the next one.
    out = batch.step(StepPlan(chunks=((prompt.id, 1),)))
    assert sessions.commands[-1] == ("step", [(1, 4), (2, 22)]) and out.results[1].chunk == 1
    assert prompt.todo == [] and batch.stats["mixed_steps"] == 2
    # The decode row joining (its last prompt token), the chunks, and the prompt's last token.
    assert batch.stats["prefilled_tokens"] == 1 + 2 + 1 + 1
