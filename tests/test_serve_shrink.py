"""`ds4tp serve --shrink-after` (serve/resize.py): a worker lost for good leaves the ranks left
serving the model on their own (a pair: the leader alone), every greedy answer still the unsplit
model's; the worker started again takes its place back without cutting a request; a shrink the
memory cannot hold stays 503 naming the figures. Real processes on 127.0.0.1, always killed."""

from __future__ import annotations

import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the openai package (pip install openai)")

from serveutil import ServedPair, build_chat_model, client, get_raw, get_text, reference, text_ids  # noqa: E402

RDMA = ["--transport", "rdma", "--rdma-device", "ucsim"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("shrink-model"), preset="tiny8")


def _wait_health(served: ServedPair, within: float, **want) -> dict:
    """/health's body once every field of `want` has its value (status code included as
    `code`); AssertionError with the last body and the leader's log otherwise."""
    deadline = time.monotonic() + within
    code, body = 0, None
    while time.monotonic() < deadline:
        assert served.procs["leader"].poll() is None, served.log("leader")[-4000:]
        code, body = served.health()
        got = {"code": code, **(body or {})}
        if all(got.get(k) == v for k, v in want.items()):
            return body
        time.sleep(0.2)
    raise AssertionError(f"/health never showed {want} within {within} s: {code} {body}\n"
                         f"{served.log('leader')[-4000:]}")


def _check_answers(served: ServedPair, model_dir, prompts=("after", "before", "a longer prompt")) -> None:
    c = client(served, timeout=120)
    for prompt in prompts:
        got = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=8)
        assert got.choices[0].text == reference(model_dir, text_ids(model_dir, prompt), 8), prompt


def _post_status(served: ServedPair, model_dir) -> tuple:
    """(status, headers) of one completion asked now."""
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"model": str(model_dir), "prompt": "meanwhile", "max_tokens": 2}).encode()
    request = urllib.request.Request(served.base + "/v1/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": "Bearer test-key"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            served.read_body("POST /v1/completions", r)
            return r.status, r.headers
    except urllib.error.HTTPError as e:
        served.read_body("POST /v1/completions", e)
        return e.code, e.headers


def _lose_and_regain(served: ServedPair, model_dir, lost: str, size: int) -> None:
    """Kill `lost` mid-stream, see the group shrink to size-1 and answer exactly, start it again
    with a long request under way, see the group grow back with that request whole."""
    _wait_health(served, 120, code=200, size=size, started_size=size, state="serving")
    _check_answers(served, model_dir, ("before",))
    c = client(served, timeout=120)
    stream = c.completions.create(model=str(model_dir), prompt="long", max_tokens=100000, stream=True)
    next(iter(stream))
    served.kill(lost)
    with pytest.raises(openai.APIError, match="group of machines is down"):
        for _ in stream:
            pass
    code, headers = _post_status(served, model_dir)
    if code == 503:  # the group not back yet: the client is told when to try again
        assert (headers.get("Retry-After") or "").isdigit(), dict(headers)
    body = _wait_health(served, 90, code=200, size=size - 1, state="serving")
    assert body["started_size"] == size and body["shrinks"] == 1, body
    _check_answers(served, model_dir)
    code, cluster = get_raw(served, "/cluster")  # the cluster page at any size
    assert code == 200 and cluster["size"] == size - 1 and len(cluster["ranks"]) == size - 1, cluster
    # A request under way while the lost rank comes back: the grow waits for it, cuts nothing.
    prompt = "kept whole while the group grows"
    want = reference(model_dir, text_ids(model_dir, prompt), 120)
    answers, errors = [], []

    def ask() -> None:
        try:
            got = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=120)
            answers.append(got.choices[0].text)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    served.start(lost)
    body = _wait_health(served, 120, code=200, size=size, grows=1, state="serving")
    asking.join(120)
    assert not errors and answers == [want], (errors, answers)
    _check_answers(served, model_dir)
    _, metrics = get_text(served, "/metrics")
    assert "ds4tp_group_shrinks 1.0" in metrics and "ds4tp_group_grows 1.0" in metrics, metrics
    log = served.log("leader")
    assert f"shrank from {size} to {size - 1} ranks in" in log and f"grew from {size - 1} to {size} ranks in" in log


@pytest.mark.parametrize("transport, split", [("tcp", "even"), ("rdma", "even"), ("tcp", "2:1:1")])
def test_three_ranks_shrink_to_two_and_grow_back(model_dir, tmp_path, transport, split):
    extra = ["--shrink-after", "2", "--split", split, *(RDMA if transport == "rdma" else [])]
    served = ServedPair(model_dir, tmp_path, extra=extra, ranks=3)
    try:
        _lose_and_regain(served, model_dir, "worker2", 3)
        if split != "even":  # the started share scaled to the ranks left, then the started one again
            log = served.log("leader")
            assert "(split 2:1)" in log or "(split even)" in log, log[-3000:]
            assert "grows from 2 to 3 (rank" in log and "split 2:1:1)" in log, log[-3000:]
    finally:
        served.close()


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_pair_shrinks_to_the_leader_alone_and_grows_back(model_dir, tmp_path, transport):
    # The prompt caches on disk too: the pair's halves are never the leader alone's whole.
    extra = ["--shrink-after", "2", "--prompt-cache-dir", str(tmp_path / "prompt-cache"),
             *(RDMA if transport == "rdma" else [])]
    served = ServedPair(model_dir, tmp_path, extra=extra)
    try:
        _lose_and_regain(served, model_dir, "worker", 2)
    finally:
        served.close()


def test_workers_without_the_model_receive_their_new_parts(model_dir, tmp_path):
    """Workers started without --model: after the shrink each receives its new part from the
    leader (it holds the old share's alone), and the one started again its started part."""
    from test_part_delivery import part_served_pair

    served = part_served_pair(model_dir, tmp_path / "logs", tmp_path / "parts", ranks=3,
                              extra=["--shrink-after", "2"])
    try:
        _lose_and_regain(served, model_dir, "worker2", 3)
        # Its started part, its part of the two left, its started part again (from its cache).
        assert served.log("worker").count("waiting for the leader's offer") >= 3, served.log("worker")[-3000:]
    finally:
        served.close()


def test_a_shrink_the_memory_cannot_hold_stays_503_naming_the_figures(model_dir, tmp_path):
    # DS4_TP_MEMORY_LIMIT_BYTES, the test hook that lowers the memory a rank measures: the
    # leader alone may use 1 MiB above the reserve, far less than the model and its KV cache.
    served = ServedPair(model_dir, tmp_path, extra=["--shrink-after", "1", "--max-kv-tokens", "4096"],
                        rank_env={"leader": {"DS4_TP_MEMORY_LIMIT_BYTES": str((512 << 20) + (1 << 20))}})
    try:
        _wait_health(served, 120, code=200, size=2)
        served.kill("worker")
        body = _wait_health(served, 60, code=503, state="waiting")
        deadline = time.monotonic() + 30
        while "shrink_refused" not in body and time.monotonic() < deadline:
            time.sleep(0.2)
            body = served.health()[1]
        refused = body.get("shrink_refused", "")
        assert "cannot hold the model" in refused and "needs" in refused and "has" in refused, body
        assert "MiB" in refused and body["size"] == 2 and body["shrinks"] == 0, body
        time.sleep(2)  # still refused: nothing was loaded
        code, body = served.health()
        assert code == 503 and body["size"] == 2 and body["shrinks"] == 0, body
        assert "no shrink: the 1 rank left cannot hold the model" in served.log("leader")
        # The lost worker back: the group of two forms again, nothing reloaded.
        served.start("worker")
        _wait_health(served, 120, code=200, size=2, state="serving")
        assert "shrink_refused" not in served.health()[1]
        _check_answers(served, model_dir, ("after",))
    finally:
        served.close()


def test_a_worker_back_within_shrink_after_takes_its_place_without_a_shrink(model_dir, tmp_path):
    """Started again within --shrink-after, the lost worker is taken back at the group's size,
    nothing reloaded, no shrink: the rejoin of a restart, with shrinking on."""
    served = ServedPair(model_dir, tmp_path, extra=["--shrink-after", "25"], env={"DS4_TP_TIMEOUT_SEC": "60"})
    try:
        _wait_health(served, 120, code=200, size=2, state="serving")
        served.kill("worker")
        _wait_health(served, 60, code=503, state="waiting")
        served.start("worker")
        body = _wait_health(served, 120, code=200, size=2, state="serving")
        assert body["shrinks"] == 0 and body["grows"] == 0, body
        _check_answers(served, model_dir, ("after", "before"))
        log = served.log("leader")
        assert "formed again" in log and "shrank" not in log, log[-3000:]
    finally:
        served.close()


def test_a_grow_whose_group_never_forms_falls_back_and_serves_the_queue(model_dir, tmp_path):
    """A rank knocks at the shrunk group's door and is gone once the grow has begun (here a
    bare connection, held until the leader says the group grows, then closed: the returning
    worker killed right after its knock): the group of three never forms; the leader tells the
    rank left to form the group of two again (RESIZE at the door), serves the request queued
    during the grow, exactly, and grows for real when the worker comes back. The rank's death
    is noticed as it happens (its knock closed, or its JOIN not at the new door right after it
    was let go at the old one), not after the connect timeout."""
    import socket

    served = ServedPair(model_dir, tmp_path, extra=["--shrink-after", "2"], ranks=3)
    try:
        _wait_health(served, 120, code=200, size=3, state="serving")
        served.kill("worker2")
        _wait_health(served, 90, code=200, size=2, state="serving", shrinks=1)
        listen = served.cmds["leader"].index("--listen")
        door = ("127.0.0.1", int(served.cmds["leader"][listen + 2]))
        knock = socket.create_connection(door, timeout=10)
        deadline = time.monotonic() + 60
        while "the group grows from 2 to 3" not in served.log("leader"):
            assert time.monotonic() < deadline, served.log("leader")[-3000:]
            time.sleep(0.05)
        knock.close()
        # Asked while the group grows: queued, then served by the group that forms again.
        prompt = "queued while the group grows"
        want = reference(model_dir, text_ids(model_dir, prompt), 8)
        answers, errors = [], []

        def ask() -> None:
            try:
                got = client(served, timeout=180).completions.create(model=str(model_dir), prompt=prompt,
                                                                     max_tokens=8)
                answers.append(got.choices[0].text)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        asking = threading.Thread(target=ask)
        asking.start()
        asking.join(180)
        assert not errors and answers == [want], (errors, answers, served.log("leader")[-3000:])
        body = _wait_health(served, 60, code=200, size=2, state="serving")
        assert body["grows"] == 0 and body["shrinks"] == 1, body
        log = served.log("leader")
        assert "the group of 3 did not form" in log and "serving on with the 2 ranks it had" in log, log[-3000:]
        # Its rank's death noticed (its knock closed, or no JOIN at the new door right after it
        # was let go), not waited out for the connect timeout.
        assert "the rank back" in log and "it is gone; the group of 2 it had forms again" in log, log[-3000:]
        assert "forms a group of 2 again" in served.log("worker"), served.log("worker")[-3000:]
        _check_answers(served, model_dir, ("after",))
        # The worker itself back: the group grows to three after all.
        served.start("worker2")
        body = _wait_health(served, 120, code=200, size=3, state="serving", grows=1)
        _check_answers(served, model_dir, ("after", "before"))
    finally:
        served.close()


def _wait_log(served: ServedPair, name: str, within: float, *lines: str, after: str = "") -> str:
    """Rank `name`'s log (from the last `after` line on) once it holds one of `lines`."""
    deadline = time.monotonic() + within
    while True:
        log = served.log(name)
        tail = log[log.rfind(after):] if after else log
        if any(line in tail for line in lines):
            return tail
        assert time.monotonic() < deadline, f"{name} never logged {lines}:\n{log[-4000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_worker_started_again_during_the_shrink_waits_and_the_group_grows_with_it(model_dir, tmp_path, transport):
    """The lost worker started again while the ranks left re-form without it: its JOIN reaches
    the shrinking group's door before the survivor's (which a test hook holds back until then,
    lockstep/regroup.py's TEST_WAIT_FILE_ENV), and asks for no rank: the door holds it
    unanswered, the survivor takes its own place, the group of two serves, then grows back to
    three with the restarted rank in its old place. No rank displaced, every answer exact."""
    from mlx_ds4tp.lockstep.regroup import TEST_WAIT_FILE_ENV

    gate = tmp_path / "the-survivor-may-join"
    served = ServedPair(model_dir, tmp_path, extra=["--shrink-after", "2", *(RDMA if transport == "rdma" else [])],
                        ranks=3, env={"DS4_TP_TIMEOUT_SEC": "60"},
                        rank_env={"worker": {TEST_WAIT_FILE_ENV: str(gate)}})
    try:
        _wait_health(served, 120, code=200, size=3, state="serving")
        _check_answers(served, model_dir, ("before",))
        served.kill("worker2")
        shrinking = "the group shrinks from 3 to 2"
        _wait_log(served, "leader", 90, shrinking)
        served.start("worker2")
        # The restarted rank at the door first (before the fix it took the survivor's place).
        _wait_log(served, "leader", 60, "holds the JOIN of a rank started again", "joined (1 of the 1 other",
                  after=shrinking)
        gate.touch()
        body = _wait_health(served, 120, code=200, size=3, state="serving", grows=1)
        assert body["shrinks"] == 1, body
        for name in ("leader", "worker", "worker2"):
            assert served.procs[name].poll() is None, served.log(name)[-3000:]
        log = served.log("leader")
        assert "holds the JOIN of a rank started again" in log, log[-3000:]
        assert "shrank from 3 to 2 ranks in" in log and "grew from 2 to 3 ranks in" in log, log[-3000:]
        assert "did not form" not in log, log[-3000:]
        assert "rank 1 of 2 now" in served.log("worker"), served.log("worker")[-3000:]
        _check_answers(served, model_dir)
    finally:
        served.close()


def test_a_worker_started_a_second_time_while_the_group_grows_is_taken_back(model_dir, tmp_path):
    """The lost worker started again, and once the group has begun to grow with it, killed and
    started a second time: whichever way that falls (the grow gives up on the first start and
    falls back, or the second start takes the place), the group ends at three with every
    answer exact, and the leader serves throughout."""
    served = ServedPair(model_dir, tmp_path, extra=["--shrink-after", "2"], ranks=3)
    try:
        _wait_health(served, 120, code=200, size=3, state="serving")
        served.kill("worker2")
        _wait_health(served, 90, code=200, size=2, state="serving", shrinks=1)
        served.start("worker2")
        _wait_log(served, "leader", 90, "the group grows from 2 to 3")
        served.kill("worker2")
        served.start("worker2")
        _wait_health(served, 180, code=200, size=3, state="serving")
        assert served.procs["leader"].poll() is None and served.procs["worker"].poll() is None
        _check_answers(served, model_dir)
    finally:
        served.close()


def test_a_worker_started_again_while_the_pair_shrinks_to_the_leader_alone_is_taken_back(model_dir, tmp_path):
    """A pair: the worker started again as soon as the leader begins to load the whole model
    alone; its JOIN waits at the lone leader's door (open before the load) and the pair forms
    again once the leader serves: size 2, every answer exact."""
    served = ServedPair(model_dir, tmp_path, extra=["--shrink-after", "2"])
    try:
        _wait_health(served, 120, code=200, size=2, state="serving")
        served.kill("worker")
        _wait_log(served, "leader", 90, "the group shrinks from 2 to 1")
        served.start("worker")
        body = _wait_health(served, 120, code=200, size=2, state="serving", grows=1)
        assert body["shrinks"] == 1, body
        assert served.procs["worker"].poll() is None, served.log("worker")[-3000:]
        _check_answers(served, model_dir)
    finally:
        served.close()
