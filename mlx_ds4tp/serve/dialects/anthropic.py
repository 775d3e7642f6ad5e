"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): a request is
translated into the chat-completions request it means and checked by the same parser, so both
APIs render the same prompt and sample alike; the answer (serve/dialects/chat.py) goes back as
Anthropic's content blocks, whole or as its streamed events (docs/serving.md's table says which fields).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from ..engine.generation import Ticket
from ..errors import ApiError
from ..state import ServeState
from . import openai
from .answer import IDLE, Answer, Piece, SseEvent, Usage
from .chat import ChatText, text_content
from .openai import ApiCall
from .structured import as_chat_tool

# Every field of Anthropic's request: acted on (translated), or refused naming it.
_FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
           "top_p", "top_k", "tools", "tool_choice", "metadata"}
_REFUSED = {
    "thinking": "extended thinking is not configurable here (a model's own thinking is returned as is)",
    "service_tier": "there is one tier", "container": "containers are not available",
    "mcp_servers": "MCP servers are not available", "context_management": "not available",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _messages(body: dict) -> List[dict]:
    """Anthropic's system prompt and messages as chat-completions messages."""
    out: List[dict] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": text_content(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages",
                       "invalid_type")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"'{where}.role' must be \"user\" or \"assistant\"", f"{where}.role", "invalid_value")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list):
            out.extend(_blocks(m["role"], content, where))
        else:
            raise ApiError(400, f"'{where}.content' must be a string or a list of content blocks",
                           f"{where}.content", "invalid_type")
    return out


def _blocks(role: str, content: list, where: str) -> List[dict]:
    """One message's content blocks as chat messages: each tool_result its own tool message, then
    the text and tool_use blocks as one message of `role` (none when there are neither)."""
    out: List[dict] = []
    text, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": text_content(block.get("content", ""), f"{where}.content[{j}].content")})
        else:
            raise ApiError(400, f"'{where}.content[{j}]' is a {kind!r} block; this server reads text, "
                           "tool_use (assistant) and tool_result (user) blocks", f"{where}.content",
                           "invalid_type")
    if text or calls:
        message: Dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def to_chat_body(body: dict) -> dict:
    """The chat-completions request a Messages request means; ApiError naming a field it cannot take."""
    for name in body:
        if name not in _FIELDS:
            reason = _REFUSED.get(name, "it is not a field of Anthropic's Messages request")
            raise ApiError(400, f"'{name}' is not supported: {reason}; leave it out", name,
                           "unsupported_parameter")
    if "max_tokens" not in body:
        raise ApiError(400, "'max_tokens' is required", "max_tokens", "missing_field")
    chat: Dict[str, Any] = {"messages": _messages(body), "max_tokens": body["max_tokens"]}
    for ours, theirs in (("model", "model"), ("stop", "stop_sequences"), ("stream", "stream"),
                         ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("metadata", "metadata")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  for t in tools):
            raise ApiError(400, "'tools' must be a list of {name, description, input_schema}", "tools",
                           "invalid_type")
        chat["tools"] = [as_chat_tool(t, "input_schema") for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        # "any" and "tool" force a call: a grammar (serve.structured), as the chat shapes do.
        forced = {"auto": "auto", "none": "none", "any": "required"}.get(kind)
        if kind == "tool" and isinstance(choice.get("name"), str):
            forced = {"type": "function", "function": {"name": choice["name"]}}
        if forced is None:
            raise ApiError(400, f"'tool_choice' {json.dumps(choice)[:80]} is not supported: use {{\"type\": "
                           "\"auto\" | \"none\" | \"any\"} or {\"type\": \"tool\", \"name\": ...}",
                           "tool_choice", "unsupported_parameter")
        chat["tool_choice"] = forced
    return chat


def error_body(err: ApiError) -> Dict[str, Any]:
    """Anthropic's error object for an ApiError."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "request_too_large", 503: "overloaded_error"}.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.body()["error"]["message"]}}


def _tool_use(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call["function"]["name"],
            "input": json.loads(arguments) if arguments else {}}


class MessageShape:
    """One Messages answer, whole or as its events."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = "msg_" + uuid.uuid4().hex, model, prompt_tokens

    def _base(self) -> Dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def whole(self, answer: Answer, counts: Usage) -> Dict[str, Any]:
        content: List[dict] = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.text or not (answer.reasoning or answer.calls):
            content.append({"type": "text", "text": answer.text})
        content.extend(_tool_use(c) for c in answer.calls)
        return {**self._base(), "content": content, "stop_reason": _STOP_REASONS.get(answer.finish, "end_turn"),
                "stop_sequence": None, "usage": self.usage(counts.completion_tokens, counts.cached_tokens)}

    def usage(self, output_tokens: int, cached: int) -> Dict[str, Any]:
        return {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessageStream:
    """Anthropic's streamed events for one answer: content blocks opened as their kind of text
    arrives (thinking, text, each tool call), closed when another kind follows."""

    def __init__(self, shape: MessageShape, send: Callable[[str, Dict[str, Any]], None]):
        self.shape, self._send = shape, send
        self.index = -1
        self.open: Optional[str] = None

    def send(self, kind: str, **fields: Any) -> None:
        self._send(kind, {"type": kind, **fields})

    def start(self, cached: int) -> None:
        self.send("message_start", message={**self.shape._base(), "content": [], "stop_reason": None,
                                            "stop_sequence": None, "usage": self.shape.usage(0, cached)})

    def _block(self, kind: str, block: dict) -> None:
        if self.open is not None:
            self.send("content_block_stop", index=self.index)
        self.index += 1
        self.open = kind
        self.send("content_block_start", index=self.index, content_block=block)

    def _delta(self, delta: dict) -> None:
        self.send("content_block_delta", index=self.index, delta=delta)

    def pieces(self, pieces: Dict[str, Any]) -> None:
        if pieces["reasoning"]:
            if self.open != "thinking":
                self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": pieces["reasoning"]})
        if pieces["content"]:
            if self.open != "text":
                self._block("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": pieces["content"]})
        for call in pieces["tool_calls"]:
            use = _tool_use(call)
            self._block("tool_use", {**use, "input": {}})
            self._delta({"type": "input_json_delta", "partial_json": json.dumps(use["input"])})

    def finish(self, finish: str, output_tokens: int) -> None:
        if self.open is None:  # an empty answer is still one (empty) text block
            self._block("text", {"type": "text", "text": ""})
        self.send("content_block_stop", index=self.index)
        self.send("message_delta", delta={"stop_reason": _STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None},
                  usage={"output_tokens": output_tokens})
        self.send("message_stop")


def parse(body: dict, state: ServeState) -> ApiCall:
    """POST /v1/messages's request, checked as the chat request it means."""
    return openai.parse(to_chat_body(body), state, "chat")


def count_tokens(body: dict, state: ServeState) -> Dict[str, Any]:
    """POST /v1/messages/count_tokens's answer: the prompt's tokens, nothing generated."""
    return {"input_tokens": len(openai.parse(to_chat_body({**body, "max_tokens": 1}), state, "chat").request.prompt)}


class MessagesAnswer:
    """POST /v1/messages's answer to a submitted request."""

    def __init__(self, state: ServeState, call: ApiCall, ticket: Ticket):
        prompt = list(call.request.prompt)
        self.usage = Usage(len(prompt))
        self.shape = MessageShape(call.model, len(prompt))
        self.chat = ChatText(state.tokenizer, prompt, call.tools, call.stream)

    def whole(self, answer: Answer) -> Dict[str, Any]:
        return self.shape.whole(answer, self.usage)

    def error_event(self, err: ApiError) -> SseEvent:
        return SseEvent(error_body(err), "error")

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[List[SseEvent]]:
        out: List[SseEvent] = []
        message = MessageStream(self.shape, lambda name, obj: out.append(SseEvent(obj, name)))
        message.start(self.usage.cached_tokens)
        async for piece in pieces:
            if piece is IDLE:
                out.append(SseEvent({"type": "ping"}, "ping"))
            else:
                message.pieces(piece.said)
                if piece.finish:
                    message.finish(piece.finish, self.usage.completion_tokens)
            yield list(out)
            out.clear()
