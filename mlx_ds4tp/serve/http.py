"""The HTTP face of `ds4tp serve` on the leader: an OpenAI-compatible API over the Engine.

Endpoints: GET /health (200 only while the pair is up), GET /v1/models, POST
/v1/chat/completions and POST /v1/completions (streamed as server-sent events on request).
The worker runs no HTTP: it executes the leader's commands (mlx_ds4tp.lockstep.sessions) until STOP.
"""

from __future__ import annotations

import hmac
import itertools
import json
import queue
import select
import socket
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional

from .errors import ApiError, ClientGone, PairUnavailable
from .api import ParsedRequest, ResponseShape, parse_request, usage
from . import anthropic, responses
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServeMetrics, TokenClock
from .other_apis import OtherApis
from .chat import ChatText
from .engine import Engine, Request
from .settings import HttpSettings, ServedModel

MAX_BODY_BYTES = 16 << 20
# How often a request waiting for its next token checks that the engine is still alive. The
# engine itself never waits on the worker past the gate timeout: it fails the pair instead,
# and every waiting request gets the reason.
EVENT_POLL_SEC = 1.0
# What a 429 (every queue place taken) tells the client to wait before it retries.
RETRY_AFTER_SEC = 2
# How often a request being answered looks whether its client is still connected.
CLIENT_CHECK_SEC = 0.5


class ServeState:
    """What the handler threads share: the engine and the server's fixed answers."""

    def __init__(self, engine: Engine, tokenizer, served: ServedModel, http: HttpSettings,
                 context_length: int, vocab_size: int):
        self.engine = engine
        self.tokenizer = tokenizer
        # model_id is the one /v1/models lists (--served-model-name); a request may also name
        # an alias (the model as --model gave it, its directory), answered under its own name.
        self.model_id = served.name
        self.model_ids = list(served.ids)
        self.api_key = http.api_key
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.default_max_tokens = http.default_max_tokens
        self.defaults = http.sampling
        if not http.keepalive_sec > 0:
            raise ValueError(f"--keepalive-sec {http.keepalive_sec}: give a positive number of seconds")
        self.keepalive_sec = http.keepalive_sec
        self.responses = responses.ResponseStore()
        self.metrics = ServeMetrics(engine, getattr(getattr(engine.sessions, "group", None), "gate_latency_us", None))
        self.created = int(time.time())


def unavailable(reason: str) -> ApiError:
    """The 503 every request gets once the pair is down."""
    return ApiError(503, f"the two-machine pair is down ({reason}); start the worker's `ds4tp serve` "
                    "again (the leader takes it back, no restart needed) and retry",
                    None, "pair_unavailable", "server_error")


class Handler(OtherApis, BaseHTTPRequestHandler):
    """One HTTP connection. `state` is a class attribute of the subclass make_server makes,
    set once the pair is up (serve_main)."""

    state: ServeState
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # noqa: D102 - quiet access log
        return

    # -- plumbing ---------------------------------------------------------------
    def _answered(self, status: int) -> None:
        path = self.path.split("?", 1)[0]
        known = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/responses", "/v1/models", "/health", "/metrics")
        endpoint = path if path in known else ("/v1/models/{id}" if "/models/" in path else "other")
        state = getattr(self, "state", None)
        if state is not None:
            state.metrics.answered(endpoint, status)

    def _send_json(self, status: int, body: Dict[str, Any], headers: Optional[Dict[str, str]] = None) -> None:
        self._answered(status)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            # Said, so a client that keeps connections alive opens a new one for its next
            # request instead of writing into a socket this side has closed.
            self.send_header("Connection", "close")
        self._cors()
        self.end_headers()
        self.wfile.write(data)

    def _cors(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        # Browser SDKs send headers of their own (the openai SDK's x-stainless-*): a preflight
        # gets back every header it asks for; "*" does not cover Authorization, so it is named.
        asked = self.headers.get("Access-Control-Request-Headers", "") if self.headers else ""
        names = [h.strip() for h in asked.split(",") if h.strip()]
        if not any(h.lower() == "authorization" for h in names):
            names.append("Authorization")
        self.send_header("Access-Control-Allow-Headers", ", ".join(names if asked else ["*", "Content-Type", "Authorization"]))
        self.send_header("Access-Control-Max-Age", "600")

    def _error(self, err: ApiError, headers: Optional[Dict[str, str]] = None) -> None:
        # The body may be unread (a refused key, an unknown path): it must not be taken for
        # the next request on this connection.
        self.close_connection = True
        if err.status == 429:
            headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_SEC)}
        self._send_json(err.status, anthropic.error_body(err) if self._is_messages() else err.body(), headers)

    def _is_messages(self) -> bool:
        return self.path.split("?", 1)[0].startswith("/v1/messages")

    def _authorized(self) -> bool:
        key = self.state.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode()):
            return True
        # Anthropic's clients send the key as x-api-key.
        other = self.headers.get("x-api-key", "")
        if other and hmac.compare_digest(other.encode(), key.encode()):
            return True
        self._error(ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with "
                             "the key given to `ds4tp serve --api-key` (or 'x-api-key: KEY')", None, "invalid_api_key",
                             "authentication_error"))
        return False

    def do_OPTIONS(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(204)
        self._cors()
        self.send_header("Content-Length", "0")
        self.end_headers()

    # -- GET ----------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path == "/health":
            error = self.state.engine.error
            body = {"status": "ok" if error is None else "unavailable",
                    **self.state.engine.stats, **self.state.engine.counts()}
            if error is not None:
                body["error"] = error
            self._send_json(200 if error is None else 503, body)
        elif path == "/metrics":
            if self._authorized():
                data = self.state.metrics.render()
                self._answered(200)
                self.send_response(200)
                self.send_header("Content-Type", METRICS_CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
        elif path in ("/v1/models", "/models"):
            if self._authorized():
                self._send_json(200, {"object": "list", "data": [
                    {"id": self.state.model_id, "object": "model", "created": self.state.created,
                     "owned_by": "mlx_ds4tp"}]})
        elif path.startswith(("/v1/models/", "/models/")):
            if self._authorized():
                name = urllib.parse.unquote(path.split("/models/", 1)[1])
                if name in self.state.model_ids:
                    self._send_json(200, {"id": name, "object": "model",
                                          "created": self.state.created, "owned_by": "mlx_ds4tp"})
                else:
                    self._error(ApiError(404, f"model '{name}' is not served here", "model",
                                         "model_not_found"))
        else:
            self._error(ApiError(404, f"no endpoint {path}; see GET /v1/models, POST "
                                 "/v1/chat/completions, POST /v1/completions, POST /v1/messages",
                                 None, "not_found"))

    # -- POST ---------------------------------------------------------------------
    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        kinds = {"/v1/chat/completions": "chat", "/chat/completions": "chat",
                 "/v1/completions": "text", "/completions": "text",
                 "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens",
                 "/v1/responses": "responses", "/responses": "responses"}
        if path not in kinds:
            self._error(ApiError(404, f"no endpoint POST {path}", None, "not_found"))
            return
        if not self._authorized():
            return
        try:
            parsed = self._parse(kinds[path])
            if self.state.engine.error is not None:
                raise unavailable(self.state.engine.error)
        except ApiError as err:
            self._error(err)
            return
        if kinds[path] == "count_tokens":
            self._send_json(200, {"input_tokens": len(parsed.prompt)})
            return
        request = Request(prompt=parsed.prompt, max_tokens=parsed.max_tokens,
                          options=parsed.options, stop=parsed.stop, logprobs=parsed.logprobs,
                          num_draft_tokens=parsed.num_draft_tokens)
        try:
            self.state.engine.submit(request)
        except PairUnavailable as exc:
            self._error(unavailable(str(exc)))
            return
        except ValueError as exc:
            self._error(ApiError(400, str(exc), "max_tokens", "kv_budget_exceeded"))
            return
        if kinds[path] == "messages":
            message = anthropic.MessageShape(parsed.model, len(parsed.prompt))
            (self._stream_message if parsed.stream else self._whole_message)(parsed, request, message)
            return
        if kinds[path] == "responses":
            body, messages = self._responses_request
            answer = responses.ResponseShape(body, parsed.model, len(parsed.prompt))
            (self._stream_response if parsed.stream else self._whole_response)(parsed, request, answer, messages)
            return
        shape = ResponseShape(parsed.kind, parsed.model)
        if parsed.stream:
            self._stream(parsed, request, shape)
        else:
            self._whole(parsed, request, shape)

    def _parse(self, kind: str) -> ParsedRequest:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header with the body's size is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise ApiError(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are accepted")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None
        s = self.state
        if kind in ("messages", "count_tokens"):
            if kind == "count_tokens":
                body = {**body, "max_tokens": 1} if isinstance(body, dict) else body
            body, kind = anthropic.to_chat_body(body), "chat"
        elif kind == "responses":
            chat, messages = responses.to_chat_body(body, s.responses)
            self._responses_request = (body, messages)
            body, kind = chat, "chat"
        return parse_request(body, kind, s.tokenizer, model_ids=s.model_ids,
                             default_max_tokens=s.default_max_tokens,
                             context_length=s.context_length, vocab_size=s.vocab_size,
                             defaults=s.defaults)

    def _events(self, request: Request):
        """The request's events until done; ApiError(503) when the pair fails. Text that
        piled up while this thread waited for the interpreter goes out as one event: fewer
        writes, and less time holding the lock the engine thread needs for the next step."""
        text: list = []
        items: list = []
        clock, counted = TokenClock(self.state.metrics), 0
        checked = last = time.monotonic()
        poll = min(EVENT_POLL_SEC, self.state.keepalive_sec)
        while True:
            if time.monotonic() - checked > CLIENT_CHECK_SEC:
                checked = time.monotonic()
                if self._client_gone():
                    # Nobody will read the answer: free the session on both ranks.
                    request.cancelled = True
                    raise ClientGone()
            try:
                event = request.events.get_nowait() if text else request.events.get(timeout=poll)
            except queue.Empty:
                if text:
                    yield ("text", "".join(text), items)
                    text, items = [], []
                    last = time.monotonic()
                elif not self.state.engine.alive():
                    request.cancelled = True
                    raise unavailable(self.state.engine.error or "the engine thread stopped")
                elif time.monotonic() - last >= self.state.keepalive_sec:
                    last = time.monotonic()
                    yield ("idle", None)
                continue
            last = time.monotonic()
            if event[0] == "error":
                raise unavailable(event[1])
            if event[0] == "busy":
                raise ApiError(429, event[1], None, "server_busy", "rate_limit_error")
            if event[0] == "failed":
                raise ApiError(500, f"generating this answer failed ({event[1]}); the server goes on "
                               "serving", None, "generation_failed", "server_error")
            if event[0] == "text":
                text.append(event[1])
                items.extend(event[2])
                clock.tokens(request.completion_tokens - counted)
                counted = request.completion_tokens
                continue
            if event[0] == "done":
                self.state.metrics.finished(len(request.prompt), request.completion_tokens,
                                            request.cached_tokens)
            if text:
                yield ("text", "".join(text), items)
                text, items = [], []
            yield event
            if event[0] == "done":
                return

    def _client_gone(self) -> bool:
        """True when the client closed its side (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _usage(self, parsed: ParsedRequest, request: Request) -> Dict[str, Any]:
        return usage(len(parsed.prompt), request.completion_tokens, request.cached_tokens)

    def _chat_text(self, parsed: ParsedRequest, request: Request, streaming: bool) -> Optional[ChatText]:
        if parsed.kind != "chat":
            return None
        return ChatText(self.state.tokenizer, parsed.prompt, parsed.tools, streaming)

    def _collect(self, parsed: ParsedRequest, request: Request) -> Optional[Dict[str, Any]]:
        """The whole answer: text (content), reasoning, tool calls, logprobs entries, finish
        reason; None when it failed (the error is sent) or the client left."""
        parts, items, finish = [], [], "stop"
        reasoning, calls = [], []
        chat = self._chat_text(parsed, request, streaming=False)

        def take(pieces: Dict[str, Any]) -> None:
            parts.append(pieces["content"])
            reasoning.append(pieces["reasoning"])
            calls.extend(pieces["tool_calls"])

        try:
            for event in self._events(request):
                if event[0] == "text":
                    items.extend(event[2])
                    if chat is None:
                        parts.append(event[1])
                    else:
                        take(chat.add(event[1]))
                elif event[0] == "done":
                    finish = event[1]
        except ApiError as err:
            self._error(err)
            return None
        except ClientGone:
            self.close_connection = True
            return None
        if chat is not None:
            take(chat.finish(finish))
            if chat.made_tool_call and finish == "stop":
                finish = "tool_calls"
        return {"text": "".join(parts), "reasoning": "".join(reasoning), "calls": calls,
                "items": items if request.logprobs is not None else None, "finish": finish}

    def _whole(self, parsed: ParsedRequest, request: Request, shape: ResponseShape) -> None:
        answer = self._collect(parsed, request)
        if answer is not None:
            self._send_json(200, shape.whole(answer["text"], answer["finish"], self._usage(parsed, request),
                                             answer["items"], reasoning=answer["reasoning"],
                                             tool_calls=answer["calls"]))

    def _sse_event(self, name: str, data: Dict[str, Any]) -> None:
        self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _open_stream(self, events) -> Optional[tuple]:
        """The first event, once the stream's status line and headers are out; None when the
        request failed before it (the error is sent) or the client left."""
        try:
            # The status line waits for the first event: a pair that is already down is
            # then a plain 503, like a request that does not stream.
            first = next(events)
        except ApiError as err:
            self._error(err)
            return None
        except ClientGone:
            self.close_connection = True
            return None
        self._answered(200)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        # No Content-Length: the stream ends when the connection closes.
        self.send_header("Connection", "close")
        self._cors()
        self.end_headers()
        self.close_connection = True
        return first

    def _stream(self, parsed: ParsedRequest, request: Request, shape: ResponseShape) -> None:
        events = self._events(request)
        first = self._open_stream(events)
        if first is None:
            return
        try:
            chat = self._chat_text(parsed, request, streaming=True)
            if chat is not None:
                self._sse(shape.chunk("", None, first=True))
            for event in itertools.chain([first], events):
                if event[0] == "idle":
                    # An SSE comment: clients skip it; proxies and timeouts see the stream alive.
                    self.wfile.write(b": keep-alive\n\n")
                    self.wfile.flush()
                elif event[0] == "text":
                    logprobs = event[2] if request.logprobs is not None else None
                    if chat is None:
                        self._sse(shape.chunk(event[1], None, logprobs=logprobs))
                    else:
                        self._chat_chunk(shape, chat.add(event[1]), logprobs)
                elif chat is None:
                    self._sse(shape.chunk("", event[1]))
                else:
                    self._chat_chunk(shape, chat.finish(event[1]), None)
                    finish = "tool_calls" if chat.made_tool_call and event[1] == "stop" else event[1]
                    self._sse(shape.chunk(None, finish))
            if parsed.include_usage:
                self._sse(shape.usage_chunk(self._usage(parsed, request)))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except ApiError as err:
            # The status line is already out: the error travels as an event.
            self._try_write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
        except (OSError, ClientGone):
            # The client went away (broken pipe, reset, closed): the engine frees its
            # session on both ranks at its next step.
            request.cancelled = True

    def _chat_chunk(self, shape: ResponseShape, pieces: Dict[str, Any], logprobs: Optional[list]) -> None:
        """The chunk of a piece of a chat answer, if there is anything to send."""
        if pieces["content"] or pieces["reasoning"] or pieces["tool_calls"] or logprobs:
            self._sse(shape.chunk(pieces["content"] or None, None, logprobs=logprobs,
                                  reasoning=pieces["reasoning"], tool_calls=pieces["tool_calls"]))

    def _sse(self, chunk: Dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.flush()

    def _try_write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            pass


class _Server(ThreadingHTTPServer):
    # The standard library's backlog is 5: many clients connecting at once (a burst of agent
    # calls) while the accepting thread waits for the interpreter lock overflow it, and the
    # kernel then resets some of them.
    request_queue_size = 256


def make_server(host: str, port: int) -> ThreadingHTTPServer:
    """The HTTP server, bound but not serving yet: its handlers read `state`, which the
    caller sets (server.RequestHandlerClass.state) before serve_forever. Binding first lets
    a taken port fail before the pair is joined and the weights are loaded."""
    handler = type("BoundHandler", (Handler,), {})
    try:
        server = _Server((host, port), handler)
    except OSError as exc:
        raise RuntimeError(f"cannot serve HTTP on {host}:{port} ({exc}); pick another --port or "
                           "--host") from None
    server.daemon_threads = True
    return server
