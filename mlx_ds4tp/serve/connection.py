"""What the routes of `ds4tp serve` (serve/routes.py, each API's answer) need of the HTTP stack
that carries a request: its body in, the answer out (its headers the stack reads: the body's
size, the API key). serve/http.py is the one stack (Starlette on uvicorn); the routes never see
it, so another stack implements this, and answers the ApiError a route raises before its answer
starts (serve/http.py's error_response), and nothing else.
The routes are coroutines on the stack's event loop: what waits on the client is awaited."""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol


class Connection(Protocol):
    """One request being answered."""

    async def read_body(self) -> bytes: ...  # ApiError 411 / 413: its size missing or too large; 408: it came late
    async def send_json(self, status: int, body: Dict[str, Any], headers: Optional[Dict[str, str]] = None) -> None: ...
    async def send_metrics(self, data: bytes) -> None: ...  # GET /metrics's 200: the Prometheus text
    async def start_events(self) -> None: ...  # a streamed answer's 200 and headers; write() sends its events
    def write(self, data: bytes) -> None: ...  # queued to be sent in order; OSError when the client is gone
    def client_gone(self) -> bool: ...  # True when the client closed its side (and this connection closes)
