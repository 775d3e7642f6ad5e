"""serve.engine.schedule on its own: plan_turn's decisions as frozen plans, from turn states built
by hand (rows without a model or a pair): admission under the KV budget, the queue's bound,
prefill chunking, the mixed-prefill choice, the drafts, the ends; and Engine.cancel from another
thread ending a request once (over recorded sessions, engine_fakes)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from engine_fakes import FakeSessions, FakeTokenizer
from mlx_ds4tp.lockstep.batch import NO_REUSE, Row, StepPlan
from mlx_ds4tp.lockstep.request import GenerationRequest as Request
from mlx_ds4tp.lockstep.settings import DraftSettings
from mlx_ds4tp.lockstep.speculative import Speculation
from mlx_ds4tp.serve.engine.events import ENDING_EVENTS, TextEvent
from mlx_ds4tp.serve.engine.loop import Engine
from mlx_ds4tp.serve.engine.mixing import MixEstimates
from mlx_ds4tp.serve.engine.schedule import Queued, ScheduleLimits, TurnPlan, TurnState, plan_turn
from mlx_ds4tp.serve.limits import ServeLimits


def _row(rid: int, prompt_len: int = 1, max_tokens: int = 8, drafter=None) -> Row:
    """A row whose prompt has prompt_len tokens (prompt_len - 1 still to prefill)."""
    return Row(rid, Request(tuple(range(1, prompt_len + 1)), max_tokens), NO_REUSE, None, drafter)


def test_admission_takes_the_oldest_while_the_budget_has_room_and_the_rest_wait_behind():
    limits = ScheduleLimits(kv_budget=30)
    waiting = (Queued(1, 10), Queued(2, 21), Queued(3, 2))
    assert plan_turn(TurnState(waiting), limits).admit == (1,)  # 10 + 21 > 30: 2 waits, 3 behind it
    assert plan_turn(TurnState(waiting[1:], reserved=10), limits).admit == ()
    assert plan_turn(TurnState(waiting[1:], reserved=8), limits).admit == (2,)  # 8 + 21 + 2 > 30
    assert plan_turn(TurnState(waiting[1:], reserved=7), limits).admit == (2, 3)
    assert plan_turn(TurnState(waiting), ScheduleLimits()).admit == (1, 2, 3)  # no budget: all start
    # A turn that admits plans nothing else: the next one plans the admitted rows with the rest.
    busy = TurnState(waiting, running=(_row(7),), prefilling=(_row(8, 5),), unread=True)
    assert plan_turn(busy, limits) == TurnPlan(admit=(1,))
    plan = plan_turn(TurnState(waiting), limits)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.admit = ()  # a plan is a value


def test_past_max_queued_the_newest_are_refused_and_cancelled_waiters_are_dropped():
    limits = ScheduleLimits(kv_budget=10, max_queued=2)
    waiting = (Queued(1, 5, cancelled=True), Queued(2, 5), Queued(3, 5), Queued(4, 5), Queued(5, 5))
    plan = plan_turn(TurnState(waiting, reserved=10), limits)
    assert (plan.drop, plan.admit, plan.refuse) == ((1,), (), (4, 5))
    # A cancelled row frees its reservation for this very turn's admission.
    cancelled = _row(9, max_tokens=9)
    cancelled.cancelled = True
    plan = plan_turn(TurnState(waiting[1:2], reserved=10, running=(cancelled,)), limits)
    assert plan.end == (9,) and plan.admit == (2,) and plan.step is None


def test_the_oldest_prompts_share_one_forward_of_at_most_prefill_step_tokens():
    limits = ScheduleLimits(prefill_step=12, prompt_concurrency=3)
    rows = (_row(1, 13), _row(2, 3), _row(3, 7), _row(4, 5))
    plan = plan_turn(TurnState(prefilling=rows), limits)
    # Three rows share 12 tokens: 4 each, the short prompt (2 to prefill) only what it needs;
    # it finishes its prefill, so it joins this turn's step.
    assert plan.prefill == ((1, 4), (2, 2), (3, 4))
    assert plan.step == StepPlan(join=(2,))
    # A long prompt alone: a chunk a turn.
    plan = plan_turn(TurnState(prefilling=(_row(1, 12),)), ScheduleLimits(prefill_step=4))
    assert plan.prefill == ((1, 4),) and plan.step is None


def test_the_batch_takes_at_most_max_batch_rows():
    limits = ScheduleLimits(max_batch=2)
    plan = plan_turn(TurnState(ready=(_row(2), _row(3)), running=(_row(1),)), limits)
    assert plan.step.join == (2,)


def test_a_pipelined_batch_reads_ahead_for_a_waiting_prompt_and_sends_nothing_all_in_flight():
    prompt, running = _row(2, 5), _row(1)
    plan = plan_turn(TurnState(prefilling=(prompt,), running=(running,), unread=True), ScheduleLimits())
    assert plan.read_ahead and plan.prefill == ((2, 4),) and plan.step == StepPlan(join=(2,))
    plan = plan_turn(TurnState(running=(running,), unread=True, first_unread=True), ScheduleLimits())
    assert plan.read_ahead and plan.step == StepPlan()  # a first token is not held back
    plan = plan_turn(TurnState(running=(running,), unread=True, all_in_flight=True), ScheduleLimits())
    assert plan == TurnPlan(read_ahead=True)


def test_mixed_prefill_carries_prompts_in_the_decode_step_when_it_is_cheaper():
    limits = ScheduleLimits(mixed_prefill=2, max_batch=3)
    running, prompts = (_row(1),), (_row(2, 6), _row(3, 6), _row(4, 6))
    always = MixEstimates(policy="always")
    plan = plan_turn(TurnState(prefilling=prompts, running=running, pipelined=False, mix=always), limits)
    # Two free rows: the two oldest prompts enter, 2 tokens each; nothing prefills on its own.
    assert plan.prefill == () and plan.step == StepPlan(enter=(2, 3), chunks=((2, 2), (3, 2)))
    cheaper = MixEstimates(separate_per_token=5e-4, mixed_per_token=5e-5, decode_timed=True, decisions=1)
    dearer = dataclasses.replace(cheaper, mixed_per_token=5e-3)
    assert plan_turn(TurnState(prefilling=prompts, running=running, mix=cheaper), limits).step.enter == (2, 3)
    plan = plan_turn(TurnState(prefilling=prompts, running=running, mix=dearer), limits)
    assert plan.mix_decided and plan.step.enter == () and plan.prefill
    # Nothing measured yet: the separate forward is measured first; a full batch has no row for a prompt.
    assert not plan_turn(TurnState(prefilling=prompts, running=running, mix=MixEstimates()), limits).step.enter
    full = (_row(5), _row(6), _row(7))
    assert plan_turn(TurnState(prefilling=prompts, running=full, mix=always), limits).step.enter == ()
    # A row that entered earlier carries its next chunk whatever this turn chose.
    entered = _row(8, 6)
    plan = plan_turn(TurnState(running=(entered,), pipelined=False, mix=always), limits)
    assert plan.step.chunks == ((8, 2),)


def test_drafting_rows_draft_at_most_one_less_than_they_may_still_generate():
    speculation = Speculation(DraftSettings(prompt_lookup=1, num_draft_tokens=3))
    drafter = object()
    rows = (_row(1, drafter=drafter), _row(2), _row(3, max_tokens=2, drafter=drafter),
            _row(4, max_tokens=1, drafter=drafter))
    no_drafts = Row(5, Request((1,), 8, num_draft_tokens=1), NO_REUSE, None, drafter)
    plan = plan_turn(TurnState(running=rows + (no_drafts,), pipelined=False, speculation=speculation),
                     ScheduleLimits())
    # Row 2 has no drafter; row 4 has one token left: a round yields one more than it keeps.
    assert plan.step.drafts == ((1, 3), (3, 1), (5, 1))


def test_cancelled_rows_end_wherever_they_are():
    rows = [_row(i, 4) for i in (1, 2, 3)]
    for row in rows:
        row.cancelled = True
    plan = plan_turn(TurnState(prefilling=(rows[0],), ready=(rows[1],), running=(rows[2],), unread=True),
                     ScheduleLimits())
    assert plan.end == (1, 2, 3) and plan.prefill == () and plan.step is None and not plan.read_ahead


def test_cancel_from_another_thread_ends_the_request_once():
    class NoEos(FakeTokenizer):
        eos_token_ids = []  # the request cannot end by itself before the cancel

    sessions = FakeSessions()
    engine = Engine(sessions, NoEos(), ServeLimits())
    engine.start()
    try:
        ticket = engine.submit(Request([1], 10_000))
        first = ticket.events.get(timeout=30)
        while not isinstance(first, TextEvent):
            first = ticket.events.get(timeout=30)
        cancels = [threading.Thread(target=engine.cancel, args=(ticket.id,)) for _ in range(2)]
        for thread in cancels:
            thread.start()
        for thread in cancels:
            thread.join()
        deadline = time.monotonic() + 30
        while engine.counts()["decoding"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.counts()["decoding"] == 0 and engine.counts()["kv_reserved_tokens"] == 0
        destroys = [c for c in sessions.commands if c[0] == "destroy"]
        assert destroys == [("destroy", 1, 0)]  # ended once, its cache not stored
        while not ticket.events.empty():
            assert not isinstance(ticket.events.get_nowait(), ENDING_EVENTS)  # nobody is answered
        engine.cancel(ticket.id)  # long over: nothing happens
        again = engine.submit(Request([2], 2))
        texts = []
        while not texts or not isinstance(texts[-1], ENDING_EVENTS):
            texts.append(again.events.get(timeout=30))
        assert engine.alive()
    finally:
        engine.stop()
