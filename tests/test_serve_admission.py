"""serve.engine.admission on its own: the KV budget, the waiting queue and the prompt-cache index,
over recorded sessions (no pair)."""

from __future__ import annotations

import pytest

from engine_fakes import FakeSessions, FakeTokenizer, fake_batch
from mlx_ds4tp.serve.engine.admission import Admission
from mlx_ds4tp.serve.engine.events import BusyEvent, PairDownEvent
from mlx_ds4tp.serve.engine.generation import Request
from mlx_ds4tp.serve.limits import ServeLimits


def _admission(**limits):
    batch, sessions = fake_batch()
    return Admission(batch, FakeTokenizer(), ServeLimits(**limits)), sessions


def _kinds(sessions) -> list:
    """The commands sent, less the samplers each new session's comes with (lockstep.batch)."""
    return [c[0] for c in sessions.commands if c[0] != "sampler"]


def _events(request) -> list:
    out = []
    while not request.events.empty():
        out.append(request.events.get_nowait())
    return out


def test_requests_start_in_order_while_the_budget_has_room():
    admission, sessions = _admission(kv_budget=30)
    first, second, third = Request([1, 2, 3], 7), Request([4, 5], 19), Request([6], 1)
    (running,) = admission.offer(first)
    assert running.request is first and admission.reserved == 10
    assert admission.offer(second) == []  # 10 + 21 > 30: it waits
    assert admission.offer(third) == []  # it would fit, but waits behind the head
    assert list(admission.waiting) == [second, third]
    assert admission.start_waiting() == []  # nothing ended: still no room
    assert _kinds(sessions) == ["create"]
    # The first ends: its reservation goes back, and both waiting ones start, in order.
    admission.close(running, None)
    assert [s.request for s in admission.start_waiting()] == [second, third]
    assert admission.reserved == 21 + 2 and not admission.waiting
    assert _kinds(sessions) == ["create", "destroy", "create", "create"]


def test_a_request_past_the_whole_budget_is_refused_by_name():
    admission, _ = _admission(kv_budget=10)
    with pytest.raises(ValueError, match="--max-kv-tokens 10"):
        admission.check(Request([1, 2, 3], 8))
    admission.check(Request([1, 2], 8))  # exactly the budget fits


def test_past_max_queued_the_newest_is_busy_and_cancelled_waiters_are_skipped():
    admission, _ = _admission(kv_budget=10, max_queued=2)
    (running,) = admission.offer(Request([1], 9))
    waiting = [Request([2], 5), Request([3], 5)]
    for request in waiting:
        assert admission.offer(request) == []
    late = Request([4], 5)
    assert admission.offer(late) == []
    (event,) = _events(late)
    assert isinstance(event, BusyEvent) and "--max-queued 2" in event.reason
    assert list(admission.waiting) == waiting
    waiting[0].cancelled = True
    admission.close(running, None)
    assert [s.request for s in admission.start_waiting()] == [waiting[1]]
    assert not admission.waiting and admission.reserved == 6


def test_an_ended_sessions_cache_is_stored_and_a_longer_prompt_reuses_it():
    admission, sessions = _admission()
    (running,) = admission.offer(Request([1, 2, 3, 4], 3))
    assert running.todo == [1, 2, 3]  # the last prompt token is the first decode input
    admission.close(running, [1, 2, 3, 4, 5, 6])
    assert sessions.commands[-1] == ("destroy", running.sid, 1)
    again = Request([1, 2, 3, 4, 5, 6, 7, 8], 2)
    (reused,) = admission.offer(again)
    assert again.cached_tokens == 6 and reused.todo == [7]
    assert [c for c in sessions.commands if c[0] == "create"][-1][:3] == ("create", reused.sid, 1)
    assert admission.stats == {"requests": 2, "cached_tokens": 6}


def test_the_index_bounds_evict_stored_caches_on_both_ranks():
    admission, sessions = _admission(prompt_cache_size=1)
    for prompt in ([1, 2, 3], [7, 8, 9]):
        (running,) = admission.offer(Request(prompt, 2))
        admission.close(running, prompt + [0])
    assert ("invalidate", 1) in sessions.commands and list(sessions.table.caches.stored) == [2]
    assert len(admission.index) == 1


def test_the_pair_going_down_reaches_every_request_under_way_or_waiting():
    admission, _ = _admission(kv_budget=10)
    under_way, waiting = Request([1], 9), Request([2], 5)
    admission.offer(under_way)
    admission.offer(waiting)
    admission.fail("the worker closed the connection")
    for request in (under_way, waiting):
        assert _events(request) == [PairDownEvent("the worker closed the connection")]
    assert admission.reserved == 0 and not admission.waiting
    admission.fail("again")  # nobody is left to tell
    assert _events(under_way) == []


def test_renewed_admission_starts_from_an_empty_index():
    admission, _ = _admission()
    (running,) = admission.offer(Request([1, 2, 3], 2))
    admission.close(running, [1, 2, 3, 4])
    fresh = FakeSessions()
    admission.batch.clear(fresh)  # as Engine.resume does
    admission.renew()
    request = Request([1, 2, 3, 4, 5], 2)
    admission.offer(request)
    assert request.cached_tokens == 0 and fresh.commands[0][2:] == (0, 0)
