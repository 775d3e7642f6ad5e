"""serve.engine.finishing on its own: a step's output into its sessions (text events, finish reasons,
positions used) and the finished sessions ended, their caches stored, over recorded sessions."""

from __future__ import annotations

from engine_fakes import EOS, FakeTokenizer, fake_batch
from mlx_ds4tp.serve.engine.admission import Admission
from mlx_ds4tp.serve.engine.events import DoneEvent, FailedEvent, TextEvent
from mlx_ds4tp.serve.engine.finishing import Finishing
from mlx_ds4tp.serve.engine.generation import Request, RowResult, StepOutput
from mlx_ds4tp.serve.limits import ServeLimits


def _setup(*requests):
    batch, sessions = fake_batch()
    admission = Admission(batch, FakeTokenizer(), ServeLimits())
    running = [s for r in requests for s in admission.offer(r)]
    return Finishing(admission, FakeTokenizer()), admission, sessions, running


def _events(request) -> list:
    out = []
    while not request.events.empty():
        out.append(request.events.get_nowait())
    return out


def _settle(finishing, out):
    outcomes = finishing.advance(out)
    return outcomes, finishing.end(out, outcomes)


def test_eos_length_and_running_rows():
    stopping, long, running = Request([1], 5), Request([2], 2), Request([3], 9)
    finishing, admission, sessions, rows = _setup(stopping, long, running)
    out = StepOutput(rows, [RowResult([4, EOS, 6]), RowResult([7, 8, 9]), RowResult([10])])
    outcomes, ended = _settle(finishing, out)
    assert [(o.finish, o.used) for o in outcomes] == [("stop", 2), ("length", 2), (None, 1)]
    assert ended == rows[:2]
    assert _events(stopping) == [TextEvent("e"), DoneEvent("stop")]
    assert _events(long) == [TextEvent("h"), TextEvent("i"), DoneEvent("length")]
    assert _events(running) == [TextEvent("k")]
    # Each finished cache is stored under the tokens it holds: the prompt and every token but
    # the last, which was never fed in.
    stored = [c for c in sessions.commands if c[0] == "destroy"]
    assert [c[2] for c in stored] == [1, 2]
    assert admission.index.lookup([1, 4, 9]).keep == 2 and admission.index.lookup([2, 7, 9]).keep == 2
    assert finishing.stats == {"generated_tokens": 5} and admission.reserved == 10


def test_a_pipelined_sessions_cache_holds_its_last_token_too():
    request = Request([1, 2], 1)
    finishing, admission, _, rows = _setup(request)
    rows[0].row.fed_all = True  # as the batch leaves a row a pipelined step took its token in
    _settle(finishing, StepOutput(rows, [RowResult([3])]))
    assert admission.index.lookup([1, 2, 3, 4]).keep == 3


def test_stop_strings_failures_and_cancels_end_their_rows_alone():
    stopped = Request([1], 9, stop=["cd"])
    failed, cancelled, chunk = Request([2], 9), Request([3], 9), Request([4, 5, 6, 7], 9)
    finishing, admission, sessions, rows = _setup(stopped, failed, cancelled, chunk)
    cancelled.cancelled = True
    out = StepOutput(rows, [RowResult([1, 2, 3, 4]), RowResult(None, "sampling failed: boom"),
                            RowResult([5]), RowResult([], chunk=2)], verify=True)
    outcomes, ended = _settle(finishing, out)
    assert [(o.finish, o.used) for o in outcomes] == [("stop", 3), ("failed", 1), ("cancelled", 1), (None, 2)]
    assert ended == rows[:3]
    assert _events(stopped) == [TextEvent("b"), DoneEvent("stop")]  # "cd" is never sent
    assert _events(failed) == [FailedEvent("sampling failed: boom")]
    assert _events(cancelled) == [TextEvent("f")] and _events(chunk) == []
    # Failed and cancelled sessions are dropped, not stored.
    assert [c[2] for c in sessions.commands if c[0] == "destroy"] == [1, 0, 0]
    assert len(admission.index) == 1


def test_a_text_failure_fails_that_request_alone():
    class Broken(FakeTokenizer):
        def decode(self, tokens):
            raise UnicodeError("no text for it")

    bad, good = Request([1], 5, logprobs=2), Request([2], 5)
    finishing, _, _, rows = _setup(bad, good)
    finishing.tokenizer = Broken()
    import mlx.core as mx

    drawn_from = mx.zeros((26,))
    outcomes, ended = _settle(finishing, StepOutput(rows, [RowResult([3], logprobs=drawn_from),
                                                           RowResult([4])]))
    assert outcomes[0].finish == "failed" and "no text for it" in outcomes[0].error
    assert ended == [rows[0]] and isinstance(_events(bad)[-1], FailedEvent) and _events(good) == [TextEvent("e")]
