"""The answers of the Messages (Anthropic) and Responses (OpenAI) endpoints, written by the HTTP
handler (serve/http.py) with its own plumbing: a mixin, so the handler stays one connection's
plumbing and the OpenAI chat and completions answers."""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING

from . import anthropic, responses
from .errors import ApiError, ClientGone

if TYPE_CHECKING:
    from .api import ParsedRequest
    from .engine import Request


class OtherApis:
    """Handler methods for POST /v1/messages and POST /v1/responses (see serve/http.py)."""

    def _whole_message(self, parsed: "ParsedRequest", request: "Request", shape: "anthropic.MessageShape") -> None:
        answer = self._collect(parsed, request)
        if answer is not None:
            self._send_json(200, shape.whole(answer["text"], answer["reasoning"], answer["calls"],
                                             answer["finish"], request.completion_tokens,
                                             request.cached_tokens))

    def _whole_response(self, parsed: "ParsedRequest", request: "Request", shape: "responses.ResponseShape",
                        messages: list) -> None:
        answer = self._collect(parsed, request)
        if answer is not None:
            self.state.responses.put(shape.id, responses.conversation(messages, answer["text"], answer["calls"]))
            self._send_json(200, shape.whole(answer["text"], answer["reasoning"], answer["calls"],
                                             answer["finish"], request.completion_tokens, request.cached_tokens))

    def _stream_response(self, parsed: "ParsedRequest", request: "Request", shape: "responses.ResponseShape",
                         messages: list) -> None:
        events = self._events(request)
        first = self._open_stream(events)
        if first is None:
            return
        stream = responses.ResponseStream(shape, self._sse_event)
        chat = self._chat_text(parsed, request, streaming=False)
        text, calls = [], []
        try:
            stream.start()
            for event in itertools.chain([first], events):
                if event[0] == "idle":
                    self.wfile.write(b": keep-alive\n\n")
                    self.wfile.flush()
                    continue
                pieces = chat.add(event[1]) if event[0] == "text" else chat.finish(event[1])
                text.append(pieces["content"])
                calls.extend(pieces["tool_calls"])
                stream.pieces(pieces)
                if event[0] == "done":
                    self.state.responses.put(shape.id, responses.conversation(messages, "".join(text), calls))
                    stream.finish(event[1], request.completion_tokens, request.cached_tokens)
        except ApiError as err:
            self._try_write(b"event: error\ndata: " + json.dumps({"type": "error", **err.body()}).encode() + b"\n\n")
        except (OSError, ClientGone):
            request.cancelled = True

    def _stream_message(self, parsed: "ParsedRequest", request: "Request", shape: "anthropic.MessageShape") -> None:
        events = self._events(request)
        first = self._open_stream(events)
        if first is None:
            return

        send = self._sse_event
        stream = anthropic.MessageStream(shape, send)
        chat = self._chat_text(parsed, request, streaming=True)
        try:
            stream.start(request.cached_tokens)
            for event in itertools.chain([first], events):
                if event[0] == "idle":
                    send("ping", {"type": "ping"})
                elif event[0] == "text":
                    stream.pieces(chat.add(event[1]))
                else:
                    stream.pieces(chat.finish(event[1]))
                    finish = "tool_calls" if chat.made_tool_call and event[1] == "stop" else event[1]
                    stream.finish(finish, request.completion_tokens)
        except ApiError as err:
            self._try_write(b"event: error\ndata: " + json.dumps(anthropic.error_body(err)).encode() + b"\n\n")
        except (OSError, ClientGone):
            request.cancelled = True
