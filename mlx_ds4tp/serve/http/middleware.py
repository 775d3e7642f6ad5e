"""--api-key and CORS as middleware in front of every route of `ds4tp serve`'s HTTP face."""

from __future__ import annotations

import hmac
from typing import List

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ApiError
from ..state import ServeState
from .routes import endpoint_label, error_response


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
    probes poll it keyless), / too (the cluster page: it holds no figure, it asks /cluster
    with the key), and a CORS preflight is answered by Cors, in front of this."""

    def __init__(self, app: ASGIApp, state: ServeState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.state.http.api_key
        path = scope.get("path", "")
        if scope["type"] != "http" or not key or path in ("/health", "/") or _key_given(scope, key):
            await self.app(scope, receive, send)
            return
        self.state.metrics.answered(endpoint_label(path), 401)
        err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with the key given to "
                       "`ds4tp serve --api-key` (or 'x-api-key: KEY')", None, "invalid_api_key", "authentication_error")
        await error_response(err, path)(scope, receive, send)
