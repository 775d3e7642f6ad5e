"""GET / and GET /cluster on the leader: the cluster page (one self-contained HTML file shipped
as package data, cluster_page.html: inline CSS and script, no URL outside this server) and the
figures it polls, as JSON (serve/cluster.py's snapshot; docs/serving.md, "The cluster page")."""

from __future__ import annotations

import functools
import json
from importlib import resources

from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from ..errors import ApiError
from ..state import ServeState

PAGE_FILE = "cluster_page.html"


@functools.lru_cache(maxsize=1)
def page_html() -> bytes:
    """The page's bytes, read once from the package."""
    return resources.files(__package__).joinpath(PAGE_FILE).read_bytes()


async def page(http: HttpRequest, state: ServeState) -> Response:
    # The page holds no figure itself (it fetches /cluster with the key it keeps), so it is
    # open like /health: a browser's address bar sends no Authorization header.
    return Response(page_html(), 200, {"Cache-Control": "no-cache"}, media_type="text/html; charset=utf-8")


async def cluster(http: HttpRequest, state: ServeState) -> Response:
    if state.cluster is None:
        raise ApiError(404, "this server keeps no cluster figures (GET /cluster is the leader's, once it serves)",
                       None, "not_found")
    body = json.dumps(state.cluster.snapshot()).encode()
    return Response(body, 200, {"Cache-Control": "no-store"}, media_type="application/json")
