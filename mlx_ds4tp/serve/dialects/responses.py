"""OpenAI's Responses API (`POST /v1/responses`): a request is translated into the
chat-completions request it means, its `input` after the messages of `previous_response_id`'s
conversation, which this server keeps for its last responses (the prompt cache then reuses that
conversation's prefix); the answer (serve/dialects/chat.py) goes back as Responses output items, whole or
as the API's streamed events.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from ..engine.generation import Ticket
from ..errors import ApiError
from ..state import ResponseStore, ServeState
from . import openai
from .answer import IDLE, KEEP_ALIVE, Answer, Piece, SseEvent, Usage
from .chat import ChatText, text_content
from .openai import ApiCall
from .structured import as_chat_tool

# Every field of the Responses request: acted on, accepted at its neutral value, or refused.
_ACTED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
          "tools", "tool_choice", "previous_response_id", "metadata", "user", "safety_identifier",
          "prompt_cache_key", "parallel_tool_calls", "store", "service_tier", "text"}
_NEUTRAL = {"truncation": ("disabled",), "include": ([],),
            "background": (False,)}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _input_messages(value: Any) -> List[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", "input", "invalid_type")
    out: List[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            content = text_content(item.get("content", ""), f"{where}.content", _TEXT_PARTS)
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # a previous turn's thinking: templates drop it from the prompt
        else:
            raise ApiError(400, f"'{where}' is a {kind!r} item; this server reads message, function_call, "
                           "function_call_output and reasoning items", where, "invalid_type")
    return out


def to_chat_body(body: dict, store: ResponseStore) -> tuple:
    """(the chat-completions request a Responses request means, its messages)."""
    for name, value in body.items():
        if name in _ACTED or (name in _NEUTRAL and (value is None or value in _NEUTRAL[name])):
            continue
        raise ApiError(400, f"'{name}' is not supported by this server's Responses API; leave it out",
                       name, "unsupported_parameter")
    if "input" not in body:
        raise ApiError(400, "'input' is required", "input", "missing_field")
    messages = store.get(body["previous_response_id"]) if body.get("previous_response_id") else []
    if body.get("instructions"):
        # Instructions belong to this request only: they replace a previous system turn.
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": str(body["instructions"])})
    messages += _input_messages(body["input"])
    chat: Dict[str, Any] = {"messages": messages}
    for ours, theirs in (("model", "model"), ("max_tokens", "max_output_tokens"), ("stream", "stream"),
                         ("temperature", "temperature"), ("top_p", "top_p"), ("metadata", "metadata"),
                         ("user", "user")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    tools = body.get("tools")
    if tools:
        if not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
                   for t in tools):
            raise ApiError(400, "'tools' must be function tools ({\"type\": \"function\", \"name\": ...}); "
                           "built-in tools are not available here", "tools", "unsupported_parameter")
        # A tool is strict only when it says so (the Responses API's default is strict; here an
        # unmarked tool keeps the model's free text, as before structured output).
        chat["tools"] = [as_chat_tool(t, "parameters") for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}  # the chat shape
    if choice is not None:
        chat["tool_choice"] = choice
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat, messages


def _response_format(text: Any) -> Optional[dict]:
    """`text.format` as chat completions' response_format (serve.structured)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or \
            text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, "'text' must be {\"format\": {...}} (verbosity is not adjustable here)", "text",
                       "unsupported_parameter")
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict):
        raise ApiError(400, "'text.format' must be an object with a 'type'", "text.format", "invalid_type")
    if form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
    return form


class ResponseShape:
    """One Responses answer: its object, whole or built up by the streamed events."""

    def __init__(self, body: dict, model: str, prompt_tokens: int):
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.body, self.model, self.prompt_tokens = body, model, prompt_tokens
        self.output: List[dict] = []

    def obj(self, status: str, finish: Optional[str] = None, output_tokens: int = 0,
            cached: int = 0) -> Dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": self.body.get("instructions"), "metadata": self.body.get("metadata") or {},
            "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
            "tool_choice": self.body.get("tool_choice", "auto"), "tools": self.body.get("tools", []),
            "temperature": self.body.get("temperature"), "top_p": self.body.get("top_p"),
            "max_output_tokens": self.body.get("max_output_tokens"),
            "previous_response_id": self.body.get("previous_response_id"),
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens,
                      "total_tokens": self.prompt_tokens + output_tokens,
                      "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }

    @staticmethod
    def reasoning_item(text: str) -> dict:
        return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    @staticmethod
    def message_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def call_item(call: dict) -> dict:
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                "status": "completed"}

    def whole(self, answer: Answer, counts: Usage) -> Dict[str, Any]:
        if answer.reasoning:
            self.output.append(self.reasoning_item(answer.reasoning))
        if answer.text or not answer.calls:
            self.output.append(self.message_item(answer.text))
        self.output.extend(self.call_item(c) for c in answer.calls)
        return self.obj("incomplete" if answer.finish == "length" else "completed", answer.finish,
                        counts.completion_tokens, counts.cached_tokens)


def conversation(messages: List[dict], text: str, calls: list) -> List[dict]:
    """The conversation a response leaves, for a request naming it as previous_response_id."""
    reply: Dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        reply["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                               for c in calls]
    return messages + [reply]


class ResponseStream:
    """The Responses API's streamed events for one answer."""

    def __init__(self, shape: ResponseShape, send: Callable[[str, Dict[str, Any]], None]):
        self.shape, self._send = shape, send
        self.sequence = 0
        self.open: Optional[dict] = None  # the reasoning or message item being streamed

    def send(self, kind: str, **fields: Any) -> None:
        self._send(kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def start(self) -> None:
        self.send("response.created", response=self.shape.obj("in_progress"))
        self.send("response.in_progress", response=self.shape.obj("in_progress"))

    def _add(self, item: dict, shown: Optional[dict] = None) -> int:
        """A new output item, announced (as `shown` where it is not complete yet); its index."""
        self.shape.output.append(item)
        self.send("response.output_item.added", output_index=len(self.shape.output) - 1, item=shown or item)
        return len(self.shape.output) - 1

    def _close(self) -> None:
        item, index, self.open = self.open, len(self.shape.output) - 1, None
        if item is None:
            return
        if item["type"] == "message":
            part = item["content"][0]
            self.send("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=part["text"])
            self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part)
            item["status"] = "completed"
        self.send("response.output_item.done", output_index=index, item=item)

    def _text(self, kind: str, text: str) -> None:
        """`text` into the open item of `kind` ("reasoning" or "message"), which the other kind closes."""
        if self.open is None or self.open["type"] != kind:
            self._close()
            if kind == "reasoning":
                self.open = self.shape.reasoning_item("")
                self._add(self.open)
            else:
                self.open = self.shape.message_item("", status="in_progress")
                self.send("response.content_part.added", item_id=self.open["id"], output_index=self._add(self.open),
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        self.open["content"][0]["text"] += text
        self.send("response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta",
                  item_id=self.open["id"], output_index=len(self.shape.output) - 1, content_index=0, delta=text)

    def pieces(self, pieces: Dict[str, Any]) -> None:
        if pieces["reasoning"]:
            self._text("reasoning", pieces["reasoning"])
        if pieces["content"]:
            self._text("message", pieces["content"])
        for call in pieces["tool_calls"]:
            self._close()
            item = self.shape.call_item(call)
            index = self._add(item, {**item, "arguments": "", "status": "in_progress"})
            self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                      delta=item["arguments"])
            self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      arguments=item["arguments"])
            self.send("response.output_item.done", output_index=index, item=item)

    def finish(self, finish: str, output_tokens: int, cached: int) -> None:
        self._close()
        status = "incomplete" if finish == "length" else "completed"
        self.send("response.incomplete" if status == "incomplete" else "response.completed",
                  response=self.shape.obj(status, finish, output_tokens, cached))


@dataclasses.dataclass(frozen=True)
class ResponsesCall(ApiCall):
    """A Responses request as parsed: the chat request it means, its own body (the answer echoes
    its fields) and the conversation it continues (kept with the answer for the next turn)."""

    body: Dict[str, Any] = dataclasses.field(default_factory=dict)
    messages: Tuple[dict, ...] = ()


def parse(body: dict, state: ServeState) -> ResponsesCall:
    """POST /v1/responses's request, checked as the chat request it means."""
    chat, messages = to_chat_body(body, state.responses)
    call = openai.parse(chat, state, "chat")
    fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(ApiCall)}
    return ResponsesCall(**fields, body=body, messages=tuple(messages))


class ResponsesAnswer:
    """POST /v1/responses's answer to a submitted request; the conversation it leaves is kept
    for previous_response_id once the answer is whole."""

    def __init__(self, state: ServeState, call: ResponsesCall, ticket: Ticket):
        prompt = list(call.request.prompt)
        self.store, self.messages = state.responses, list(call.messages)
        self.usage = Usage(len(prompt))
        self.shape = ResponseShape(call.body, call.model, len(prompt))
        self.chat = ChatText(state.tokenizer, prompt, call.tools, streaming=False)

    def whole(self, answer: Answer) -> Dict[str, Any]:
        self.store.put(self.shape.id, conversation(self.messages, answer.text, answer.calls))
        return self.shape.whole(answer, self.usage)

    def error_event(self, err: ApiError) -> SseEvent:
        return SseEvent({"type": "error", **err.body()}, "error")

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[List[SseEvent]]:
        out: List[SseEvent] = []
        response = ResponseStream(self.shape, lambda name, obj: out.append(SseEvent(obj, name)))
        text, calls = [], []
        response.start()
        async for piece in pieces:
            if piece is IDLE:
                out.append(KEEP_ALIVE)
            else:
                text.append(piece.said["content"])
                calls.extend(piece.said["tool_calls"])
                response.pieces(piece.said)
                if piece.finish:
                    self.store.put(self.shape.id, conversation(self.messages, "".join(text), calls))
                    response.finish(piece.finish, self.usage.completion_tokens, self.usage.cached_tokens)
            yield list(out)
            out.clear()
