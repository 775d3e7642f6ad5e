"""Lockstep safety on UC: a message lost on the link must stop the pair with an
error naming the gate, never hand a rank the wrong partial.

UC never reports a lost message; the receive posted for it stays posted and
the peer's next message lands in it. The emulated device's `loss=P,seed=S`
fault drops messages over 64 bytes at random after each build's first 64; the
sequence tags on every hot-path message (see _verbs.h) must catch it. A lost
message that nothing follows on the queue pair is revealed by the peer's next
word on the data socket (`drop_nth=w2l:N` loses exactly the worker's N-th).
"""

from __future__ import annotations

import re
import time

import mlx.core as mx
import numpy as np
import pytest

import mlx_ds4tp as tp
from mlx_ds4tp.errors import DesyncError
from pairutil import exchange, make_groups, run_both

HIDDEN = 4096  # one 16 KiB float32 gate, as in decode
LOST_RE = re.compile(r"lost message detected at (?:gate seq|the gate after seq) (\d+)")


def _sum_until_error(g, iters: int):
    """all_sum `iters` times, checking every sum exactly. Returns (sums done,
    wrong sums, the exception that stopped it or None). On an error the group
    is closed, so the peer stops at once instead of waiting out its timeout."""
    rank = g.rank()
    base = mx.arange(HIDDEN, dtype=mx.float32)
    expect_base = np.arange(HIDDEN, dtype=np.float32) * 3
    wrong = []
    for k in range(iters):
        try:
            y = tp.all_sum(base * (rank + 1) + k, group=g)
            mx.eval(y)  # the collective runs inside MLX's evaluation
        except Exception as exc:  # noqa: BLE001 - returned to the test
            g.close()
            return k, wrong, exc
        if not np.array_equal(np.array(y), expect_base + 2 * k):
            wrong.append(k)
    g.close()
    return iters, wrong, None


def test_lost_message_stops_the_pair_naming_the_seq(monkeypatch):
    monkeypatch.setenv("DS4_TP_UCSIM_FAULTS", "loss=0.02,seed=7")
    leader, worker = make_groups("rdma", timeout=10.0)
    assert leader.transport == "rdma" and worker.transport == "rdma"
    iters = 3000
    (lres, lexc), (wres, wexc) = run_both(lambda: _sum_until_error(leader, iters),
                                          lambda: _sum_until_error(worker, iters), timeout=60)
    assert lexc is None and wexc is None, (lexc, wexc)
    detected = []
    for name, (done, wrong, exc) in (("leader", lres), ("worker", wres)):
        assert wrong == [], f"{name} got wrong sums at calls {wrong[:5]}: a silent loss"
        assert exc is not None, f"{name} ran all {iters} gates: was no message lost?"
        # Raised inside MLX's evaluation, handed on as a RuntimeError: a loss detected here, or
        # the peer's end of the pair closing because it detected the loss first.
        assert isinstance(exc, RuntimeError), f"{name}: {exc!r}"
        if LOST_RE.search(str(exc)):
            m = LOST_RE.search(str(exc))
            assert m, str(exc)
            # call k is gate seq k + 1: the seq named is the one in progress
            assert int(m.group(1)) == done + 1, (done, str(exc))
            assert "the queue pair must be rebuilt" in str(exc)
            detected.append(name)
        # the first 64 messages of a build are spared: real traffic ran first
        assert done >= 60, (name, done)
    assert detected, (lres[2], wres[2])


def test_no_loss_every_sum_exact(monkeypatch):
    monkeypatch.setenv("DS4_TP_UCSIM_FAULTS", "loss=0,seed=7")
    leader, worker = make_groups("rdma", timeout=10.0)
    (lres, lexc), (wres, wexc) = run_both(lambda: _sum_until_error(leader, 400),
                                          lambda: _sum_until_error(worker, 400), timeout=60)
    assert lexc is None and wexc is None, (lexc, wexc)
    assert lres == (400, [], None), lres
    assert wres == (400, [], None), wres


# A lost message that nothing follows on the queue pair: the peer moves on to
# the data socket (gate-signature descriptor, bulk header), and that word,
# unread while a receive is still missing, reveals the loss (see _verbs.h).

MOVED_RE = re.compile(r"lost message detected at (.*?): the peer has moved past it")


def _scripted_sums(g, sizes):
    """all_sum one array of each size in turn, checking every sum exactly.
    Returns (sums done, wrong sums, exception or None, seconds the failing
    call took); on an error the group is closed so the peer stops at once."""
    rank = g.rank()
    wrong = []
    for k, n in enumerate(sizes):
        x = mx.arange(n, dtype=mx.float32) * (rank + 1) + k
        t0 = time.monotonic()
        try:
            y = tp.all_sum(x, group=g)
            mx.eval(y)  # the collective runs inside MLX's evaluation
        except Exception as exc:  # noqa: BLE001 - returned to the test
            took = time.monotonic() - t0
            g.close()
            return k, wrong, exc, took
        if not np.array_equal(np.array(y), np.arange(n, dtype=np.float32) * 3 + 2 * k):
            wrong.append(k)
    g.close()
    return len(sizes), wrong, None, 0.0


@pytest.mark.parametrize("then", [HIDDEN // 2, 4 * HIDDEN], ids=["new-shape", "bulk"])
def test_lost_last_gate_before_the_data_socket_is_desync_within_a_second(monkeypatch, then):
    # drop_nth=w2l:5: the worker's 5th gate message (gate seq 5) is lost and
    # nothing follows it on the queue pair: the worker's next all_sum has
    # another shape (a gate-signature exchange on the data socket; for the
    # 64 KiB one, then a bulk). The leader must fail naming seq 5 well inside
    # the 10 s timeout, and no rank may ever return a wrong sum.
    monkeypatch.setenv("DS4_TP_UCSIM_FAULTS", "drop_nth=w2l:5")
    leader, worker = make_groups("rdma", timeout=10.0)
    assert leader.transport == "rdma" and worker.transport == "rdma"
    sizes = [HIDDEN] * 5 + [then, HIDDEN]
    (lres, lexc), (wres, wexc) = run_both(lambda: _scripted_sums(leader, sizes),
                                          lambda: _scripted_sums(worker, sizes), timeout=30)
    assert lexc is None and wexc is None, (lexc, wexc)
    (ldone, lwrong, lerr, ltook), (wdone, wwrong, werr, _) = lres, wres
    assert lwrong == [] and wwrong == [], (lwrong, wwrong)
    assert isinstance(lerr, RuntimeError), repr(lerr)  # raised inside MLX's evaluation
    assert ldone == 4, (ldone, str(lerr))
    m = MOVED_RE.search(str(lerr))
    assert m and m.group(1) == "gate seq 5 (recv_done 4)", str(lerr)
    assert LOST_RE.search(str(lerr)).group(1) == "5"
    assert "the queue pair must be rebuilt" in str(lerr)
    assert ltook < 1.0, ltook
    # the worker finished gate 5 and was waiting on the data socket
    assert wdone == 5 and werr is not None, (wdone, werr)


def test_lost_last_gate_before_a_bulk_header_is_desync_within_a_second(monkeypatch):
    # The same through the exchange the backend calls, from numpy buffers: gates, then a
    # bulk exchange whose signature header is the worker's next data-socket word.
    monkeypatch.setenv("DS4_TP_UCSIM_FAULTS", "drop_nth=w2l:3")
    leader, worker = make_groups("rdma", timeout=10.0)

    def side(g):
        r = g.rank()
        try:
            for seq in range(1, 4):
                t0 = time.monotonic()
                recv = exchange(g, np.full(4 * HIDDEN, r + seq, np.uint8))
                assert np.all(recv == 1 - r + seq), (r, seq)
            t0 = time.monotonic()
            exchange(g, np.full(16 * HIDDEN, r, np.uint8))
            return None, 0.0
        except Exception as exc:  # noqa: BLE001 - returned to the test
            return exc, time.monotonic() - t0
        finally:
            g.close()

    (lres, lexc), (wres, wexc) = run_both(lambda: side(leader), lambda: side(worker), timeout=30)
    assert lexc is None and wexc is None, (lexc, wexc)
    lerr, ltook = lres
    assert isinstance(lerr, DesyncError), repr(lerr)
    assert MOVED_RE.search(str(lerr)).group(1) == "gate seq 3 (recv_done 2)", str(lerr)
    assert ltook < 1.0, ltook
    assert wres[0] is not None  # the worker, at the bulk header, saw the leader give up


def test_lost_last_bulk_chunk_is_desync_within_a_second(monkeypatch):
    # A 64 KiB all_sum is a bulk exchange of 4 messages; the worker's 4th is
    # lost, and its next all_sum (another shape) goes to the data socket.
    monkeypatch.setenv("DS4_TP_UCSIM_FAULTS", "drop_nth=w2l:4")
    leader, worker = make_groups("rdma", timeout=10.0)
    sizes = [4 * HIDDEN, HIDDEN]
    (lres, lexc), (wres, wexc) = run_both(lambda: _scripted_sums(leader, sizes),
                                          lambda: _scripted_sums(worker, sizes), timeout=30)
    assert lexc is None and wexc is None, (lexc, wexc)
    (ldone, lwrong, lerr, ltook), (wdone, wwrong, werr, _) = lres, wres
    assert lwrong == [] and wwrong == []
    assert ldone == 0 and isinstance(lerr, RuntimeError), (ldone, repr(lerr))
    m = MOVED_RE.search(str(lerr))
    assert m and m.group(1).startswith("bulk round 0 of 1 (3/4 receives in"), str(lerr)
    assert "its bulk message never landed" in str(lerr)
    assert ltook < 1.0, ltook
    assert wdone == 1 and werr is not None, (wdone, werr)
