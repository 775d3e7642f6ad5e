"""The leader's HTTP face on one event loop (serve/http.py, serve/http_server.py), end to end on a
served pair: idle connections hold no thread, a client that never finishes its headers is closed
at the header timeout, and a streaming client that hangs up frees its batch row at once."""

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the leader's thread count from /proc (Linux)")
def test_idle_connections_hold_no_thread_and_are_closed_at_the_header_timeout(pair, model_dir):
    leader = pair.procs["leader"].pid
    c = client(pair)
    prompt = text_ids(model_dir, "idle")
    want = reference(model_dir, prompt, 4)
    assert c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=4).choices[0].text == want
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
        got = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=4).choices[0].text
        took = time.monotonic() - t0
        print(f"leader threads: {idle} idle, {busy} with {IDLE_CONNECTIONS} idle connections; "
              f"a request answered in {took * 1000:.0f} ms meanwhile")
        assert busy <= idle + 10, (idle, busy)
        assert got == want and took < 5, took
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
    from mlx_ds4tp.testing.tiny_model import EOS_ID

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
