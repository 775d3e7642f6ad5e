"""serve.engine.loop on its own: the thin loop that wires admission, prefill, decoding and
finishing, its thread, failure and resume, over recorded sessions whose model continues t
with t + 1 (engine_fakes)."""

from __future__ import annotations

import pytest

from engine_fakes import FakeSessions, FakeTokenizer, letters
from mlx_ds4tp.lockstep.request import GenerationRequest as Request
from mlx_ds4tp.serve.engine.events import ENDING_EVENTS, PairDownEvent, StartedEvent, TextEvent
from mlx_ds4tp.serve.engine.loop import Engine
from mlx_ds4tp.serve.errors import PairUnavailableError
from mlx_ds4tp.serve.limits import ServeLimits


def _events(request) -> list:
    events = []
    while not events or not isinstance(events[-1], ENDING_EVENTS):
        events.append(request.events.get(timeout=30))
    return events


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextEvent))


@pytest.mark.parametrize("limits", [ServeLimits(prefill_step=4), ServeLimits(mixed_prefill=2, mixed_when="always")],
                         ids=["pipelined", "mixed"])
def test_requests_get_the_models_continuation_and_end_their_sessions(limits):
    sessions = FakeSessions()
    engine = Engine(sessions, FakeTokenizer(), limits)
    engine.start()
    try:
        requests = [engine.submit(r) for r in (Request(list(range(1, 12)), 5), Request([20], 9), Request([2, 3], 3))]
        texts = [_text(_events(r)) for r in requests]
        # Token 25 is the eos: the second stops at it.
        assert texts == [letters(range(12, 17)), letters(range(21, 25)), letters(range(4, 7))]
        assert engine.alive() and engine.error is None
        stats = engine.stats
        assert stats["requests"] == 3 and stats["generated_tokens"] == 5 + 5 + 3
        # Every prompt token is computed once: the prefill or the decode steps took each in.
        assert stats["prefilled_tokens"] == 11 + 1 + 2
        counts = engine.counts()
        assert counts["decoding"] == counts["prefilling"] == counts["queued"] == 0
        assert counts["kv_reserved_tokens"] == 0 and counts["prompt_cache_entries"] == 3
    finally:
        engine.stop()
    assert sessions.commands[-1] == ("stop",)


def test_the_pair_going_down_fails_everyone_and_resume_serves_again():
    sessions = FakeSessions()
    engine = Engine(sessions, FakeTokenizer(), ServeLimits())
    sessions.gone = "the worker closed the connection"
    engine.start()
    assert engine.wait_down(10)
    assert "the worker closed the connection" in engine.error and not engine.alive()
    assert sessions.commands[-1][0] == "abort"
    with pytest.raises(PairUnavailableError):
        engine.submit(Request([1], 2))
    fresh = FakeSessions()
    engine.resume(fresh)
    try:
        request = engine.submit(Request([1, 2], 2))
        assert _text(_events(request)) == letters([3, 4]) and engine.error is None
        with pytest.raises(RuntimeError, match="this one is up"):
            engine.resume(FakeSessions())
    finally:
        engine.stop()


def test_a_step_that_fails_reaches_every_request_under_way():
    class Failing(FakeSessions):
        def sampled_step(self, rows):
            raise ConnectionError("gates failed")

    sessions = Failing()
    engine = Engine(sessions, FakeTokenizer(), ServeLimits())
    requests = [engine.submit(Request([1], 4)), engine.submit(Request([2], 4))]
    engine.start()
    try:
        for request in requests:
            assert _events(request)[-1] == PairDownEvent("ConnectionError: gates failed")
    finally:
        engine.stop()


def test_a_request_the_budget_cannot_hold_is_refused_before_it_queues():
    engine = Engine(FakeSessions(), FakeTokenizer(), ServeLimits(kv_budget=8))
    with pytest.raises(ValueError, match="--max-kv-tokens 8"):
        engine.submit(Request([1, 2, 3], 6))
    assert engine.queued() == 0


def test_a_pause_lets_the_requests_under_way_finish_and_keeps_the_queue_for_the_next_group():
    """serve/resize.py's grow: pause() admits nothing more, ends the loop once nothing is under
    way (the request running finished whole, no error to anyone), the requests sent meanwhile
    wait, alive, and resume() over the next group serves them."""
    class Fake(FakeSessions):
        grammars = None  # what drop_sessions keeps of the old group's (LeaderSessions has both)

    sessions = Fake()
    engine = Engine(sessions, FakeTokenizer(), ServeLimits())
    engine.start()
    try:
        running = engine.submit(Request([1, 2], 6))
        assert isinstance(running.events.get(timeout=30), StartedEvent)
        engine.pause()
        waiting = engine.submit(Request([3], 3))  # queued, not refused
        assert _text(_events(running)) == letters(range(3, 9))
        assert engine.paused(30) and engine.alive() and engine.error is None
        assert waiting.events.empty() and engine.queued() == 1
        engine.drop_sessions()  # the old group's part let go before the next loads
        engine.resume(FakeSessions())
        assert _text(_events(waiting)) == letters(range(4, 7)) and engine.error is None
    finally:
        engine.stop()


def test_a_paused_engine_whose_next_group_does_not_form_fails_its_queue():
    engine = Engine(FakeSessions(), FakeTokenizer(), ServeLimits())
    engine.start()
    engine.pause()
    assert engine.paused(30)
    waiting = engine.submit(Request([3], 3))
    engine.give_up("the group of 3 did not form")
    assert _events(waiting)[-1] == PairDownEvent("the group of 3 did not form")
    assert not engine.alive() and engine.wait_down(0)
    with pytest.raises(PairUnavailableError):
        engine.submit(Request([1], 2))
    engine.resume(FakeSessions())
    try:
        assert _text(_events(engine.submit(Request([1, 2], 2)))) == letters([3, 4])
    finally:
        engine.stop()


def test_an_engine_unpaused_serves_on_its_queue_over_the_same_group():
    engine = Engine(FakeSessions(), FakeTokenizer(), ServeLimits())
    engine.start()
    try:
        engine.pause()
        assert engine.paused(30)
        waiting = engine.submit(Request([1, 2], 2))
        engine.unpause()  # the rank at the door left: no grow
        assert _text(_events(waiting)) == letters([3, 4]) and engine.error is None
    finally:
        engine.stop()
