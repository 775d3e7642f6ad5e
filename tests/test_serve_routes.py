"""serve/routes.py, serve/answer.py and serve/sse.py over a recording Connection and a scripted
engine: the routes' answers, statuses and streamed framing without any HTTP stack (each route a
coroutine, run here on an event loop of its own); and serve/http.py's API key middleware in front
of them, in process (Starlette's TestClient)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from starlette.testclient import TestClient

from mlx_ds4tp.serve.engine.events import BusyEvent, DoneEvent, FailedEvent, PairDownEvent, StartedEvent, TextEvent
from mlx_ds4tp.serve.engine.generation import Ticket
from mlx_ds4tp.serve.http.app import make_app
from mlx_ds4tp.serve.settings import HttpSettings, ServedModel
from mlx_ds4tp.serve.state import ServeState


class Tok:
    def encode(self, text):
        return [ord(c) % 50 for c in text]


class Later:
    """A script's event put once the events before it have been read (0.3 s on)."""

    def __init__(self, event):
        self.event = event


class ScriptedEngine:
    """Answers each submitted request with the next script of events; records the cancels."""

    def __init__(self, *scripts):
        self.scripts, self.error, self.sessions, self.submitted = list(scripts), None, None, []
        self.cancelled = []
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
        ticket = Ticket(len(self.submitted), request)
        for event in self.scripts.pop(0):
            if isinstance(event, Later):
                threading.Timer(0.3, ticket.events.put, (event.event,)).start()
            else:
                ticket.events.put(event)
        return ticket

    def cancel(self, ticket_id):
        self.cancelled.append(ticket_id)


def state(engine, **http):
    return ServeState(engine, Tok(), ServedModel(Path("."), "m"), HttpSettings(**http),
                      context_length=64, vocab_size=50)


def events_of(streamed: bytes) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in streamed.decode().split("\n\n") if line.startswith("data: ")]


def client(engine, **http) -> TestClient:
    return TestClient(make_app(state(engine, **http)))


def test_unknown_endpoints_and_a_missing_key_are_refused():
    app = client(ScriptedEngine())
    for method, path in [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/chat/completions"),
                         ("POST", "/v1/models")]:
        r = app.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path)
    s = state(ScriptedEngine(), api_key="k")
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
    r = app.get("/models/m", headers={"x-api-key": "k"})
    assert r.status_code == 200 and r.json()["id"] == "m"
    r = app.get("/v1/models/other", headers={"x-api-key": "k"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_whole_completion_and_its_usage():
    engine = ScriptedEngine([StartedEvent(1), TextEvent("ab", 2), TextEvent("c", 3), DoneEvent("stop", 4)])
    r = client(engine).post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["text"] == "abc"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.submitted[0].max_tokens == 4
    # The counts are the events': the done event's tokens, the started event's reused prompt.
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 1}}


def test_a_streamed_completion_is_framed_as_server_sent_events():
    engine = ScriptedEngine([TextEvent("ab", 2), DoneEvent("length", 2)])
    r = client(engine).post("/completions", json={"prompt": "hi", "stream": True,
                                                  "stream_options": {"include_usage": True}})
    chunks = events_of(r.content)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert chunks[-1] == "[DONE]" and [c["choices"][0]["text"] for c in chunks[:2]] == ["ab", ""]
    assert chunks[1]["choices"][0]["finish_reason"] == "length" and chunks[2]["choices"] == []


def test_an_error_before_the_first_event_is_a_status_and_after_it_an_event():
    r = client(ScriptedEngine([BusyEvent("full")])).post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == 429 and r.headers["Retry-After"] == "2"
    r = client(ScriptedEngine([TextEvent("a", 1), Later(FailedEvent("boom"))])).post(
        "/v1/completions", json={"prompt": "hi", "stream": True})
    chunks = events_of(r.content)
    assert chunks[0]["choices"][0]["text"] == "a" and chunks[-1]["error"]["code"] == "generation_failed"
    assert "[DONE]" not in chunks


def test_a_failure_on_the_first_token_of_a_stream_is_an_event_not_a_500():
    """A grammar or sampling failure before any text: the stream opens (200) and ends with one
    error event naming the cause in one line; never a 5xx status (the pair down stays a 503)."""
    engine = ScriptedEngine([FailedEvent("grammar refused token 7\nstate dump")])
    r = client(engine).post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == 200
    (event,) = events_of(r.content)
    assert event["error"]["code"] == "generation_failed" and "grammar refused token 7" in event["error"]["message"]
    assert "state dump" not in event["error"]["message"]
    r = client(ScriptedEngine([PairDownEvent("worker gone")])).post("/v1/completions",
                                                                json={"prompt": "hi", "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == "pair_unavailable"


def test_bodies_that_cannot_be_read_are_refused():
    app = client(ScriptedEngine())
    assert app.post("/v1/completions", content=b"{nope").json()["error"]["code"] == "invalid_json"
    assert app.post("/v1/completions", content=b"[1]").status_code == 400
    r = app.post("/v1/completions", content=b"x" * 10, headers={"Content-Length": str(32 << 20)})
    assert r.status_code == 413


def test_a_client_gone_cancels_its_request_and_nothing_is_answered():
    """The ASGI app called directly: the body, then the client hangs up while the engine has not
    answered; the request is cancelled at once and no answer is started."""
    engine = ScriptedEngine([])  # no event ever comes
    app = make_app(state(engine, keepalive_sec=30))
    body = json.dumps({"prompt": "hi"}).encode()
    sent = []

    async def run():
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
                 "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]}
        task = asyncio.ensure_future(app(scope, receive, send))
        while not engine.submitted:
            await asyncio.sleep(0.01)
        assert not engine.cancelled
        gone.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
    assert engine.cancelled == [1]
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] in ([], [204])


def test_count_tokens_answers_without_generating():
    engine = ScriptedEngine()
    r = client(engine).post("/v1/messages/count_tokens",
                            json={"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0 and engine.submitted == []
