"""Lockstep safety on UC: a message lost on the link must stop the pair with an
error naming the gate, never hand a rank the wrong partial.

UC never reports a lost message; the receive posted for it stays posted and
the peer's next message lands in it. The emulated device's `loss=P,seed=S`
fault drops messages over 64 bytes at random after each build's first 64; the
sequence tags on every hot-path message (see _verbs.h) must catch it.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np

import mlx_ds4tp as tp
from mlx_ds4tp.errors import DesyncError, PeerClosedError
from pairutil import make_groups, run_both

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
        assert isinstance(exc, (DesyncError, PeerClosedError)), f"{name}: {exc!r}"
        if isinstance(exc, DesyncError):
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
