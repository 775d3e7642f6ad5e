"""Shared-secret authentication in the hello: HMAC challenge-response, so a
peer without the secret is refused before any session state exists."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_ds4tp as tp
from mlx_ds4tp import transport as tr
from mlx_ds4tp.errors import AuthenticationError, TransportError, TransportTimeoutError
from pairutil import both_ok, dial_when_listening, free_port, run_both, swap


def configs(port, leader_secret, worker_secret, timeout=5.0):
    lc = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=timeout, secret=leader_secret)
    wc = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=timeout,
                       secret=worker_secret)
    return lc, wc


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_same_secret_connects_and_gates_work(transport):
    port = free_port()
    kw = dict(transport=transport, timeout=5.0, secret="correct horse")
    if transport == "rdma":
        kw["rdma_device"] = "ucsim"
    lg, wg = both_ok(lambda: tp.init(role="leader", listen=("127.0.0.1", port), **kw),
                     lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), **kw))
    with lg, wg:
        a, b = np.ones(4096, np.float32), np.full(4096, 2, np.float32)
        ra, rb = swap(lg, wg, a, b)
        assert np.array_equal(ra, b) and np.array_equal(rb, a)


def test_secret_from_environment(monkeypatch):
    monkeypatch.setenv("DS4_TP_SECRET", "from-env")
    assert tr.LinkSettings.of("leader", listen=("127.0.0.1", 1)).secret == b"from-env"
    monkeypatch.delenv("DS4_TP_SECRET")
    assert tr.LinkSettings.of("leader", listen=("127.0.0.1", 1)).secret is None


def test_wrong_secret_is_refused_and_the_leader_keeps_waiting(capfd):
    port = free_port()
    lc, bad = configs(port, "right", "wrong", timeout=10.0)
    _, good = configs(port, "right", "right", timeout=10.0)

    def workers():
        with pytest.raises(AuthenticationError, match="different --secret"):
            tr.connect(bad)
        return tr.connect(good)

    lp, wp = both_ok(lambda: tr.connect(lc), workers, timeout=30)
    lp.close()
    wp.close()
    assert "refused a connection from 127.0.0.1" in capfd.readouterr().err


def test_worker_without_secret_is_refused_with_a_clear_error():
    port = free_port()
    lc, wc = configs(port, "right", None, timeout=1.5)
    (lv, le), (wv, we) = run_both(lambda: tr.connect(lc), lambda: tr.connect(wc), timeout=30)
    assert isinstance(we, AuthenticationError) and "the leader requires a secret" in str(we)
    # The leader dropped that worker and went on waiting until its timeout.
    assert isinstance(le, TransportTimeoutError)


def test_leader_without_secret_refuses_nothing_but_worker_with_one_stops():
    port = free_port()
    lc, wc = configs(port, None, "mine", timeout=1.5)
    (lv, le), (wv, we) = run_both(lambda: tr.connect(lc), lambda: tr.connect(wc), timeout=30)
    assert isinstance(we, AuthenticationError) and "the leader sent none" in str(we)
    assert isinstance(le, TransportError)


def test_proof_is_bound_to_the_nonces():
    a = tr.auth_proof(b"s", 0, b"n" * 16, b"m" * 16)
    assert a == tr.auth_proof(b"s", 0, b"n" * 16, b"m" * 16)
    assert a != tr.auth_proof(b"s", 0, b"x" * 16, b"m" * 16)  # another verifier nonce
    assert a != tr.auth_proof(b"s", 1, b"n" * 16, b"m" * 16)  # another role
    assert a != tr.auth_proof(b"t", 0, b"n" * 16, b"m" * 16)  # another secret


def test_replayed_proof_is_refused():
    """A client that replays a proof captured from an earlier connection fails:
    the leader's nonce is fresh every time."""
    port = free_port()
    lc, good = configs(port, "s3cret", "s3cret", timeout=10.0)
    lp, wp = both_ok(lambda: tr.connect(lc), lambda: tr.connect(good))
    lp.close()
    wp.close()
    # What the worker sent on that connection: the proof over the leader's nonce then.
    captured = {"proof": tr.auth_proof(b"s3cret", 1, lp.mine.nonce, wp.mine.nonce)}
    assert wp.peer_hello.nonce == lp.mine.nonce

    lc2, _ = configs(port, "s3cret", None, timeout=3.0)

    def replayer():
        sock = dial_when_listening(port)
        ch = tr.ControlChannel(sock, 5.0)
        hello = tr.Hello(role=1, transport="auto", rdma_ok=False, rdma_reason="", session_id=0,
                         identity=tr.ModelIdentity(), auth=True, nonce=b"r" * 16)
        ch.send(tr.FrameType.HELLO, hello.pack())
        ch.recv(tr.FrameType.HELLO)
        ch.send(tr.FrameType.AUTH, captured["proof"])
        try:
            ch.recv(tr.FrameType.AUTH)
            return ch.recv()
        finally:
            sock.close()

    (lv, le), (wv, we) = run_both(lambda: tr.connect(lc2), replayer, timeout=30)
    assert isinstance(we, TransportError) and "authentication failed" in str(we)
    assert isinstance(le, TransportTimeoutError)  # refused, kept waiting, nobody else came
