"""`ds4tp serve --prompt-cache-dir` stopped in every order (issue 51; serve/serving_rank.py,
lockstep/caches/disk_cache.py): the leader first, the worker first, both at once, kill -9 of the
worker, kill -9 of both. A long prompt is served, written through to both ranks' directories
while the pair runs, and a moment later the stop: a requested stop (SIGINT, SIGTERM) exits 0
with one line saying why, nothing ends by a signal it did not ask for or aborts ("terminate
called"), the rank left up says so and waits, and the restarted pair serves the conversation's
next turn from disk with a cold server's text."""

from __future__ import annotations

import json
import signal
import time

import pytest

from serveutil import ServedPair, build_chat_model, post_raw, reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("stop-model"))


# A long first turn (the tiny model's vocabulary, over and over), then the next turn after it.
PROMPT = [3 + (7 * i) % 500 for i in range(1200)]
NEXT = PROMPT + [5, 6, 7, 8]

# order -> {rank: signal sent to it}; the ranks not named stay up and wait for the other.
ORDERS = {
    "leader-first": {"leader": signal.SIGTERM},
    "worker-first": {"worker": signal.SIGINT},
    "both-at-once": {"leader": signal.SIGINT, "worker": signal.SIGINT},
    "kill-9-worker": {"worker": signal.SIGKILL},
    "kill-9-both": {"leader": signal.SIGKILL, "worker": signal.SIGKILL},
}
STOPPED_LINE = {"leader": "serve: stopped by ", "worker": "serve: rank 1 stopped by "}
SIGNAL_NAME = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def _complete(served: ServedPair, prompt, max_tokens: int = 8) -> dict:
    code, answer = post_raw(served, "/v1/completions",
                            json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode())
    assert code == 200, answer
    return answer


def _files(directory) -> list:
    """The prompt-cache files written (not the temporary one being written)."""
    return [p for p in directory.glob("*.safetensors") if not p.name.startswith(".")]


def _wait_for(what: str, ready, within: float, served: ServedPair) -> None:
    deadline = time.monotonic() + within
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {within} s:\nleader:\n{served.log('leader')[-3000:]}"
                                 f"\nworker:\n{served.log('worker')[-3000:]}")
        time.sleep(0.1)


@pytest.mark.parametrize("order", list(ORDERS))
def test_every_stop_order_keeps_the_cache_and_the_restart_serves_from_it(order, model_dir, tmp_path):
    root, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    served = ServedPair(model_dir, logs, extra=["--prompt-cache-disk-bytes", "50MB"],
                        rank_extra={r: ["--prompt-cache-dir", str(root / r)] + (["--rejoin"] if r == "worker" else [])
                                    for r in ("leader", "worker")})
    try:
        served.wait_healthy()
        _complete(served, PROMPT)
        answered = time.monotonic()
        # Written through while the pair serves: both halves are on disk before any stop.
        on_disk = lambda: all(_files(root / r) for r in ("leader", "worker"))  # noqa: E731
        _wait_for("both ranks' files", on_disk, 30, served)
        time.sleep(max(0.0, 2.0 - (time.monotonic() - answered)))

        stops = ORDERS[order]
        for name, sig in stops.items():
            served.procs[name].send_signal(sig)
        for name, sig in stops.items():
            rc = served.procs[name].wait(60)
            log = served.log(name)
            if sig == signal.SIGKILL:
                assert rc == -signal.SIGKILL, (name, rc)
                continue
            # A requested stop: exit 0, one line saying why, its files all written.
            assert rc == 0, (name, rc, log[-3000:])
            lines = [line for line in log.splitlines() if STOPPED_LINE[name] in line]
            assert len(lines) == 1 and SIGNAL_NAME[sig] in lines[0], log[-3000:]
            assert "prompt cache file(s) in" in lines[0], lines
        survivors = [n for n in ("leader", "worker") if n not in stops]
        for name in survivors:
            assert served.procs[name].poll() is None, served.log(name)[-3000:]
        if "leader" in survivors:  # it says the worker went and answers 503 until one rejoins
            _wait_for("/health 503", lambda: served.health()[0] == 503, 30, served)
            assert "HTTP answers 503 until the group of 2 forms again" in served.log("leader")
            if stops["worker"] != signal.SIGKILL:
                assert "rank 1 was stopped by SIGINT (Ctrl-C)" in served.log("leader")
        if "worker" in survivors:  # --rejoin: it waits for the next leader
            _wait_for("the worker waiting", lambda: "waiting for a leader" in served.log("worker"), 30, served)

        for name in ("leader", "worker"):
            if name in stops:
                served.start(name)
        served.wait_healthy()
        answer = _complete(served, NEXT)
        assert answer["choices"][0]["text"] == reference(model_dir, NEXT, 8), answer
        # The first turn's prefix came from disk, on both ranks.
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT), answer["usage"]
        health = served.health()[1]
        assert health["disk_hits"] == 1 and health["disk_load_failures"] == 0, health
        for name in ("leader", "worker"):
            log = served.log(name)
            assert "terminate called" not in log and "Traceback" not in log, (name, log[-3000:])
    finally:
        served.close()


@pytest.mark.parametrize("stopped", ["leader", "worker"])
def test_a_stop_in_the_middle_of_an_answer_ends_it_with_an_error_event(stopped, model_dir, tmp_path):
    """The answer under way ends with an error event that says why, the stopped rank exits 0
    with its one line, and nothing is cut off with a traceback."""
    from serveutil import open_stream

    served = ServedPair(model_dir, tmp_path, rank_extra={"worker": ["--rejoin"]})
    try:
        served.wait_healthy()
        sock = open_stream(served, json.dumps({"prompt": PROMPT[:50], "max_tokens": 100000,
                                               "stream": True}).encode())
        served.procs[stopped].send_signal(signal.SIGINT)
        received = b""
        sock.settimeout(60)
        while b"[DONE]" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        sock.close()
        why = "the server is stopping" if stopped == "leader" else "rank 1 was stopped by SIGINT"
        assert b'"error"' in received and why.encode() in received, received[-2000:]
        assert served.procs[stopped].wait(60) == 0
        log = served.log(stopped)
        assert sum(STOPPED_LINE[stopped] in line for line in log.splitlines()) == 1, log[-3000:]
        for name in ("leader", "worker"):
            assert "Traceback" not in served.log(name) and "terminate called" not in served.log(name)
    finally:
        served.close()
