"""Issue 61: the pair secret never shows. A served group of three on 127.0.0.1 proving
secret_grep.TEST_SECRET: every HTTP face (/health, /metrics, /cluster, the cluster page, the
models, an answer whole and streamed, the errors) read and searched, each rank's output and its
process title too; a worker holding another secret is refused naming neither. Loopback without
any secret serves as before. (serveutil.ServedPair's close() runs the same search for every
serve test; these look at every face on purpose.)"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from secret_grep import TEST_SECRET, find_secret, secret_forms
from serveutil import NO_SECRET, ServedPair, build_chat_model, client, get_raw, get_text, post_raw

OTHER_SECRET = "MB4C-6DNE-7FGH-5JKL"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("secret"), preset="tiny8")


def test_the_forms_searched_include_the_code_typed_back_and_its_bytes():
    forms = secret_forms(TEST_SECRET)
    assert forms["without its dashes"] == "QZ7KW3XVMT5PJH2R"
    assert forms["in hex"] == TEST_SECRET.encode().hex()
    assert find_secret([TEST_SECRET], "ok\nkey=qz7k-w3xv-mt5p-jh2r\n", "log") == [
        "log line 2: 'key=qz7k-w3xv-mt5p-jh2r' (the secret as given)"]
    assert find_secret([TEST_SECRET], "b'" + forms["in base64"] + "'", "body")
    assert not find_secret([TEST_SECRET], "QZ7K-W3XV and MT5P-JH2R apart", "log")


def _process_text(pid: int, what: str) -> str:
    return Path(f"/proc/{pid}/{what}").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")


def test_no_log_error_http_body_or_process_title_of_a_served_group_shows_the_secret(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, ranks=3, env={"DS4_TP_TIMEOUT_SEC": "8"})
    try:
        served.wait_healthy(within=180)
        code, health = get_raw(served, "/health")
        assert code == 200 and health, health
        code, metrics = get_text(served, "/metrics")
        assert code == 200 and "ds4tp_requests" in metrics, metrics[:500]
        code, cluster = get_raw(served, "/cluster")
        assert code == 200 and len(cluster["ranks"]) == 3, cluster
        assert get_text(served, "/")[0] == 200
        assert get_raw(served, "/v1/models")[0] == 200
        c = client(served)
        assert c.completions.create(model=str(model_dir), prompt="one two", max_tokens=4).choices
        streamed = c.chat.completions.create(model=str(model_dir), max_tokens=4, stream=True,
                                             messages=[{"role": "user", "content": "three"}])
        assert list(streamed)
        # The errors: a body that is not JSON, a wrong key, a path no route takes.
        assert post_raw(served, "/v1/completions", b"{not json")[0] == 400
        assert get_text(served, "/metrics", api_key="wrong-key")[0] == 401
        assert post_raw(served, "/v1/completions", b"{}", api_key="wrong-key")[0] == 401
        assert get_raw(served, "/v1/no-such-route")[0] == 404
        # After a request, the cluster's links carry their counts: read again.
        assert get_raw(served, "/cluster")[0] == 200
        read = {where for where, _ in served.bodies.bodies}
        for where in ("GET /health", "GET /metrics", "GET /cluster", "GET /", "POST /v1/completions",
                      "POST /v1/chat/completions"):
            assert where in read, (where, read)
        if sys.platform.startswith("linux"):
            for name, p in served.procs.items():
                assert TEST_SECRET in _process_text(p.pid, "environ"), f"the {name} holds no secret"
                assert not find_secret([TEST_SECRET], _process_text(p.pid, "cmdline"), f"{name}'s title")
        assert served.leaks() == []
    finally:
        served.close()


def _wait_for_log(served: ServedPair, what: str, within: float) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = "\n".join(served.log(name) for name in served.procs)
        if what in text:
            return text
        time.sleep(0.5)
    raise AssertionError(f"no {what!r} within {within} s:\n" +
                         "\n".join(f"{name}:\n{served.log(name)[-3000:]}" for name in served.procs))


def test_a_worker_holding_another_secret_is_refused_naming_neither(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, env={"DS4_TP_TIMEOUT_SEC": "8"},
                        rank_env={"worker": {"DS4_TP_SECRET": OTHER_SECRET}})
    try:
        _wait_for_log(served, "authentication failed", 120)
        assert served.health()[0] != 200
        assert served.secrets == {TEST_SECRET, OTHER_SECRET}
        assert served.leaks() == []
    finally:
        served.close()
    # The search itself: a leak of either secret, in a log or a body, fails close() naming it.
    searched = ServedPair.__new__(ServedPair)
    searched.__dict__.update(served.__dict__, _searched=False)
    with open(tmp_path / "worker.log", "a") as log:
        log.write(f"ds4-tp: the proof's key {OTHER_SECRET.encode().hex()}\n")
    searched.bodies.add("GET /cluster", json.dumps({"secret": TEST_SECRET.replace("-", "").lower()}).encode())
    with pytest.raises(AssertionError) as leaked:
        searched.close()
    assert "worker.log line" in str(leaked.value) and "(the secret in hex)" in str(leaked.value)
    assert "HTTP body of GET /cluster line 1" in str(leaked.value), leaked.value


def test_loopback_without_any_secret_serves_as_before(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, env=NO_SECRET)
    try:
        served.wait_healthy(within=180)
        assert "DS4_TP_SECRET" not in served.envs["leader"]
        code, answer = post_raw(served, "/v1/completions", json.dumps({"prompt": "one two", "max_tokens": 4}).encode())
        assert code == 200 and answer["choices"][0]["text"] is not None, answer
        for name in served.procs:  # no word of an open group: loopback is this machine's alone
            assert "--insecure" not in served.log(name) and "ds4tp pair" not in served.log(name), served.log(name)
    finally:
        served.close()
