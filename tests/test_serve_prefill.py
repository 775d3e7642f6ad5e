"""serve.engine.prefill on its own: which prompts share a padded forward, how the chunk is shared,
when a turn mixes, over recorded sessions (no pair)."""

from __future__ import annotations

import pytest

from engine_fakes import FakeTokenizer, fake_batch
from mlx_ds4tp.lockstep.caches.prompt_cache import Reuse
from mlx_ds4tp.serve.engine.generation import Request, RunningSession, batch_request
from mlx_ds4tp.serve.engine.prefill import PrefillScheduler
from mlx_ds4tp.serve.limits import ServeLimits


def _scheduler(*lengths, **limits):
    batch, sessions = fake_batch()
    scheduler = PrefillScheduler(batch, ServeLimits(**limits))
    for n in lengths:
        request = Request(list(range(1, n + 1)), 4)
        scheduler.add(RunningSession(batch.row(batch.insert(batch_request(request, Reuse(), 0))), request,
                                     FakeTokenizer()))
    sessions.commands.clear()  # the sessions made; the prefill's commands follow
    return scheduler, sessions


def test_the_oldest_prompts_share_one_forward_of_at_most_prefill_step_tokens():
    scheduler, sessions = _scheduler(13, 3, 7, 5, prefill_step=12, prompt_concurrency=3)
    # Three rows share 12 tokens: 4 each, the short prompt (2 to prefill) only what it needs.
    assert [s.sid for s in scheduler.chunk()] == [2]
    (kind, rows), = sessions.commands
    assert kind == "prefill" and [(s, len(t)) for s, t in rows] == [(1, 4), (2, 2), (3, 4)]
    assert [s.sid for s in scheduler.queue] == [1, 3, 4]
    done = scheduler.chunk()
    assert [(s, len(t)) for s, t in sessions.commands[-1][1]] == [(1, 4), (3, 2), (4, 4)]
    assert [s.sid for s in done] == [3, 4] and all(not s.todo for s in done)
    assert scheduler.stats == {"prefilled_tokens": 20, "prefill_batches": 2, "prefill_batch_rows": 3,
                               "prefill_padded_tokens": 12}


def test_a_long_prompt_is_prefilled_a_chunk_a_turn():
    scheduler, sessions = _scheduler(11, prefill_step=4)
    turns = 0
    while scheduler.queue:
        scheduler.chunk()
        turns += 1
    assert turns == 3 and [len(c[1][0][1]) for c in sessions.commands] == [4, 4, 2]


def test_cancelled_prompts_leave_and_a_mixed_step_takes_the_oldest():
    scheduler, _ = _scheduler(5, 5, 5, 5, mixed_prefill=2, mixed_when="always")
    scheduler.queue[1].request.cancelled = True
    assert [s.sid for s in scheduler.take_cancelled()] == [2]
    assert scheduler.mixes(batch_has_room=True) and not scheduler.mixes(batch_has_room=False)
    assert [s.sid for s in scheduler.hand_over(2)] == [1, 3]
    assert [s.sid for s in scheduler.queue] == [4]


def test_without_mixed_prefill_no_turn_mixes_and_a_bad_policy_is_named():
    scheduler, _ = _scheduler(5, mixed_when="always")
    assert not scheduler.mixes(batch_has_room=True)
    with pytest.raises(ValueError, match="'sometimes'"):
        PrefillScheduler(fake_batch()[0], ServeLimits(mixed_prefill=4, mixed_when="sometimes"))
