"""The HTTP face of `ds4tp serve` on the leader: an ASGI application (Starlette, its own
routing: serve/http/routes.py) on one event loop (uvicorn runs it: serve/http/server.py), with
CORS and --api-key as middleware in front of every route (serve/http/middleware.py).

A whole answer is sent once the engine is done with its request; a streamed one as Starlette's
StreamingResponse, written as the engine produces it. A client that closes its connection
(uvicorn tells at once) cancels its request: the engine frees its row at its next turn.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware

from ..state import ServeState
from .middleware import ApiKey, Cors
from .routes import not_found, routes


def make_app(state: ServeState) -> Starlette:
    """The application answering every request over `state`: CORS outermost, so a refusal
    carries its headers too; a method or path no route takes is OpenAI's 404."""
    app = Starlette(routes=routes(), middleware=[Middleware(Cors), Middleware(ApiKey, state=state)],
                    exception_handlers={404: not_found, 405: not_found})
    app.state.serve = state
    return app
