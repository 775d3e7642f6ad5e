"""serve/routes.py, serve/answer.py and serve/sse.py over a recording Connection and a scripted
engine: the routes' answers, statuses and streamed framing without any HTTP stack (each route a
coroutine, run here on an event loop of its own); and serve/http.py's API key middleware in front
of them, in process (Starlette's TestClient)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlx_ds4tp.serve.errors import ApiError
from mlx_ds4tp.serve.http import routes
from mlx_ds4tp.serve.http.app import make_app
from mlx_ds4tp.serve.settings import HttpSettings, ServedModel
from mlx_ds4tp.serve.state import ServeState


class Tok:
    def encode(self, text):
        return [ord(c) % 50 for c in text]


class ScriptedEngine:
    """Answers each submitted request with the next script of events."""

    def __init__(self, *scripts):
        self.scripts, self.error, self.sessions, self.submitted = list(scripts), None, None, []
        self.stats = {"decode_steps": 0}
        self.disk_cache = None

    def counts(self):
        return {"decoding": 0}

    def queued(self):
        return 0

    def kv_tokens(self):
        return 0

    def alive(self):
        return True

    def submit(self, request):
        self.submitted.append(request)
        for event in self.scripts.pop(0):
            if event[0] == "later":  # after the events before it have been read
                threading.Timer(0.3, request.events.put, (event[1],)).start()
            else:
                request.events.put(event)


class Recorder:
    """A Connection that keeps what it was sent."""

    def __init__(self, body=None, gone=False):
        self.raw = json.dumps(body).encode() if body is not None else b""
        self.gone = gone
        self.sent, self.streamed = [], b""

    async def read_body(self):
        return self.raw

    async def send_json(self, status, body, headers=None):
        self.sent.append((status, body))

    async def send_metrics(self, data):
        self.sent.append((200, data))

    async def start_events(self):
        self.sent.append((200, "events"))

    def write(self, data):
        self.streamed += data

    def client_gone(self):
        return self.gone


def state(engine, **http):
    return ServeState(engine, Tok(), ServedModel(Path("."), "m"), HttpSettings(**http),
                      context_length=64, vocab_size=50)


def events_of(streamed: bytes) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in streamed.decode().split("\n\n") if line.startswith("data: ")]


def test_unknown_endpoints_and_a_missing_key_are_refused():
    s = state(ScriptedEngine(), api_key="k")
    for route, path in [(routes.get, "/nope"), (routes.post, "/v1/nope")]:
        with pytest.raises(ApiError) as info:
            asyncio.run(route(Recorder(), s, path))
        assert info.value.status == 404
    # The key is the middleware's: refused before any route, an unknown path too, in each API's
    # error shape; /health and a CORS preflight need none.
    app = TestClient(make_app(s))
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"), ("GET", "/nope")]:
        r = app.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["Access-Control-Allow-Origin"] == "*"
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"
    r = app.post("/v1/messages", content=b"{}")
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    assert app.get("/health").status_code == 200 and app.options("/v1/models").status_code == 204
    assert app.get("/nope", headers={"Authorization": "Bearer k"}).status_code == 404
    for headers in ({"Authorization": "Bearer k"}, {"x-api-key": "k"}):
        r = app.get("/v1/models", headers=headers)
        assert (r.status_code, r.json()) == (200, {"object": "list", "data": [
            {"id": "m", "object": "model", "created": s.created, "owned_by": "mlx_ds4tp"}]})


def test_a_whole_completion_and_its_usage():
    engine = ScriptedEngine([("text", "ab", []), ("text", "c", []), ("done", "stop")])
    conn = Recorder({"prompt": "hi", "max_tokens": 4})
    asyncio.run(routes.post(conn, state(engine), "/v1/completions"))
    ((status, body),) = conn.sent
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 2 and engine.submitted[0].max_tokens == 4


def test_a_streamed_completion_is_framed_as_server_sent_events():
    engine = ScriptedEngine([("text", "ab", []), ("done", "length")])
    conn = Recorder({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}})
    asyncio.run(routes.post(conn, state(engine), "/v1/completions"))
    chunks = events_of(conn.streamed)
    assert conn.sent == [(200, "events")] and chunks[-1] == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["ab", ""]
    assert chunks[1]["choices"][0]["finish_reason"] == "length" and chunks[2]["choices"] == []


def test_an_error_before_the_first_event_is_raised_and_after_it_is_an_event():
    with pytest.raises(ApiError) as info:
        asyncio.run(routes.post(Recorder({"prompt": "hi", "stream": True}), state(ScriptedEngine([("busy", "full")])),
                                "/v1/completions"))
    assert info.value.status == 429
    conn = Recorder({"prompt": "hi", "stream": True})
    asyncio.run(routes.post(conn, state(ScriptedEngine([("text", "a", []), ("later", ("failed", "boom"))])),
                            "/v1/completions"))
    chunks = events_of(conn.streamed)
    assert chunks[0]["choices"][0]["text"] == "a" and chunks[-1]["error"]["code"] == "generation_failed"
    assert "[DONE]" not in chunks


def test_a_failure_on_the_first_token_of_a_stream_is_an_event_not_a_500():
    """A grammar or sampling failure before any text: the stream opens (200) and ends with one
    error event naming the cause in one line; never a 5xx status (the pair down stays a 503)."""
    conn = Recorder({"prompt": "hi", "stream": True})
    engine = ScriptedEngine([("failed", "grammar refused token 7\nstate dump")])
    asyncio.run(routes.post(conn, state(engine), "/v1/completions"))
    assert conn.sent == [(200, "events")]
    (event,) = events_of(conn.streamed)
    assert event["error"]["code"] == "generation_failed" and "grammar refused token 7" in event["error"]["message"]
    assert "state dump" not in event["error"]["message"]
    with pytest.raises(ApiError) as info:
        asyncio.run(routes.post(Recorder({"prompt": "hi", "stream": True}),
                                state(ScriptedEngine([("error", "worker gone")])), "/v1/completions"))
    assert info.value.status == 503


def test_a_client_gone_cancels_its_request_and_nothing_is_sent():
    engine = ScriptedEngine([])  # no event ever comes
    conn = Recorder({"prompt": "hi"}, gone=True)
    asyncio.run(routes.post(conn, state(engine, keepalive_sec=0.05), "/v1/completions"))
    assert conn.sent == [] and engine.submitted[0].cancelled


def test_count_tokens_answers_without_generating():
    engine = ScriptedEngine()
    conn = Recorder({"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    asyncio.run(routes.post(conn, state(engine), "/v1/messages/count_tokens"))
    ((status, body),) = conn.sent
    assert status == 200 and body["input_tokens"] > 0 and engine.submitted == []
