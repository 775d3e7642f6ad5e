"""The requests of `ds4tp bench --serve --soak` (mlx_ds4tp.bench.soak): one streamed completion
or one deliberately bad request against a server on this machine, and the kind its outcome
falls in. Only the standard library: a client thread must never wait on anything but its socket.

Outcome kinds: "ok" (answered in full, checked against the reference), "cancelled" (closed by
us mid-stream), "bad_request_4xx" (a bad request refused, as it must be), and the error kinds:
  pair_down        503 / an SSE error with code pair_unavailable (the worker is gone)
  busy             429: every queue place taken (the server's designed answer to overload)
  hung             no end within the request timeout
  http_4xx         a valid request refused
  http_5xx         any other 5xx, or an SSE error of another kind mid-stream
  bad_request_5xx  a bad request answered 5xx
  bad_request_accepted  a bad request answered 2xx
  stream_cut       the stream ended without [DONE]
  connection       refused, reset, unreadable
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import socket
import time
from typing import Any, Dict, List, Optional

# The kinds a run may see without anything being wrong (pair_down only inside the outage of
# --restart-worker, which soak.py judges).
EXPECTED_KINDS = ("ok", "cancelled", "bad_request_4xx", "busy", "pair_down")
BAD_KINDS = ("unknown_field", "negative_max_tokens", "token_past_vocab", "prompt_past_context",
             "invalid_json")


@dataclasses.dataclass
class Outcome:
    kind: str
    start: float  # time.perf_counter() clock
    end: float
    first: Optional[float] = None  # the first text chunk's arrival
    tokens: int = 0  # completion tokens, from the usage chunk (answers in full only)
    text: str = ""
    variant: Optional[int] = None  # index into the run's variants
    detail: str = ""
    warmup: bool = False


@dataclasses.dataclass
class Target:
    host: str
    port: int
    api_key: Optional[str]
    timeout: float  # a request's whole time: past it, it is "hung"


def json_headers(api_key: Optional[str]) -> Dict[str, str]:
    """A JSON request's headers, with the API key when there is one."""
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _error_code(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["error"].get("code") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""


def _refused(status: int, payload: bytes) -> str:
    code = _error_code(payload)
    if status == 503 and code == "pair_unavailable":
        return "pair_down"
    if status == 429:
        return "busy"
    return "http_4xx" if 400 <= status < 500 else "http_5xx"


def stream(target: Target, prompt: List[int], max_tokens: int,
           cancel_after: Optional[int] = None) -> Outcome:
    """One greedy streamed completion of token ids; with cancel_after, the connection is closed
    after that many text chunks (an answer that ends first is an answer in full)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    deadline = start + target.timeout
    out = Outcome("connection", start, start)
    # The socket timeout bounds each read; the deadline bounds the whole answer, which SSE
    # keep-alive comments would otherwise stretch forever.
    conn = http.client.HTTPConnection(target.host, target.port, timeout=target.timeout)
    resp = None
    try:
        conn.request("POST", "/v1/completions", body=body, headers=json_headers(target.api_key))
        resp = conn.getresponse()
        if resp.status != 200:
            payload = resp.read()
            out.kind, out.detail = _refused(resp.status, payload), f"{resp.status} {payload[:200]!r}"
            return out
        return _read_stream(resp, out, deadline, target.timeout, cancel_after)
    except socket.timeout:
        out.kind, out.detail = "hung", f"no byte for {target.timeout:g} s"
        return out
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.kind, out.detail = "connection", f"{type(exc).__name__}: {exc}"
        return out
    finally:
        out.end = time.perf_counter()
        # Both: the response owns the socket once the server said Connection: close.
        if resp is not None:
            resp.close()
        conn.close()


def _read_stream(resp, out: Outcome, deadline: float, timeout: float, cancel_after: Optional[int]) -> Outcome:
    """The server-sent events of a 200 answer into `out`: its text, first chunk and token count,
    or why it ended early (hung past the deadline, an SSE error, cut, cancelled by us)."""
    text, chunks, done = [], 0, False
    while True:
        if time.perf_counter() > deadline:
            out.kind, out.detail = "hung", f"no end after {timeout:g} s ({chunks} chunks)"
            return out
        line = resp.readline()
        if not line or line.startswith(b"data: [DONE]"):
            done = bool(line)
            break
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            code = event["error"].get("code")
            out.kind = "pair_down" if code == "pair_unavailable" else "http_5xx"
            out.detail = f"SSE error: {event['error'].get('message')}"
            return out
        if event.get("usage"):
            out.tokens = event["usage"]["completion_tokens"]
        elif event.get("choices") and event["choices"][0].get("text"):
            out.first = out.first if out.first is not None else time.perf_counter()
            text.append(event["choices"][0]["text"])
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                out.kind = "cancelled"
                return out
    out.text = "".join(text)
    out.kind = "ok" if done else "stream_cut"
    return out


def bad_body(kind: str, rng: random.Random, vocab: int, context: int) -> bytes:
    """A request body the server must refuse with a 4xx."""
    ids = [rng.randrange(vocab) for _ in range(4)]
    body: Dict[str, Any] = {"prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True}
    if kind == "unknown_field":
        body["soak_no_such_field"] = 1
    elif kind == "negative_max_tokens":
        body["max_tokens"] = -rng.randint(1, 100)
    elif kind == "token_past_vocab":
        body["prompt"] = ids + [vocab + rng.randrange(1000)]
    elif kind == "prompt_past_context":
        body["prompt"] = [rng.randrange(vocab)] * (context + 1)
    elif kind == "invalid_json":
        return b'{"prompt": [1, 2'
    return json.dumps(body).encode()


def bad_request(target: Target, body: bytes, kind: str) -> Outcome:
    """Post a bad body: a 4xx is the answer it must get."""
    start = time.perf_counter()
    out = Outcome("connection", start, start, detail=kind)
    conn = http.client.HTTPConnection(target.host, target.port, timeout=target.timeout)
    try:
        conn.request("POST", "/v1/completions", body=body, headers=json_headers(target.api_key))
        resp = conn.getresponse()
        payload = resp.read()
        if 400 <= resp.status < 500:
            out.kind = "bad_request_4xx"
        elif resp.status >= 500:
            out.kind = "bad_request_5xx"
        else:
            out.kind = "bad_request_accepted"
        out.detail = f"{kind}: {resp.status} {payload[:200]!r}"
    except socket.timeout:
        out.kind, out.detail = "hung", f"{kind}: no answer within {target.timeout:g} s"
    except (OSError, http.client.HTTPException) as exc:
        out.kind, out.detail = "connection", f"{kind}: {type(exc).__name__}: {exc}"
    finally:
        out.end = time.perf_counter()
        conn.close()
    return out
