"""Which answer each request of `ds4tp serve` gets: its endpoint, the body checked into a
ParsedRequest and submitted to the engine, then each API's answer (serve/api.py, anthropic.py,
responses.py). Over a Connection (serve/connection.py): no HTTP stack here, and no API key
(serve/http.py's middleware checked it). A request refused before its answer starts raises
ApiError; the stack answers it."""

from __future__ import annotations

import json
import urllib.parse
from typing import Optional, Tuple

from ..connection import Connection
from ..dialects import anthropic, openai as api, responses, structured
from ..errors import ApiError, PairUnavailable, unavailable
from ..generation import Request
from ..state import ServeState

POST_KINDS = {"/v1/chat/completions": "chat", "/chat/completions": "chat",
              "/v1/completions": "text", "/completions": "text",
              "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens",
              "/v1/responses": "responses", "/responses": "responses"}
_COUNTED = {p for p in POST_KINDS if p.startswith("/v1/")} | {"/v1/models", "/health", "/metrics"}


def endpoint(path: str) -> str:
    """The endpoint a request's answer is counted under in /metrics (a bounded set of labels)."""
    return path if path in _COUNTED else ("/v1/models/{id}" if "/models/" in path else "other")


async def get(conn: Connection, state: ServeState, path: str) -> None:
    """GET /health, /metrics, /v1/models and /v1/models/{id}."""
    model = {"object": "model", "created": state.created, "owned_by": "mlx_ds4tp"}
    if path == "/health":
        error = state.engine.error
        body = {"status": "ok" if error is None else "unavailable", **state.engine.stats, **state.engine.counts()}
        await conn.send_json(200 if error is None else 503, body if error is None else {**body, "error": error})
    elif path == "/metrics":
        await conn.send_metrics(state.metrics.render())
    elif path in ("/v1/models", "/models"):
        await conn.send_json(200, {"object": "list", "data": [{"id": state.model_ids[0], **model}]})
    elif path.startswith(("/v1/models/", "/models/")):
        name = urllib.parse.unquote(path.split("/models/", 1)[1])
        if name not in state.model_ids:
            raise ApiError(404, f"model '{name}' is not served here", "model", "model_not_found")
        await conn.send_json(200, {"id": name, **model})
    else:
        raise ApiError(404, f"no endpoint {path}; see GET /v1/models, POST /v1/chat/completions, "
                       "POST /v1/completions, POST /v1/messages", None, "not_found")


async def post(conn: Connection, state: ServeState, path: str) -> None:
    """POST to the chat, completions, messages (and count_tokens) and responses endpoints."""
    kind = POST_KINDS.get(path)
    if kind is None:
        raise ApiError(404, f"no endpoint POST {path}", None, "not_found")
    parsed, asked = _parse(await conn.read_body(), kind, state)
    if state.engine.error is not None:
        raise unavailable(state.engine.error)
    if kind == "count_tokens":
        await conn.send_json(200, {"input_tokens": len(parsed.prompt)})
        return
    request = Request(prompt=parsed.prompt, max_tokens=parsed.max_tokens, options=parsed.options,
                      stop=parsed.stop, logprobs=parsed.logprobs, num_draft_tokens=parsed.num_draft_tokens)
    try:
        state.engine.submit(request)
    except PairUnavailable as exc:
        raise unavailable(str(exc)) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "max_tokens", "kv_budget_exceeded") from None
    if kind == "messages":
        await anthropic.answer(conn, state, parsed, request)
    elif kind == "responses":
        await responses.answer(conn, state, parsed, request, *asked)
    else:
        await api.answer(conn, state, parsed, request)


def _parse(raw: bytes, kind: str, state: ServeState) -> Tuple[api.ParsedRequest, Optional[tuple]]:
    """(the request as the chat or completions request it means, and for a Responses request
    its body and the conversation's messages)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    asked = None
    if kind in ("messages", "count_tokens"):
        body, kind = anthropic.to_chat_body({**body, "max_tokens": 1} if kind == "count_tokens" else body), "chat"
    elif kind == "responses":
        chat, messages = responses.to_chat_body(body, state.responses)
        body, kind, asked = chat, "chat", (body, messages)
    parsed = api.parse_request(body, kind, state.tokenizer, model_ids=state.model_ids,
                               default_max_tokens=state.http.default_max_tokens,
                               context_length=state.context_length, vocab_size=state.vocab_size,
                               defaults=state.http.sampling)
    structured.check(state.grammars, parsed.options.grammar)
    return parsed, asked
