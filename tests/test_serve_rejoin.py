"""`ds4tp serve` outliving a rank (serve/serving_rank.py): a worker that dies is taken back by the
leader, which never restarts; a leader that dies ends the worker within the timeout, or, with
--rejoin, the worker waits and serves the next leader."""

from __future__ import annotations

import time

import pytest

openai = pytest.importorskip("openai", reason="the openai package (pip install openai)")

from serveutil import ServedPair, build_chat_model, client, reference, text_ids  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("rejoin-model"))


def _wait_status(served: ServedPair, code: int, within: float) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        status, body = served.health()
        if status == code:
            return body
        time.sleep(0.1)
    raise AssertionError(f"/health did not turn {code} within {within} s: {served.health()}\n"
                         f"{served.log('leader')[-3000:]}")


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_restarted_worker_rejoins_and_the_leader_serves_on(model_dir, tmp_path, transport):
    extra = ["--transport", "rdma", "--rdma-device", "ucsim"] if transport == "rdma" else []
    served = ServedPair(model_dir, tmp_path, extra=extra, env={"DS4_TP_TIMEOUT_SEC": "8"})
    try:
        served.wait_healthy()
        c = client(served, timeout=120)
        first = c.completions.create(model=str(model_dir), prompt="before", max_tokens=6)
        assert first.choices[0].text == reference(model_dir, text_ids(model_dir, "before"), 6)
        # The worker dies in the middle of a stream: that request fails, the leader lives on.
        stream = c.completions.create(model=str(model_dir), prompt="long", max_tokens=100000,
                                      stream=True)
        next(iter(stream))
        served.kill("worker")
        with pytest.raises(openai.APIError, match="group of machines is down"):
            for _ in stream:
                pass
        body = _wait_status(served, 503, 10)
        assert "worker" in body["error"] or "peer" in body["error"], body
        with pytest.raises(openai.InternalServerError):
            c.completions.create(model=str(model_dir), prompt="meanwhile", max_tokens=3)
        # The same worker command again: it rejoins, and the next request has the right text.
        served.start("worker")
        _wait_status(served, 200, 90)
        assert served.procs["leader"].poll() is None
        for prompt in ("after", "before"):  # "before" would have reused a cache of the old pair
            got = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=6)
            assert got.choices[0].text == reference(model_dir, text_ids(model_dir, prompt), 6)
        log = served.log("leader")
        assert "formed again" in log and f"transport {transport}" in log
    finally:
        served.close()


def test_a_dead_leader_ends_the_worker_within_the_timeout(model_dir, tmp_path):
    timeout = 6
    served = ServedPair(model_dir, tmp_path, env={"DS4_TP_TIMEOUT_SEC": str(timeout)})
    try:
        served.wait_healthy()
        served.kill("leader")
        worker = served.procs["worker"]
        t0 = time.monotonic()
        rc = worker.wait(timeout + 10)
        assert time.monotonic() - t0 < timeout + 2
        assert rc != 0
        log = served.log("worker")
        assert "--rejoin" in log and "Traceback" not in log, log[-2000:]
    finally:
        served.close()


def test_a_rejoining_worker_waits_for_the_next_leader(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, env={"DS4_TP_TIMEOUT_SEC": "6"})
    try:
        served.wait_healthy()
        served.kill("worker")
        _wait_status(served, 503, 10)
        served.start("worker", ["--rejoin"])
        _wait_status(served, 200, 90)
        served.kill("leader")
        time.sleep(8)  # past the timeout: a worker without --rejoin would have gone
        assert served.procs["worker"].poll() is None, served.log("worker")[-2000:]
        served.start("leader")
        served.wait_healthy()
        got = client(served).completions.create(model=str(model_dir), prompt="next", max_tokens=6)
        assert got.choices[0].text == reference(model_dir, text_ids(model_dir, "next"), 6)
        assert "waiting for a leader" in served.log("worker")
    finally:
        served.close()
