"""The leader's HTTP face on one event loop (serve/http/app.py, serve/http/server.py), end to end on a
served pair: idle connections hold no thread, a client that never finishes its headers is closed
at the header timeout, one that stalls mid-body is answered 408 then, and a streaming client that
hangs up frees its batch row at once."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import time

import pytest

from serveutil import API_KEY, ServedPair, build_chat_model, client, open_stream, reference, text_ids

HEADER_TIMEOUT = 6.0
IDLE_CONNECTIONS = 500


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("http-model"))


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    served = ServedPair(model_dir, tmp_path_factory.mktemp("http-logs"),
                        extra=["--header-timeout-sec", str(HEADER_TIMEOUT)])
    try:
        served.wait_healthy()
        yield served
    finally:
        served.close()


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def completes(pair: ServedPair, model_dir, words: str):
    """A check that a whole completion of `words` is answered as mlx-lm answers it."""
    c, prompt = client(pair), text_ids(model_dir, words)
    want = reference(model_dir, prompt, 4)
    return lambda: c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=4).choices[0].text == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the leader's thread count from /proc (Linux)")
def test_idle_connections_hold_no_thread_and_are_closed_at_the_header_timeout(pair, model_dir):
    leader, answered = pair.procs["leader"].pid, completes(pair, model_dir, "idle")
    assert answered()
    idle = threads(leader)
    socks, opened = [], []
    try:
        for _ in range(IDLE_CONNECTIONS):
            # A request line and one header, the rest never sent: the slow client.
            s = socket.create_connection(("127.0.0.1", pair.port), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
            opened.append(time.monotonic())
        busy = threads(leader)
        t0 = time.monotonic()
        right = answered()
        took = time.monotonic() - t0
        print(f"leader threads: {idle} idle, {busy} with {IDLE_CONNECTIONS} idle connections; "
              f"a request answered in {took * 1000:.0f} ms meanwhile")
        assert busy <= idle + 10, (idle, busy)
        assert right and took < 5, took
        # Every one of them is closed by the server once its headers are late, not before.
        for s, at in zip(socks, opened):
            s.settimeout(max(0.1, at + HEADER_TIMEOUT + 20 - time.monotonic()))
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        closed = time.monotonic()
        assert closed - opened[-1] >= HEADER_TIMEOUT * 0.9, closed - opened[-1]
    finally:
        for s in socks:
            s.close()
    assert pair.health()[0] == 200


def test_a_streaming_client_that_hangs_up_frees_its_row_within_100_ms(pair):
    from mlx_ds4tp.synthetic.tiny_model import EOS_ID

    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True,
                       "logit_bias": {str(EOS_ID): -100}}).encode()
    poll = http.client.HTTPConnection("127.0.0.1", pair.port, timeout=30)

    def decoding() -> int:
        poll.request("GET", "/health", headers={"Authorization": f"Bearer {API_KEY}"})
        return json.loads(poll.getresponse().read())["decoding"]

    freed = []
    try:
        for _ in range(3):
            sock = open_stream(pair, body)
            assert decoding() == 1
            t0 = time.monotonic()
            sock.close()
            deadline = t0 + 30
            while decoding() and time.monotonic() < deadline:
                pass
            freed.append(time.monotonic() - t0)
            assert decoding() == 0
    finally:
        poll.close()
    print("rows freed after the client hung up in " + ", ".join(f"{f * 1000:.1f}" for f in freed) + " ms")
    # The median of three: the time includes this test's own polling, on a shared machine.
    assert sorted(freed)[1] < 0.1, freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the leader's thread count from /proc (Linux)")
def test_a_body_that_stops_short_is_answered_408_at_the_timeout_holding_no_thread(pair, model_dir):
    leader, answered = pair.procs["leader"].pid, completes(pair, model_dir, "slow body")
    assert answered()
    idle, timed_out = threads(leader), pair.log("leader").count("after its headers: answered 408")
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
            b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", pair.port), timeout=30) as s:
        s.sendall(head + body[:len(body) // 2])  # one that hangs up mid-body instead: no fault logged
    socks, opened = [], []
    try:
        for _ in range(20):
            # Whole headers, then half the body Content-Length promises, and nothing more.
            s = socket.create_connection(("127.0.0.1", pair.port), timeout=30)
            s.sendall(head + body[:len(body) // 2])
            socks.append(s)
            opened.append(time.monotonic())
        busy = threads(leader)
        # The engine is not held: a whole request is answered while they stall.
        assert answered()
        assert busy <= idle + 10, (idle, busy)
        for s, at in zip(socks, opened):
            s.settimeout(max(0.1, at + HEADER_TIMEOUT + 20 - time.monotonic()))
            answer = b""
            while chunk := s.recv(65536):  # the answer, then the server closes
                answer += chunk
            top, _, rest = answer.partition(b"\r\n\r\n")
            assert top.startswith(b"HTTP/1.1 408 ") and b"connection: close" in top.lower(), answer
            assert json.loads(rest)["error"]["code"] == "request_timeout"
        assert time.monotonic() - opened[-1] >= HEADER_TIMEOUT * 0.9
    finally:
        for s in socks:
            s.close()
    assert pair.log("leader").count("after its headers: answered 408") - timed_out == 20
    assert "ClientDisconnect" not in pair.log("leader")
    assert pair.health()[1]["decoding"] == 0 and threads(leader) <= idle + 10
