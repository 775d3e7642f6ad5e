"""Two-process pair runs (`ds4tp run`), the demo, and dead-peer behaviour."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest

from pairutil import free_port, reference_text

TRANSPORTS = [("tcp", []), ("rdma", ["--rdma-device", "ucsim"])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    return save_llama(tmp_path_factory.mktemp("pair-model"), "tiny", seed=3)


def spawn_pair(procs, model_dir, transport_args, prompt, max_tokens, extra=(), env=None,
               worker_model=None):
    port = free_port()
    common = ["-m", "mlx_ds4tp", "run", "--max-tokens", str(max_tokens), "--no-chat-template",
              *transport_args, *extra]
    leader = procs.spawn(common + ["--model", str(model_dir), "--prompt", prompt, "--role", "leader",
                                   "--listen", "127.0.0.1", str(port)], env=env)
    worker = procs.spawn(common + ["--model", str(worker_model or model_dir), "--role", "worker",
                                   "--coordinator", "127.0.0.1", str(port)], env=env)
    return leader, worker


@pytest.mark.parametrize("transport, targs", TRANSPORTS, ids=[t for t, _ in TRANSPORTS])
def test_pair_text_equals_single_process(procs, model_dir, transport, targs):
    prompt = "Two machines, one model"
    leader, worker = spawn_pair(procs, model_dir, ["--transport", transport, *targs], prompt, 24,
                                extra=["--debug-hash", "4"])
    lout, lerr = leader.communicate(timeout=120)
    wout, werr = worker.communicate(timeout=30)
    assert leader.returncode == 0, lerr
    assert worker.returncode == 0, werr
    text, tokens = reference_text(model_dir, prompt, 24)
    streamed, closing = lout.rsplit("\n", 2)[0], lout.strip().splitlines()[-1]
    assert streamed == text
    assert f"transport {transport}" in closing and "tok/s" in closing and "gate p50" in closing
    # The leader's time in exchanges, a part of decode's time.
    exchanges = re.search(r"exchanges ([0-9.]+) ms/token \(([0-9]+)% of decode", closing)
    assert exchanges and float(exchanges[1]) > 0 and 0 <= int(exchanges[2]) <= 100, closing
    assert "leader said stop" in werr


@pytest.mark.parametrize("transport, targs", TRANSPORTS, ids=[t for t, _ in TRANSPORTS])
@pytest.mark.parametrize("victim", ["worker", "leader"])
def test_peer_killed_mid_generation(procs, model_dir, transport, targs, victim):
    leader, worker = spawn_pair(procs, model_dir, ["--transport", transport, *targs],
                                "a long story", 100000)
    # Wait until the leader streams text: generation is under way.
    os.set_blocking(leader.stdout.fileno(), False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        chunk = leader.stdout.read(1)
        if chunk:
            break
        assert leader.poll() is None, leader.stderr.read()
        time.sleep(0.05)
    else:
        pytest.fail("the leader never started streaming")
    time.sleep(0.5)
    dead, survivor = (worker, leader) if victim == "worker" else (leader, worker)
    dead.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    survivor.wait(timeout=10)
    elapsed = time.monotonic() - t0
    err = survivor.stderr.read()
    assert survivor.returncode not in (0, None), err
    assert "ds4-tp: error:" in err and ("peer closed" in err or "EOF" in err), err
    assert elapsed < 2.0, elapsed


def test_divergence_is_detected():
    """Ranks whose logits differ (as a corrupted gate would make them) stop at
    the hash check, both with the LOCKSTEP DIVERGENCE message."""

    from mlx_ds4tp.errors import LockstepDivergenceError
    from mlx_ds4tp.lockstep.protocol.commands import Create, EvalBatch
    from mlx_ds4tp.lockstep.protocol.sessions import LeaderSessions, serve_worker
    from pairutil import make_groups, run_both

    def lead():
        leader.send(Create, 1, 0, 0, 0)
        leader.send(EvalBatch, 1, [(1, 0)])
        leader.send(EvalBatch, 2, [(1, 0)])
        leader.check_hash()  # at seq (decode step) 2

    lg, wg = make_groups("tcp")
    leader = LeaderSessions(lg, _FixedLogits([1.0, 2.5]))
    try:
        (_, le), (_, we) = run_both(lead, lambda: serve_worker(wg, _FixedLogits([1.0, 2.0])))
    finally:
        lg.close()
        wg.close()
    for exc in (le, we):
        assert isinstance(exc, LockstepDivergenceError) and \
            "LOCKSTEP DIVERGENCE at seq 2: the logits differ: local" in str(exc), exc


class _FixedLogits:
    """A model whose logits are one fixed row, whatever it is fed."""

    def __init__(self, row):
        self.row = row

    def make_cache(self):
        return []

    def __call__(self, ids, cache=None):
        import mlx.core as mx

        return mx.array([[self.row]] * ids.shape[0])


def test_a_stopped_worker_s_reason_reaches_the_leader_whatever_it_was_doing():
    """A worker stopped by Ctrl-C sends its reason (an ERROR frame) and closes with the leader's
    commands unread, so the connection is reset: the leader's next send fails, and a frame the
    worker answered earlier may still sit ahead of the ERROR. Both times the leader's error names
    the worker's reason, not just a reset (the CI run that found it: a stream cut by a worker's
    SIGINT ended with 'connection reset' instead of 'the worker was stopped by SIGINT')."""
    from mlx_ds4tp.errors import TransportError
    from mlx_ds4tp.link.wire import FrameType
    from mlx_ds4tp.lockstep.protocol.commands import Create, Hash
    from mlx_ds4tp.lockstep.protocol.sessions import LeaderSessions, leader_channel
    from pairutil import make_groups

    for what in ("send", "between commands"):
        lg, wg = make_groups("tcp")
        try:
            leader = LeaderSessions(lg, _FixedLogits([1.0, 2.5]))
            leader.send(Create, 1, 0, 0, 0)  # left unread by the worker: its close resets the connection
            control = leader_channel(wg)
            control.send(FrameType.HASH, Hash.pack(0, 0, 7))  # an answer the leader never read
            control.send_error("the worker was stopped by SIGINT (Ctrl-C); start it again and it rejoins")
            wg.close()
            time.sleep(0.2)  # the reset reaches the leader's socket
            if what == "send":
                with pytest.raises(TransportError, match="reported: the worker was stopped by SIGINT"):
                    leader.send(Create, 2, 0, 0, 0)
            else:
                assert leader.peer_gone().startswith("the worker was stopped by SIGINT")
        finally:
            lg.close()
            wg.close()


def test_demo_prints_a_match(procs, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    p = procs.spawn(["-m", "mlx_ds4tp", "demo", "--transport", "tcp", "--max-tokens", "12"], env=env)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    assert "match with the unsplit model in one process: True" in out
    assert "SYNTHETIC" in out and "--role worker --coordinator" in out
    assert (tmp_path / "mlx_ds4tp").is_dir()


def test_a_worker_with_other_weights_is_refused_at_the_hello(procs, model_dir, tmp_path):
    from mlx_ds4tp import model_fingerprint
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    other = save_llama(tmp_path / "other", "tiny", seed=4)  # same config, other weights
    labels = [model_fingerprint(model_dir).label, model_fingerprint(other).label]
    assert labels[0] != labels[1]
    leader, worker = spawn_pair(procs, model_dir, ["--transport", "tcp"], "hi", 4, worker_model=other)
    for p in (leader, worker):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 1, err
        assert "ds4-tp: error: model mismatch" in err and "same shapes, different weights" in err, err
        assert all(label in err for label in labels), (labels, err)
        assert "loading weights" not in err and "weights loaded" not in err, err


def test_the_same_model_copied_elsewhere_is_accepted(procs, model_dir, tmp_path):
    copy = shutil.copytree(model_dir, tmp_path / "copy")
    leader, worker = spawn_pair(procs, model_dir, ["--transport", "tcp"], "hi", 4, worker_model=copy)
    lout, lerr = leader.communicate(timeout=120)
    wout, werr = worker.communicate(timeout=30)
    assert leader.returncode == 0 and worker.returncode == 0, (lerr, werr)
    assert "leader said stop" in werr


def test_run_flags_are_checked(procs, model_dir):
    p = procs.spawn(["-m", "mlx_ds4tp", "run", "--model", str(model_dir), "--role", "leader",
                     "--listen", "127.0.0.1", "x"])
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "PORT must be an integer" in err
    p = procs.spawn(["-m", "mlx_ds4tp", "run", "--model", str(model_dir), "--role", "leader",
                     "--listen", "127.0.0.1", "9"])
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "the leader needs --prompt" in err


def test_the_leader_sends_commands_and_asks_queries_each_one_way():
    """LeaderSessions.send takes any command class and its fields (a new command needs no
    leader method) and refuses a query, which is asked; ask refuses a plain command."""
    from mlx_ds4tp.lockstep.one_rank import OneRank
    from mlx_ds4tp.lockstep.protocol.commands import Create, EvalBatch, Hash

    leader = OneRank(_FixedLogits([1.0, 2.5]))
    leader.send(Create, 1, 0, 0, 0)
    logits = leader.send(EvalBatch, leader.step_count + 1, [(1, 0)])
    assert logits.shape == (1, 2) and leader.step_count == 1
    with pytest.raises(ValueError, match="HASH is a query the worker ranks answer: ask it"):
        leader.send(Hash, 0, 1, 0)
    with pytest.raises(ValueError, match="SESSION_CREATE is not a query: send it"):
        leader.ask(Create, 2, 0, 0, 0)
    assert leader.ask(Hash, 0, 1, 0) == (None, [])  # no worker to answer
