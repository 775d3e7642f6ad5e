"""serve.engine.finishing on its own: a step's output into its rows' answers (text events with the
tokens counted, finish reasons, positions used) and the finished rows ended, their caches stored,
over recorded sessions."""

from __future__ import annotations

from engine_fakes import EOS, FakeTokenizer, fake_batch
from mlx_ds4tp.lockstep.batch import RowResult, StepOutput
from mlx_ds4tp.lockstep.request import GenerationRequest as Request
from mlx_ds4tp.serve.engine.admission import Admission
from mlx_ds4tp.serve.engine.events import DoneEvent, FailedEvent, StartedEvent, TextEvent
from mlx_ds4tp.serve.engine.finishing import Finishing
from mlx_ds4tp.serve.engine.generation import Ticket
from mlx_ds4tp.serve.limits import ServeLimits


def _setup(*requests):
    """Every request started (its row), and the tickets their events go to."""
    batch, sessions = fake_batch()
    admission = Admission(batch, ServeLimits())
    finishing = Finishing(admission, FakeTokenizer())
    tickets = [Ticket(i, r) for i, r in enumerate(requests, start=1)]
    rows = []
    for ticket in tickets:
        admission.queue(ticket)
        rows.append(admission.start(ticket.id))
        finishing.open(rows[-1], ticket)
    return finishing, admission, sessions, rows, tickets


def _events(ticket) -> list:
    out = []
    while not ticket.events.empty():
        out.append(ticket.events.get_nowait())
    return [e for e in out if not isinstance(e, StartedEvent)]


def _settle(finishing, out):
    outcomes = finishing.advance(out)
    return outcomes, finishing.end(out, outcomes)


def test_eos_length_and_running_rows():
    finishing, admission, sessions, rows, (stopping, long, running) = _setup(
        Request([1], 5), Request([2], 2), Request([3], 9))
    out = StepOutput(rows, [RowResult([4, EOS, 6]), RowResult([7, 8, 9]), RowResult([10])])
    outcomes, ended = _settle(finishing, out)
    assert [(o.finish, o.used) for o in outcomes] == [("stop", 2), ("length", 2), (None, 1)]
    assert ended == rows[:2]
    # Every token counts, the eos too.
    assert _events(stopping) == [TextEvent("e", 1), DoneEvent("stop", 2)]
    assert _events(long) == [TextEvent("h", 1), TextEvent("i", 2), DoneEvent("length", 2)]
    assert _events(running) == [TextEvent("k", 1)]
    # Each finished cache is stored under the tokens it holds: the prompt and every token but
    # the last, which was never fed in.
    stored = [c for c in sessions.commands if c[0] == "destroy"]
    assert [c[2] for c in stored] == [1, 2]
    assert admission.index.lookup([1, 4, 9]).keep == 2 and admission.index.lookup([2, 7, 9]).keep == 2
    assert finishing.stats == {"generated_tokens": 5} and admission.reserved == 10


def test_a_pipelined_sessions_cache_holds_its_last_token_too():
    finishing, admission, _, rows, _ = _setup(Request([1, 2], 1))
    rows[0].fed_all = True  # as the batch leaves a row a pipelined step took its token in
    _settle(finishing, StepOutput(rows, [RowResult([3])]))
    assert admission.index.lookup([1, 2, 3, 4]).keep == 3


def test_stop_strings_and_failures_end_their_rows_alone():
    finishing, admission, sessions, rows, (stopped, failed, chunk) = _setup(
        Request([1], 9, stop=["cd"]), Request([2], 9), Request([4, 5, 6, 7], 9))
    out = StepOutput(rows, [RowResult([1, 2, 3, 4]), RowResult(None, "sampling failed: boom"),
                            RowResult([], chunk=2)], verify=True)
    outcomes, ended = _settle(finishing, out)
    assert [(o.finish, o.used) for o in outcomes] == [("stop", 3), ("failed", 1), (None, 2)]
    assert ended == rows[:2]
    assert _events(stopped) == [TextEvent("b", 2), DoneEvent("stop", 3)]  # "cd" is never sent
    assert _events(failed) == [FailedEvent("sampling failed: boom")]
    assert _events(chunk) == []
    # A failed session is dropped, not stored.
    assert [c[2] for c in sessions.commands if c[0] == "destroy"] == [1, 0]
    assert len(admission.index) == 1


def test_a_text_failure_fails_that_request_alone():
    class Broken(FakeTokenizer):
        def decode(self, tokens):
            raise UnicodeError("no text for it")

    finishing, _, _, rows, (bad, good) = _setup(Request([1], 5, logprobs=2), Request([2], 5))
    finishing.tokenizer = Broken()
    import mlx.core as mx

    drawn_from = mx.zeros((26,))
    outcomes, ended = _settle(finishing, StepOutput(rows, [RowResult([3], logprobs=drawn_from),
                                                           RowResult([4])]))
    assert outcomes[0].finish == "failed" and "no text for it" in outcomes[0].error
    assert ended == [rows[0]] and isinstance(_events(bad)[-1], FailedEvent) and _events(good) == [TextEvent("e", 1)]
