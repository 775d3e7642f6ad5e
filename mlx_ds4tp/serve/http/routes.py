"""Which answer each request of `ds4tp serve` gets: Starlette's routes, one per endpoint (GET
/health, /metrics, /v1/models[/{id}]; POST each dialect's endpoints), the body read within its
timeout, parsed by its dialect (serve/dialects/) into the request the engine takes, submitted,
and answered whole or streamed. A client that leaves cancels its request (the engine frees its
row at its next turn). The API key and CORS are middleware in front (serve/http/middleware.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Dict, Optional, TypeVar

from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ...base.log import log
from ...split.transfer_progress import parts_in_flight
from ..dialects import anthropic, openai, responses
from ..dialects.answer import Answering, answer_pieces, whole_answer
from ..dialects.openai import ApiCall
from ..engine.generation import Ticket
from ..errors import GENERATION_FAILED, ApiError, ClientGoneError, PairUnavailableError, unavailable
from ..state import ServeState
from .cluster_page import cluster, page
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .sse import failed_stream, stream_bytes

MAX_BODY_BYTES = 16 << 20
# What a 429 (every queue place taken) tells the client to wait before it retries.
RETRY_AFTER_SEC = 2
_T = TypeVar("_T")

# A dialect: its parser (body, state) -> the request, and its answer to the submitted request.
Parse = Callable[[dict, ServeState], ApiCall]
Answer = Callable[[ServeState, Any, Ticket], Answering]
Endpoint = Callable[[HttpRequest], Awaitable[Response]]


def endpoint_label(path: str) -> str:
    """The endpoint a request's answer is counted under in /metrics (a bounded set of labels)."""
    if "/models/" in path:
        return "/v1/models/{id}"
    return path if path.startswith("/v1/") and path in _V1_PATHS or path in ("/health", "/metrics", "/",
                                                                              "/cluster") else "other"


def error_response(err: ApiError, path: str) -> Response:
    """A refused request's answer, in its API's error shape (Anthropic's under /v1/messages).
    Connection: close, because its body may be unread (a refused key, an unknown path, a body
    late): a kept-alive client opens a new connection rather than write into a closed one."""
    # 503 too: the group is down for a while (a worker lost: it shrinks or is taken back).
    headers = {"Connection": "close", **({"Retry-After": str(RETRY_AFTER_SEC)} if err.status in (429, 503) else {})}
    body = anthropic.error_body(err) if path.startswith("/v1/messages") else err.body()
    return Response(json.dumps(body).encode(), err.status, headers, media_type="application/json")


def _json(status: int, body: Dict[str, Any]) -> Response:
    return Response(json.dumps(body).encode(), status, media_type="application/json")


async def read_body(http: HttpRequest, state: ServeState) -> bytes:
    """The body, its size declared and bounded (411, 413), all in within --header-timeout-sec of
    its headers (408: a client that stalls mid-body holds a socket that long, no more)."""
    try:
        length = int(http.headers.get("Content-Length", ""))
    except ValueError:
        raise ApiError(411, "a Content-Length header with the body's size is required") from None
    if not 0 <= length <= MAX_BODY_BYTES:
        raise ApiError(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are accepted")
    timeout = state.http.header_timeout_sec
    try:
        return await asyncio.wait_for(http.body(), timeout)
    except asyncio.TimeoutError:
        log(f"serve: a {length}-byte body to {http.url.path} not in {timeout:g} s after its headers: answered 408")
        raise ApiError(408, f"the request's {length}-byte body did not all arrive within {timeout:g} s of its "
                       "headers; send the whole body at once (the server's --header-timeout-sec)", None,
                       "request_timeout") from None
    except ClientDisconnect:
        raise ClientGoneError() from None  # it hung up mid-body: nobody to answer


async def unless_gone(http: HttpRequest, work: Awaitable[_T]) -> _T:
    """`work`'s result, or ClientGoneError as soon as the client closes its connection (uvicorn tells
    at once), `work` cancelled then: what it was waiting for is nobody's any more."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()  # the client left, or this endpoint itself was cancelled
        watcher.cancel()
    if not task.done() or task.cancelled():
        await asyncio.wait([task])
        raise ClientGoneError()
    return task.result()


def _body_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def _submit(state: ServeState, call: ApiCall) -> Ticket:
    """A parsed call's request submitted to the engine (its KV budget checked); its ticket."""
    if state.engine.error is not None:
        raise unavailable(state.engine.error)
    try:
        return state.engine.submit(call.request)
    except PairUnavailableError as exc:
        raise unavailable(str(exc)) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "max_tokens", "kv_budget_exceeded") from None


async def _answer(http: HttpRequest, state: ServeState, parse: Parse, answer: Answer) -> Response:
    call = parse(_body_object(await read_body(http, state)), state)
    ticket = _submit(state, call)
    answering = answer(state, call, ticket)
    if not call.stream:
        whole = whole_answer(state, ticket, answering.chat, answering.usage)
        return _json(200, answering.whole(await unless_gone(http, whole)))
    pieces = answer_pieces(state, ticket, answering.chat, answering.usage)
    headers = {"Cache-Control": "no-cache"}
    try:
        # The status line waits for the first piece: a pair already down is a plain 503.
        first = await unless_gone(http, pieces.__anext__())
    except ApiError as err:
        if err.code != GENERATION_FAILED:
            raise  # the pair down (503), the queue full (429): a status the client retries on
        # This request's own sampling or grammar failed on its first token: the stream opens and
        # ends with the error event naming the cause, as it would on any later token.
        return StreamingResponse(failed_stream(answering, err), 200, headers, media_type="text/event-stream")
    return StreamingResponse(stream_bytes(answering, first, pieces, http.url.path), 200, headers,
                             media_type="text/event-stream")


def _counted(make: Callable[[HttpRequest, ServeState], Awaitable[Response]]) -> Endpoint:
    """An endpoint whose refusals (ApiError) are answered in their API's shape and whose every
    answer is counted in /metrics; a client gone before its answer gets none (204, unread)."""

    async def endpoint(http: HttpRequest) -> Response:
        state = _state(http)
        try:
            response = await make(http, state)
        except ApiError as err:
            response = error_response(err, http.url.path)
        except ClientGoneError:
            return Response(status_code=204)
        state.metrics.answered(endpoint_label(http.url.path), response.status_code)
        return response

    return endpoint


def _state(http: HttpRequest) -> ServeState:
    return http.app.state.serve


def _post(parse: Parse, answer: Answer) -> Endpoint:
    return _counted(lambda http, state: _answer(http, state, parse, answer))


async def _health(http: HttpRequest, state: ServeState) -> Response:
    error = state.engine.error
    body = {"status": "ok" if error is None else "unavailable", **state.engine.stats, **state.engine.counts(),
            **(state.resize.health() if state.resize is not None else {})}
    body.update(parts_in_flight())  # a worker receiving its part from this leader: how far, how fast
    return _json(200, body) if error is None else _json(503, {**body, "error": error})


async def _metrics(http: HttpRequest, state: ServeState) -> Response:
    return Response(state.metrics.render(), 200, media_type=METRICS_CONTENT_TYPE)


def _model(state: ServeState, name: str) -> Dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mlx_ds4tp"}


async def _models(http: HttpRequest, state: ServeState) -> Response:
    return _json(200, {"object": "list", "data": [_model(state, state.model_ids[0])]})


async def _one_model(http: HttpRequest, state: ServeState) -> Response:
    name = http.path_params["name"]
    if name not in state.model_ids:
        raise ApiError(404, f"model '{name}' is not served here", "model", "model_not_found")
    return _json(200, _model(state, name))


async def _count_tokens(http: HttpRequest, state: ServeState) -> Response:
    body = anthropic.count_tokens(_body_object(await read_body(http, state)), state)
    if state.engine.error is not None:
        raise unavailable(state.engine.error)
    return _json(200, body)


def _openai(kind: str) -> Parse:
    return lambda body, state: openai.parse(body, state, kind)


# POST endpoints: the path (each OpenAI path also without /v1, as mlx_lm.server answers),
# the dialect's parser and its answer.
_POSTS = (("/v1/chat/completions", _openai("chat"), openai.OpenAiAnswer),
          ("/v1/completions", _openai("text"), openai.OpenAiAnswer),
          ("/v1/messages", anthropic.parse, anthropic.MessagesAnswer),
          ("/v1/responses", responses.parse, responses.ResponsesAnswer))
_V1_PATHS = {p for p, _, _ in _POSTS} | {"/v1/messages/count_tokens", "/v1/models"}


def not_found(http: HttpRequest, exc: Optional[Exception] = None) -> Response:
    """No route for this method and path: OpenAI's 404, counted under "other"."""
    path = http.url.path
    _state(http).metrics.answered(endpoint_label(path), 404)
    if http.method == "GET":
        err = ApiError(404, f"no endpoint {path}; see GET /v1/models, POST /v1/chat/completions, "
                       "POST /v1/completions, POST /v1/messages", None, "not_found")
    else:
        err = ApiError(404, f"no endpoint {http.method} {path}", None, "not_found")
    return error_response(err, path)


def routes() -> list:
    """Every endpoint of `ds4tp serve` as Starlette's routes."""
    out = [Route("/health", _counted(_health), methods=["GET"]),
           Route("/metrics", _counted(_metrics), methods=["GET"]),
           Route("/", _counted(page), methods=["GET"]),
           Route("/cluster", _counted(cluster), methods=["GET"]),
           Route("/v1/messages/count_tokens", _counted(_count_tokens), methods=["POST"])]
    for prefix in ("/v1", ""):
        out += [Route(f"{prefix}/models", _counted(_models), methods=["GET"]),
                Route(f"{prefix}/models/{{name:path}}", _counted(_one_model), methods=["GET"])]
    for path, parse, answer in _POSTS:
        endpoint = _post(parse, answer)
        out.append(Route(path, endpoint, methods=["POST"]))
        if path != "/v1/messages":
            out.append(Route(path[3:], endpoint, methods=["POST"]))
    return out
