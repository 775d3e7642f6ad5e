"""The OpenAI request shapes for `ds4tp serve`: parsing and checking a request body, and the
response objects. Field names, defaults and checks follow `mlx_lm.server`; a bad field is an
ApiError naming it (the `param` of OpenAI's error object)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Dict, List, Optional

from .errors import ApiError
from ..lockstep.sampling import SamplingOptions


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "chat" | "text"
    prompt: List[int]
    max_tokens: int
    options: SamplingOptions
    stop: List[str]
    stream: bool
    include_usage: bool
    model: str


_NUMBER = (int, float)


def _field(body: dict, name: str, types, default=None, *, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    # bool is an int in Python, but JSON true is never a number.
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        names = "/".join({"str": "string", "float": "number", "dict": "object"}.get(t.__name__, t.__name__)
                         for t in allowed)
        raise ApiError(400, f"'{name}' must be of type {names}, got {value!r}", name, "invalid_type")
    if low is not None and (value <= low if low_open else value < low):
        raise ApiError(400, f"'{name}' is {value}; it must be {'>' if low_open else '>='} {low}",
                       name, "invalid_value")
    if high is not None and value > high:
        raise ApiError(400, f"'{name}' is {value}; it must be <= {high}", name, "invalid_value")
    return value


def _message_text(content: Any, where: str) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}[{i}]' must be a text part "
                               "({\"type\": \"text\", \"text\": ...}); this model reads text only",
                               where, "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"'{where}' must be a string or a list of text parts", where, "invalid_type")


def chat_prompt(tokenizer, messages: Any) -> List[int]:
    """The model's chat template over `messages`, with the assistant's turn opened."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects",
                       "messages", "invalid_type")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"'messages[{i}]' must be an object with a string 'role'",
                           f"messages[{i}].role", "invalid_type")
        plain.append({"role": m["role"],
                      "content": _message_text(m.get("content", ""), f"messages[{i}].content")})
    if getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template rejects messages with its own errors
            raise ApiError(400, f"the model's chat template rejected the messages: {exc}",
                           "messages", "invalid_value") from None
        # Some tokenizer versions answer a BatchEncoding instead of the ids.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    # No template: mlx-lm's plain role-prefixed rendering.
    from mlx_lm.server import convert_chat

    return list(tokenizer.encode(convert_chat(plain)))


def text_prompt(tokenizer, prompt: Any, vocab_size: int) -> List[int]:
    """The tokens of a completion prompt: a string, a one-string list or token ids (each
    checked against the model's vocabulary: an id past it would stop the pair)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"'prompt' holds token id {bad[0]}, outside the model's vocabulary "
                           f"[0, {vocab_size})", "prompt", "invalid_value")
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt", "invalid_type")


def parse_request(body: Any, kind: str, tokenizer, *, model_ids: List[str], default_max_tokens: int,
                  context_length: int, vocab_size: int, defaults: SamplingOptions) -> ParsedRequest:
    """Check every field of a completion request and tokenize its prompt. model_ids: the
    served id first (a request without "model" names it), then the other names accepted."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    model = _field(body, "model", str, model_ids[0])
    if model not in model_ids and model != "default_model":
        raise ApiError(404, f"model '{model}' is not served here; this server serves "
                       f"'{model_ids[0]}' (GET /v1/models)", "model", "model_not_found")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "'n' must be 1: one choice per request", "n", "invalid_value")
    max_tokens = _field(body, "max_completion_tokens", int, None, low=1)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, default_max_tokens, low=1)
    options = SamplingOptions(
        temperature=float(_field(body, "temperature", _NUMBER, defaults.temperature, low=0)),
        top_p=float(_field(body, "top_p", _NUMBER, defaults.top_p, low=0, high=1, low_open=True)),
        top_k=_field(body, "top_k", int, defaults.top_k, low=0),
        min_p=float(_field(body, "min_p", _NUMBER, defaults.min_p, low=0, high=1)),
        repetition_penalty=float(_field(body, "repetition_penalty", _NUMBER,
                                        defaults.repetition_penalty, low=0)),
        repetition_context_size=_field(body, "repetition_context_size", int, 20, low=1),
        seed=_field(body, "seed", int, defaults.seed, low=0, high=(1 << 63) - 1),
    )
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop", "invalid_type")
    stream = _field(body, "stream", bool, False)
    stream_options = _field(body, "stream_options", dict, {})
    include_usage = _field(stream_options, "include_usage", bool, False)
    if kind == "chat":
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", "messages", "missing_field")
        prompt = chat_prompt(tokenizer, body["messages"])
        where = "messages"
    else:
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", "prompt", "missing_field")
        prompt = text_prompt(tokenizer, body["prompt"], vocab_size)
        where = "prompt"
    if not prompt:
        raise ApiError(400, f"'{where}' encodes to zero tokens", where, "invalid_value")
    if len(prompt) >= context_length:
        raise ApiError(400, f"'{where}' is {len(prompt)} tokens; the model's context is "
                       f"{context_length} tokens and the answer needs at least one",
                       where, "context_length_exceeded")
    max_tokens = min(max_tokens, context_length - len(prompt))
    return ParsedRequest(kind, prompt, max_tokens, options, stop, stream, include_usage, model)


# ============================================================================
# Responses
# ============================================================================


class ResponseShape:
    """The id, timestamps and object names shared by one request's response or chunks."""

    def __init__(self, kind: str, model: str):
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, obj: str) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: Dict[str, Any]) -> Dict[str, Any]:
        """The response of a request that does not stream."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}
            out = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            out = self._base("text_completion")
        out["choices"] = [choice]
        out["usage"] = usage
        return out

    def chunk(self, text: Optional[str], finish: Optional[str], first: bool = False) -> Dict[str, Any]:
        """One streamed event (`first`: the chat chunk that names the role)."""
        if self.kind == "chat":
            delta: Dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            out = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            out = self._base("text_completion")
        out["choices"] = [choice]
        return out

    def usage_chunk(self, usage: Dict[str, Any]) -> Dict[str, Any]:
        """The last streamed event under stream_options.include_usage: no choices, the usage."""
        out = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out["choices"] = []
        out["usage"] = usage
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    """OpenAI's usage object, with the reused prompt tokens as cached_tokens."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
