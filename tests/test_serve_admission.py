"""serve.engine.admission on its own: what starting, refusing and ending a request does (the KV
reservation, the session on both ranks, the prompt-cache index), over recorded sessions (no
pair). Who starts, waits or is refused is the scheduler's: tests/test_serve_schedule.py."""

from __future__ import annotations

import itertools

import pytest

from engine_fakes import FakeSessions, fake_batch
from mlx_ds4tp.lockstep.request import GenerationRequest as Request
from mlx_ds4tp.serve.engine.admission import Admission
from mlx_ds4tp.serve.engine.events import BusyEvent, PairDownEvent, StartedEvent
from mlx_ds4tp.serve.engine.generation import Ticket
from mlx_ds4tp.serve.limits import ServeLimits

_IDS = itertools.count(1)


def _admission(**limits):
    batch, sessions = fake_batch()
    return Admission(batch, ServeLimits(**limits)), sessions


def _events(ticket) -> list:
    out = []
    while not ticket.events.empty():
        out.append(ticket.events.get_nowait())
    return out


def _queued(admission, *requests) -> list:
    tickets = [Ticket(next(_IDS), r) for r in requests]
    for ticket in tickets:
        admission.queue(ticket)
    return tickets


def test_a_started_request_reserves_its_tokens_until_its_session_ends():
    admission, sessions = _admission(kv_budget=30)
    first, second = _queued(admission, Request([1, 2, 3], 7), Request([4, 5], 19))
    row = admission.start(first.id)
    assert row.request is first.request and admission.reserved == 10
    assert list(admission.waiting) == [second.id] and admission.row_of == {first.id: row.id}
    assert _events(first) == [StartedEvent(0)]
    admission.close(row, None)
    assert admission.reserved == 0 and not admission.started and not admission.row_of
    assert [c[0] for c in sessions.commands if c[0] != "sampler"] == ["create", "destroy"]


def test_a_request_past_the_whole_budget_is_refused_by_name():
    admission, _ = _admission(kv_budget=10)
    with pytest.raises(ValueError, match="--max-kv-tokens 10"):
        admission.check(Request([1, 2, 3], 8))
    admission.check(Request([1, 2], 8))  # exactly the budget fits


def test_a_refused_request_is_told_busy_and_a_dropped_one_nothing():
    admission, _ = _admission(kv_budget=10, max_queued=2)
    refused, dropped = _queued(admission, Request([4], 5), Request([5], 5))
    admission.refuse(refused.id)
    admission.drop(dropped.id)
    (event,) = _events(refused)
    assert isinstance(event, BusyEvent) and "--max-queued 2" in event.reason
    assert _events(dropped) == [] and not admission.waiting


def test_an_ended_sessions_cache_is_stored_and_a_longer_prompt_reuses_it():
    admission, sessions = _admission()
    (first,) = _queued(admission, Request([1, 2, 3, 4], 3))
    row = admission.start(first.id)
    assert row.todo == [1, 2, 3]  # the last prompt token is the first decode input
    admission.close(row, [1, 2, 3, 4, 5, 6])
    assert sessions.commands[-1] == ("destroy", row.id, 1)
    (again,) = _queued(admission, Request([1, 2, 3, 4, 5, 6, 7, 8], 2))
    reused = admission.start(again.id)
    assert _events(again) == [StartedEvent(6)] and reused.todo == [7]
    assert [c for c in sessions.commands if c[0] == "create"][-1][:3] == ("create", reused.id, 1)
    assert admission.stats == {"requests": 2, "cached_tokens": 6}


def test_the_index_bounds_evict_stored_caches_on_both_ranks():
    admission, sessions = _admission(prompt_cache_size=1)
    for prompt in ([1, 2, 3], [7, 8, 9]):
        (ticket,) = _queued(admission, Request(prompt, 2))
        admission.close(admission.start(ticket.id), prompt + [0])
    assert ("invalidate", 1) in sessions.commands and list(sessions.table.caches.stored) == [2]
    assert len(admission.index) == 1


def test_the_pair_going_down_reaches_every_request_under_way_or_waiting():
    admission, _ = _admission(kv_budget=10)
    under_way, waiting = _queued(admission, Request([1], 9), Request([2], 5))
    admission.start(under_way.id)
    _events(under_way)
    admission.fail("the worker closed the connection")
    for ticket in (under_way, waiting):
        assert _events(ticket) == [PairDownEvent("the worker closed the connection")]
    assert admission.reserved == 0 and not admission.waiting
    admission.fail("again")  # nobody is left to tell
    assert _events(under_way) == []


def test_renewed_admission_starts_from_an_empty_index():
    admission, _ = _admission()
    (first,) = _queued(admission, Request([1, 2, 3], 2))
    admission.close(admission.start(first.id), [1, 2, 3, 4])
    fresh = FakeSessions()
    admission.batch.clear(fresh)  # as Engine.resume does
    admission.renew()
    (again,) = _queued(admission, Request([1, 2, 3, 4, 5], 2))
    admission.start(again.id)
    assert _events(again) == [StartedEvent(0)] and fresh.commands[0][2:] == (0, 0)
