"""The leader's HTTP server: uvicorn running serve/http/app.py's application on one event loop in
the leader's main thread, HTTP/1.1 parsed by h11. No thread per connection: an idle or slow
client costs a socket and a few objects, and is closed by a timeout:
  - keep-alive: a connection idle this long after its last answer (uvicorn's own timer);
  - headers: a connection whose request line and headers are not all in this long after it
    opened (or after its last answer). uvicorn has no such timer (its h11 protocol waits for
    headers forever), so _HeaderTimeoutProtocol adds one;
  - body: as long again for a request's body once its headers are in (serve/http/routes.py's
    read_body, which answers 408).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...base.log import log
from ..settings import HttpSettings
from ..state import ServeState
from .app import make_app

BACKLOG = 2048  # many agents connecting at once must not overflow the accept queue
# Ctrl-C: answers under way get this long to finish before they are cut.
GRACEFUL_STOP_SEC = 1.0


class _HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a timer on the request's headers (see the module docstring);
    `header_timeout` is set by the subclass HttpServer makes."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # waiting for the next request's headers

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _ToOurLog(logging.Handler):
    """uvicorn's warnings and errors (a malformed request, a fault in the application) as our
    log lines; its start-up chatter stays out."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        log(f"serve: http: {text}")


class _Server(uvicorn.Server):
    """uvicorn's server, telling `on_stop` first when a signal stops it."""

    on_stop: Optional[Callable[[], None]] = None

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        if self.on_stop is not None:
            self.on_stop()
        super().handle_exit(sig, frame)


class HttpServer:
    """The listening socket, bound at once (a taken port fails before the pair is joined and the
    weights are loaded), and the server that answers on it once the state is ready."""

    def __init__(self, http: HttpSettings):
        host, port = http.host, http.port
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
        # without it each answer after a kept-alive connection's first waited 40 ms (Nagle's
        # algorithm against the client's delayed ACK).
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                    socket.IPPROTO_TCP)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(BACKLOG)
        except OSError as exc:
            self.socket.close()
            raise RuntimeError(f"cannot serve HTTP on {host}:{port} ({exc}); pick another --port or "
                               "--host") from None
        self.http, self.port = http, self.socket.getsockname()[1]

    def serve(self, state: ServeState, on_stop: Optional[Callable[[], None]] = None) -> None:
        """Answer HTTP until SIGINT or SIGTERM (uvicorn catches them, lets the answers under way
        finish for GRACEFUL_STOP_SEC, then raises the signal again for the caller); on_stop is
        called as the signal arrives (in its handler: it must only set a flag)."""
        protocol = type("Protocol", (_HeaderTimeoutProtocol,), {"header_timeout": self.http.header_timeout_sec})
        uvicorn_log = logging.getLogger("uvicorn")
        uvicorn_log.propagate = False
        uvicorn_log.setLevel(logging.WARNING)
        if not any(isinstance(h, _ToOurLog) for h in uvicorn_log.handlers):
            uvicorn_log.addHandler(_ToOurLog())
        config = uvicorn.Config(make_app(state), http=protocol, lifespan="off", log_config=None,
                                access_log=False, timeout_keep_alive=self.http.keep_alive_timeout_sec,
                                timeout_graceful_shutdown=GRACEFUL_STOP_SEC, backlog=BACKLOG)
        server = _Server(config)
        server.on_stop = on_stop
        server.run(sockets=[self.socket])

    def close(self) -> None:
        self.socket.close()
