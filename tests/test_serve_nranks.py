"""`ds4tp serve --ranks 3` (a mesh of three ranks on 127.0.0.1): the openai client gets the
single process's text; a killed worker (either of the two) makes the server answer 503 within
about a second; started again, it re-joins with its rank and share, the other worker with it
(started without --rejoin: the leader tells it the mesh forms again, and the same process
joins it), the leader never restarted, and the answers are exact again. A killed leader ends
each worker without --rejoin within seconds, with an error naming the leader."""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the openai package (pip install openai)")

from serveutil import ServedPair, build_chat_model, client, open_stream, reference, text_ids  # noqa: E402

RANKS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("nranks-serve"), preset="tiny8")


def _served(model_dir, tmp_path, rejoin: bool = False) -> ServedPair:
    # No --rejoin: a worker still alive follows its leader's REFORM into the new mesh by itself.
    extra = {"worker": ["--rejoin"], "worker2": ["--rejoin"]} if rejoin else None
    return ServedPair(model_dir, tmp_path, ranks=RANKS, env={"DS4_TP_TIMEOUT_SEC": "8"}, rank_extra=extra)


def _wait_status(served: ServedPair, code: int, within: float) -> float:
    """Seconds until /health answers `code`; AssertionError past `within`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if served.health()[0] == code:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"/health did not turn {code} within {within} s: {served.health()}\n"
                         f"{served.log('leader')[-3000:]}")


def _exact(c, model_dir, prompts) -> None:
    for prompt in prompts:
        got = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=8)
        assert got.choices[0].text == reference(model_dir, text_ids(model_dir, prompt), 8), prompt


# idle: killed between requests; streaming: killed while a request decodes, so the survivor's
# own step fails with the mesh and it waits for its leader's word (REFORM); --rejoin: the
# survivors were started with it, which changes nothing here.
@pytest.mark.parametrize("victim,when", [("worker", "idle"), ("worker2", "idle"), ("worker2", "streaming"),
                                         ("worker", "--rejoin")])
def test_three_ranks_serve_the_single_process_text_and_take_a_worker_back(model_dir, tmp_path, victim, when):
    served = _served(model_dir, tmp_path, rejoin=when == "--rejoin")
    try:
        served.wait_healthy(within=180)
        c = client(served, timeout=120)
        _exact(c, model_dir, ["three Macs", "one model"])
        chat = c.chat.completions.create(model=str(model_dir), max_tokens=6,
                                         messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content is not None
        # Several requests at once: one batch over the three ranks, each answer exact.
        prompts = ["a batch", "of three", "requests"]
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: _exact(c, model_dir, [p]), prompts))
        # Structured output: every rank masks its part of the vocabulary by the same grammar.
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        shaped = c.chat.completions.create(
            model=str(model_dir), max_tokens=40, messages=[{"role": "user", "content": "json"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
        assert isinstance(json.loads(shaped.choices[0].message.content)["ok"], bool), shaped
        survivor = "worker2" if victim == "worker" else "worker"
        survivor_pid = served.procs[survivor].pid
        stream = None
        if when == "streaming":
            body = json.dumps({"prompt": "a long answer", "max_tokens": 1000, "stream": True}).encode()
            stream = open_stream(served, body)  # its first event came: the three ranks decode
        served.kill(victim)
        down = _wait_status(served, 503, 10)
        if stream is not None:
            stream.close()
        with pytest.raises(openai.InternalServerError):
            c.completions.create(model=str(model_dir), prompt="meanwhile", max_tokens=3)
        served.start(victim)  # the same command: it is given the rank left free, and the share
        back = _wait_status(served, 200, 180)
        assert served.procs["leader"].poll() is None
        _exact(c, model_dir, ["after", "three Macs"])
        log = served.log("leader")
        assert "formed again" in log, log[-3000:]
        assert "any rank still alive was told the group forms again" in log, log[-3000:]
        # The survivor is the same process, which followed the leader into the new mesh.
        assert served.procs[survivor].pid == survivor_pid and served.procs[survivor].poll() is None
        assert re.search(r"rank \d joins it", served.log(survivor)), served.log(survivor)[-3000:]
        assert "joined a leader again" in served.log(survivor), served.log(survivor)[-3000:]
        print(f"\n{victim} killed ({when}): 503 after {down:.2f} s; re-joined (healthy) {back:.1f} s after its restart")
        assert down < 3.0, f"503 took {down:.2f} s"
    finally:
        served.close()


def _complete(served: ServedPair, prompt, max_tokens: int = 8) -> dict:
    from serveutil import post_raw

    code, answer = post_raw(served, "/v1/completions",
                            json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode())
    assert code == 200, answer
    return answer


def test_three_ranks_store_their_parts_on_disk_and_a_restart_serves_from_them(model_dir, tmp_path):
    """--prompt-cache-dir over three ranks: each rank writes its own part of every stored prefix
    (files named by its rank's key, so the three ranks here share one directory and whichever
    process holds a rank finds that rank's files), and after every rank restarts, the next turn of
    each conversation starts from the prefix all three loaded (DISK_LOAD asked of both workers)."""
    prompts = [[20 + i] + list(range(30 + 7 * i, 70 + 7 * i)) for i in range(3)]
    cache = tmp_path / "cache"
    flags = ["--prompt-cache-dir", str(cache), "--prompt-cache-disk-bytes", "50MB"]
    for run in ("run1", "run2"):
        (tmp_path / run).mkdir()
        served = ServedPair(model_dir, tmp_path / run, ranks=RANKS, extra=flags)
        try:
            served.wait_healthy(within=180)
            for prompt in prompts:
                asked = prompt if run == "run1" else prompt + [5, 6, 7, 8]
                answer = _complete(served, asked)
                assert answer["choices"][0]["text"] == reference(model_dir, asked, 8), (run, answer)
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (cached > 0) == (run == "run2"), (run, cached)
            if run == "run2":
                health = served.health()[1]
                assert health["disk_hits"] == 3 and health["disk_load_failures"] == 0, health
            served.stop()
        finally:
            served.close()
        if run == "run1":
            assert len(list(cache.glob("*.safetensors"))) == 3 * RANKS, sorted(cache.iterdir())


def test_a_killed_leader_ends_each_worker_without_rejoin_naming_it(model_dir, tmp_path):
    """The leader gone (killed: it told nobody) is no REFORM: each worker without --rejoin ends
    within seconds with an error naming its leader, never waiting for it."""
    served = _served(model_dir, tmp_path)
    try:
        served.wait_healthy(within=180)
        served.kill("leader")
        t0 = time.monotonic()
        for name in ("worker", "worker2"):
            code = served.procs[name].wait(30)
            log = served.log(name)
            assert code != 0, log[-3000:]
            assert re.search(r"the leader \(rank 0\) at 127\.0\.0\.1:\d+ is gone", log), log[-3000:]
        ended = time.monotonic() - t0
        print(f"\nleader killed: both workers ended {ended:.2f} s after")
        assert ended < 10.0, f"the workers took {ended:.2f} s to end"
    finally:
        served.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_leader_gone_while_it_waits_for_a_worker_ends_the_survivor(model_dir, tmp_path, how):
    """The leader dies, or is stopped (SIGTERM: it exits 0), while its mesh forms again (a
    worker gone, the other following REFORM; no mesh to send STOP on):
    the survivor without --rejoin is never left waiting, it ends once the leader's door no
    longer answers (serve.rejoin.DOOR_GRACE_SEC, or DS4_TP_TIMEOUT_SEC when shorter: 8 s
    here), naming the leader."""
    served = _served(model_dir, tmp_path)
    try:
        served.wait_healthy(within=180)
        served.kill("worker2")
        _wait_status(served, 503, 10)
        # The survivor is in the leader's new wait (its JOIN taken, asking for the rank it had).
        deadline = time.monotonic() + 30
        while "asks for rank" not in served.log("leader").split("HTTP answers 503", 1)[-1]:
            assert time.monotonic() < deadline, served.log("leader")[-3000:]
            time.sleep(0.05)
        if how == "killed":
            served.kill("leader")
        else:
            served.procs["leader"].send_signal(signal.SIGTERM)
            assert served.procs["leader"].wait(30) == 0, served.log("leader")[-3000:]
        t0 = time.monotonic()
        code = served.procs["worker"].wait(60)
        ended = time.monotonic() - t0
        log = served.log("worker")
        assert code != 0, log[-3000:]
        assert re.search(r"the leader \(rank 0\) at 127\.0\.0\.1:\d+ is gone", log), log[-3000:]
        print(f"\nleader {how} during the re-form: the survivor ended {ended:.1f} s after")
        assert ended < 8 + 10, f"the survivor took {ended:.1f} s to end"
    finally:
        served.close()
