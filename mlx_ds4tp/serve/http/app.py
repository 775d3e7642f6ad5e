"""The HTTP face of `ds4tp serve` on the leader: an ASGI application (Starlette) that answers
every request through serve/routes.py over a Connection, on one event loop (uvicorn runs it:
serve/http_server.py), with --api-key and CORS as middleware in front of every route.

Each request's route runs as a task of its own: a whole answer is sent once the route is done,
a streamed one as Starlette's StreamingResponse while the route goes on writing its events. A
client that closes its connection cancels that task (uvicorn tells at once), which cancels the
request: the engine frees its row at its next turn. A body not all in within --header-timeout-sec
of its headers is answered 408: a client that stalls mid-body holds a socket that long, no more.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...base.log import log
from ..dialects import anthropic
from ..errors import ApiError, ClientGone
from ..state import ServeState
from . import routes
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

MAX_BODY_BYTES = 16 << 20
# What a 429 (every queue place taken) tells the client to wait before it retries.
RETRY_AFTER_SEC = 2


class HttpConnection:
    """One request as the Connection the routes answer through (serve/connection.py)."""

    def __init__(self, request: HttpRequest, state: ServeState, path: str):
        self._request, self._state, self._path = request, state, path
        self.response: Optional[Response] = None  # set once the answer starts
        self.decided = asyncio.Event()  # the response is known (or the route ended without one)
        self.task: Optional[asyncio.Task] = None  # the route's, cancelled when the client goes
        self._chunks: Optional[asyncio.Queue] = None  # a stream's events, None: its end
        self._gone = False
        self._watcher: Optional[asyncio.Task] = None

    # -- Connection -----------------------------------------------------------------
    async def read_body(self) -> bytes:
        try:
            length = int(self._request.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header with the body's size is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise ApiError(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are accepted")
        timeout = self._state.http.header_timeout_sec
        try:
            body = await asyncio.wait_for(self._request.body(), timeout)
        except asyncio.TimeoutError:
            log(f"serve: a {length}-byte body to {self._path} not in {timeout:g} s after its headers: answered 408")
            raise ApiError(408, f"the request's {length}-byte body did not all arrive within {timeout:g} s of its "
                           "headers; send the whole body at once (the server's --header-timeout-sec)", None,
                           "request_timeout") from None
        except ClientDisconnect:
            raise ClientGone() from None  # it hung up mid-body: nobody to answer
        # The body read, the next thing the client can say is that it left.
        self._watcher = asyncio.ensure_future(self._watch())
        return body

    async def send_json(self, status: int, body: Dict[str, Any], headers: Optional[Dict[str, str]] = None) -> None:
        self.answer(Response(json.dumps(body).encode(), status, headers, media_type="application/json"))

    async def send_metrics(self, data: bytes) -> None:
        self.answer(Response(data, 200, media_type=METRICS_CONTENT_TYPE))

    async def start_events(self) -> None:
        self._chunks = asyncio.Queue()
        self.answer(StreamingResponse(self._events(), 200, {"Cache-Control": "no-cache"},
                                      media_type="text/event-stream"))

    def write(self, data: bytes) -> None:
        if self._gone:
            raise ConnectionResetError("the client closed the connection")
        self._chunks.put_nowait(data)

    def client_gone(self) -> bool:
        return self._gone

    # -- plumbing -------------------------------------------------------------------
    def answer(self, response: Response) -> None:
        self._state.metrics.answered(routes.endpoint(self._path), response.status_code)
        self.response = response
        self.decided.set()

    def finish(self) -> None:
        """The route is done: a stream ends after what it wrote."""
        if self._chunks is not None:
            self._chunks.put_nowait(None)
        self.decided.set()

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch(self) -> None:
        while True:
            message = await self._request.receive()
            if message["type"] == "http.disconnect":
                self._gone = True
                if self.task is not None:
                    self.task.cancel()
                return

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            while True:
                chunks = [await self._chunks.get()]
                # What piled up while the loop was busy goes out in one write.
                while chunks[-1] is not None and not self._chunks.empty():
                    chunks.append(self._chunks.get_nowait())
                data = b"".join(c for c in chunks if c is not None)
                if data:
                    yield data
                if chunks[-1] is None:
                    return
        finally:
            # Written whole, or the client left (Starlette cancels the stream when it sees the
            # disconnect): either way nothing more is to be answered.
            self._gone = True
            if self.task is not None:
                self.task.cancel()
            self.stop_watching()


def _raw_path(scope: Scope) -> str:
    """The path as the client sent it (still %-encoded: the routes decode a model id once)."""
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if raw else scope["path"]


def error_response(err: ApiError, path: str) -> Response:
    """A refused request's answer, in its API's error shape (Anthropic's under /v1/messages).
    Connection: close, because its body may be unread (a refused key, an unknown path, a body
    late): a kept-alive client opens a new connection rather than write into a closed one."""
    headers = {"Connection": "close", **({"Retry-After": str(RETRY_AFTER_SEC)} if err.status == 429 else {})}
    body = anthropic.error_body(err) if path.startswith("/v1/messages") else err.body()
    return Response(json.dumps(body).encode(), err.status, headers, media_type="application/json")


async def _route(route: Callable[..., Awaitable[None]], conn: HttpConnection, state: ServeState, path: str) -> None:
    try:
        await route(conn, state, path)
    except ApiError as err:
        conn.answer(error_response(err, path))
    except ClientGone:
        pass  # it left mid-body: nobody reads an answer
    except Exception as exc:
        if not isinstance(conn.response, StreamingResponse):
            raise  # Starlette answers 500 and uvicorn logs it
        # The status line is out: the stream ends short (no [DONE]) and the fault is logged.
        log(f"serve: a streamed answer to {path} failed: {type(exc).__name__}: {exc}")
    finally:
        conn.finish()


async def _endpoint(request: HttpRequest) -> Response:
    state: ServeState = request.app.state.serve
    path = _raw_path(request.scope)
    conn = HttpConnection(request, state, path)
    route = routes.post if request.method == "POST" else routes.get
    conn.task = asyncio.ensure_future(_route(route, conn, state, path))
    try:
        await conn.decided.wait()
        if isinstance(conn.response, StreamingResponse):
            return conn.response  # the route goes on writing its events
        await asyncio.wait([conn.task])
    except asyncio.CancelledError:
        conn.task.cancel()
        raise
    finally:
        if not isinstance(conn.response, StreamingResponse):
            conn.stop_watching()
    if conn.response is not None:
        return conn.response
    if not conn.task.cancelled() and conn.task.exception() is not None:
        raise conn.task.exception()  # a fault of ours: Starlette answers 500
    return Response(status_code=204)  # the client left before its answer: nobody reads this


def cors_headers(asked: str) -> List[tuple]:
    """The CORS headers every answer carries: any origin; a preflight gets back every header
    it asks for (browser SDKs send their own, the openai SDK's x-stainless-*), and "*" does
    not cover Authorization, so it is named."""
    names = [h.strip() for h in asked.split(",") if h.strip()] if asked else ["*", "Content-Type"]
    if not any(h.lower() == "authorization" for h in names):
        names.append("Authorization")
    return [(b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", ", ".join(names).encode("latin-1")),
            (b"access-control-max-age", b"600")]


class Cors:
    """CORS as middleware: our own, not Starlette's CORSMiddleware, because the answers
    browsers and clients already rely on are these: every answer carries the headers, Origin
    or not, and a preflight (any OPTIONS) is a 204 whatever it names."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = next((v.decode("latin-1") for k, v in scope["headers"]
                      if k == b"access-control-request-headers"), "")
        headers = cors_headers(asked)
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _key_given(scope: Scope, key: str) -> bool:
    headers = Headers(scope=scope)
    given, other = headers.get("Authorization", ""), headers.get("x-api-key", "")  # x-api-key: Anthropic's clients
    return (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())) or \
        bool(other) and hmac.compare_digest(other.encode(), key.encode())


class ApiKey:
    """--api-key as middleware: a request that does not name the key gets 401 before any route
    sees it, an unknown path too. /health is open (load balancers and the pair's own
    probes poll it keyless), and a CORS preflight is answered by Cors, in front of this."""

    def __init__(self, app: ASGIApp, state: ServeState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.state.http.api_key
        path = _raw_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or not key or path == "/health" or _key_given(scope, key):
            await self.app(scope, receive, send)
            return
        self.state.metrics.answered(routes.endpoint(path), 401)
        err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with the key given to "
                       "`ds4tp serve --api-key` (or 'x-api-key: KEY')", None, "invalid_api_key", "authentication_error")
        await error_response(err, path)(scope, receive, send)


def make_app(state: ServeState) -> Starlette:
    """The application answering every request over `state`: CORS outermost, so a refusal
    carries its headers too."""
    app = Starlette(routes=[Route("/{path:path}", _endpoint, methods=["GET", "POST"])],
                    middleware=[Middleware(Cors), Middleware(ApiKey, state=state)])
    app.state.serve = state
    return app
