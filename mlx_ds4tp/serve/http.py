"""The HTTP face of `ds4tp serve` on the leader: the standard library's threading server, each
connection a Connection (serve/connection.py) that serve/routes.py answers over the Engine. The
worker runs no HTTP: it executes the leader's commands (mlx_ds4tp.lockstep.sessions) until STOP.
"""

from __future__ import annotations

import json
import select
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import anthropic, routes
from .errors import ApiError
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .state import ServeState

MAX_BODY_BYTES = 16 << 20
# What a 429 (every queue place taken) tells the client to wait before it retries.
RETRY_AFTER_SEC = 2


class Handler(BaseHTTPRequestHandler):
    """One HTTP connection, as the Connection the routes answer through. `state` is a class
    attribute of the subclass make_server makes, set once the pair is up (serve/pair.py)."""

    state: ServeState
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # noqa: D102 - quiet access log
        return

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route(routes.get)

    def do_POST(self) -> None:  # noqa: N802
        self._route(routes.post)

    def _route(self, route: Callable[[Handler, ServeState, str], None]) -> None:
        path = self._path()
        try:
            route(self, self.state, path)
        except ApiError as err:
            # The body may be unread (a refused key, an unknown path): it must not be taken for
            # the next request on this connection.
            self.close_connection = True
            headers = {"Retry-After": str(RETRY_AFTER_SEC)} if err.status == 429 else None
            self.send_json(err.status, anthropic.error_body(err) if path.startswith("/v1/messages") else err.body(),
                           headers)

    def do_OPTIONS(self) -> None:  # noqa: N802
        self.send_response(204)
        self._cors()
        self.send_header("Content-Length", "0")
        self.end_headers()

    # -- Connection -----------------------------------------------------------------
    def header(self, name: str) -> str:
        return self.headers.get(name, "")

    def read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header with the body's size is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise ApiError(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are accepted")
        return self.rfile.read(length)

    def send_json(self, status: int, body: Dict[str, Any], headers: Optional[Dict[str, str]] = None) -> None:
        data = json.dumps(body).encode()
        # Connection: close said, so a client that keeps connections alive opens a new one for
        # its next request instead of writing into a socket this side has closed.
        closing = [("Connection", "close")] if self.close_connection else []
        self._send(status, [("Content-Type", "application/json"), *(headers or {}).items(),
                            ("Content-Length", str(len(data))), *closing], data)

    def send_metrics(self, data: bytes) -> None:
        self._send(200, [("Content-Type", METRICS_CONTENT_TYPE), ("Content-Length", str(len(data)))], data, cors=False)

    def start_events(self) -> None:
        # No Content-Length: the stream ends when the connection closes.
        self._send(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), ("Connection", "close")])
        self.close_connection = True

    def write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def client_gone(self) -> bool:
        # Readable with nothing to read: the client closed its side.
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            gone = bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            gone = True
        self.close_connection = self.close_connection or gone
        return gone

    # -- plumbing -------------------------------------------------------------------
    def _send(self, status: int, headers: List[Tuple[str, str]], data: bytes = b"", cors: bool = True) -> None:
        """The status line (counted in /metrics) and headers, then `data`."""
        state = getattr(self, "state", None)
        if state is not None:
            state.metrics.answered(routes.endpoint(self._path()), status)
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if cors:
            self._cors()
        self.end_headers()
        self.wfile.write(data)

    def _cors(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        # Browser SDKs send headers of their own (the openai SDK's x-stainless-*): a preflight
        # gets back every header it asks for; "*" does not cover Authorization, so it is named.
        asked = self.headers.get("Access-Control-Request-Headers", "")
        names = [h.strip() for h in asked.split(",") if h.strip()] if asked else ["*", "Content-Type"]
        if not any(h.lower() == "authorization" for h in names):
            names.append("Authorization")
        self.send_header("Access-Control-Allow-Headers", ", ".join(names))
        self.send_header("Access-Control-Max-Age", "600")


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
