"""OpenAI's chat completions and completions for `ds4tp serve`: parsing and checking a request
body, the response objects, and the answer written whole or streamed. Field names, defaults and
checks follow `mlx_lm.server`; a bad field is an ApiError naming it (the `param` of OpenAI's
error object)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from ...lockstep.request import GenerationRequest
from ...lockstep.sampling.options import SamplingOptions
from ...lockstep.settings import draft_tokens_problem
from ..engine.generation import Ticket
from ..errors import ApiError
from ..state import ServeState
from .answer import IDLE, KEEP_ALIVE, Answer, Piece, SseEvent, Usage
from .chat import ChatText, chat_prompt, chat_tools
from .structured import check as check_grammar, request_grammar


@dataclasses.dataclass(frozen=True)
class ApiCall:
    """A body as its dialect's parser checked it: the generation it asks for (the one request
    type the engine and the batch take, lockstep/request.py) and what its answer needs (its
    kind, stream, usage chunk, the model named, the tools its calls are parsed against)."""

    kind: str  # "chat" | "text"
    request: GenerationRequest
    stream: bool
    include_usage: bool
    model: str
    tools: Optional[list] = None  # the tools the chat template was given (their calls are parsed)


_NUMBER = (int, float)

# Every field of OpenAI's chat and completions request shapes (and mlx_lm.server's extensions)
# is acted on, or accepted only at the value that asks for nothing (n=1, echo=false, ...), or
# refused with a 400 naming it: a client is never led to believe a field was applied.
_ACTED = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "repetition_penalty", "repetition_context_size", "presence_penalty",
    "presence_context_size", "frequency_penalty", "frequency_context_size", "logit_bias", "seed",
    "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "tools", "tool_choice",
    "num_draft_tokens",  # mlx_lm.server's: drafted tokens a round (0: this request decodes plainly)
    "response_format",  # structured output (serve.structured)
    # Descriptive fields that change no output, accepted as OpenAI accepts them.
    "user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier",
}
# field -> (the values that ask for nothing, what to say when another value is given)
_NEUTRAL = {
    "best_of": ((1,), "one completion per request"),
    "echo": ((False,), "the prompt is not echoed back"),
    "suffix": (("",), "no text after the completion (insertion) is supported"),
    "modalities": ((["text"],), "text output only"),
    "store": ((False,), "nothing is stored for later retrieval"),
    "parallel_tool_calls": ((True,), "every call the model makes is returned (it cannot be held to one)"),
}
_CHAT_ONLY = {"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
              "top_logprobs"}
_REFUSED = {
    "audio": "audio output is not supported",
    "functions": "function calling is not supported by this server yet",
    "function_call": "function calling is not supported by this server yet",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not adjustable here",
    "verbosity": "verbosity is not adjustable here",
    "web_search_options": "web search is not available",
    "moderation": "moderation is not available",
    "prompt_cache_options": "prompt caching is automatic here (the longest stored prefix is reused)",
    "prompt_cache_retention": "prompt caching is automatic here (the longest stored prefix is reused)",
}


def _check_fields(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in _ACTED and not (kind == "text" and name in _CHAT_ONLY):
            continue
        if name in _NEUTRAL and not (kind == "text" and name in _CHAT_ONLY):
            neutral, why = _NEUTRAL[name]
            if value is None or any(value == v and type(value) is type(v) for v in neutral):
                continue
            raise ApiError(400, f"'{name}'={json.dumps(value)[:80]} is not supported: {why}; leave it "
                           "out", name, "unsupported_parameter")
        reason = _REFUSED.get(name, "it is not a field of OpenAI's "
                              f"{'chat completions' if kind == 'chat' else 'completions'} request")
        raise ApiError(400, f"'{name}' is not supported: {reason}; leave it out", name,
                       "unsupported_parameter")


def _logit_bias(body: dict, vocab_size: int) -> tuple:
    value = _field(body, "logit_bias", dict, {})
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(400, f"'logit_bias' key {key!r} must be a token id", "logit_bias",
                           "invalid_value") from None
        if not 0 <= token < vocab_size:
            raise ApiError(400, f"'logit_bias' key {token} is outside the model's vocabulary "
                           f"[0, {vocab_size})", "logit_bias", "invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, _NUMBER):  # its range: SamplingOptions.check
            raise ApiError(400, f"'logit_bias[{key}]' is {bias!r}; it must be a number", "logit_bias",
                           "invalid_type")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def _logprobs(body: dict, kind: str) -> Optional[int]:
    if kind == "chat":
        if not _field(body, "logprobs", bool, False):
            if body.get("top_logprobs") is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs",
                               "invalid_value")
            return None
        return _field(body, "top_logprobs", int, 0, low=0, high=20)
    return _field(body, "logprobs", int, None, low=0, high=20)


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


def parse_request(body: dict, kind: str, tokenizer, *, model_ids: List[str], default_max_tokens: int,
                  context_length: int, vocab_size: int, defaults: SamplingOptions) -> ApiCall:
    """Check every field of a completion request (a JSON object) and tokenize its prompt. model_ids: the
    served id first (a request without "model" names it), then the other names accepted."""
    _check_fields(body, kind)
    model = _field(body, "model", str, model_ids[0])
    if model not in model_ids and model != "default_model":
        raise ApiError(404, f"model '{model}' is not served here; this server serves "
                       f"'{model_ids[0]}' (GET /v1/models)", "model", "model_not_found")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "'n' must be 1: one choice per request", "n", "invalid_value")
    max_tokens = _field(body, "max_completion_tokens", int, None, low=1)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, default_max_tokens, low=1)
    options = _sampling(body, vocab_size, defaults)
    logprobs = _logprobs(body, kind)
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
    where = "messages" if kind == "chat" else "prompt"
    if where not in body:
        raise ApiError(400, f"'{where}' is required", where, "missing_field")
    if kind == "chat":
        tools = chat_tools(body, tokenizer)
        prompt = chat_prompt(tokenizer, body["messages"], tools)
    else:
        tools, prompt = None, text_prompt(tokenizer, body["prompt"], vocab_size)
    options = dataclasses.replace(options, grammar=request_grammar(body, tokenizer, tools))
    if not prompt:
        raise ApiError(400, f"'{where}' encodes to zero tokens", where, "invalid_value")
    if len(prompt) >= context_length:
        raise ApiError(400, f"'{where}' is {len(prompt)} tokens; the model's context is "
                       f"{context_length} tokens and the answer needs at least one",
                       where, "context_length_exceeded")
    max_tokens = min(max_tokens, context_length - len(prompt))
    request = GenerationRequest(tuple(prompt), max_tokens, options, tuple(stop), logprobs, _num_draft_tokens(body))
    return ApiCall(kind, request, stream, include_usage, model, tools)


def _num_draft_tokens(body: dict) -> Optional[int]:
    """mlx_lm.server's num_draft_tokens, in the one range the flags have too (0: no drafts)."""
    k = _field(body, "num_draft_tokens", int, None)
    problem = "" if k is None else draft_tokens_problem(k, least=0)
    if problem:
        raise ApiError(400, f"'num_draft_tokens' is {problem}", "num_draft_tokens", "invalid_value")
    return k


# The sampling fields' names and types as a request gives them; their ranges are
# SamplingOptions.check's, the one place they are written.
_SAMPLING_FIELDS = (("temperature", _NUMBER), ("top_p", _NUMBER), ("top_k", int), ("min_p", _NUMBER),
                    ("repetition_penalty", _NUMBER), ("repetition_context_size", int),
                    ("presence_penalty", _NUMBER), ("presence_context_size", int),
                    ("frequency_penalty", _NUMBER), ("frequency_context_size", int), ("seed", int))


def _sampling(body: dict, vocab_size: int, defaults: SamplingOptions) -> SamplingOptions:
    """The request's sampling fields over the server's defaults (its --temp, --top-p, ...):
    each field's type checked here, its range by SamplingOptions.check (a 400 naming it)."""
    given = {}
    for name, types in _SAMPLING_FIELDS:
        value = _field(body, name, types, None)
        if value is not None:
            given[name] = float(value) if types is _NUMBER else value
    options = dataclasses.replace(defaults, logit_bias=_logit_bias(body, vocab_size), **given)
    try:
        options.check()
    except ValueError as exc:
        name = str(exc).split("=", 1)[0].split("[", 1)[0]
        raise ApiError(400, f"'{name}': {exc}", name, "invalid_value") from None
    return options


# ============================================================================
# Responses
# ============================================================================


class CompletionShape:
    """The id, timestamps and object names shared by one chat completion's or completion's
    response or chunks."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offset = 0  # completions' text_offset of the next token

    def _logprobs(self, items: Optional[list]) -> Optional[Dict[str, Any]]:
        """The choice's logprobs object for these tokens' entries (None: not asked for)."""
        if items is None:
            return None
        if self.kind == "chat":
            return {"content": items, "refusal": None}
        offsets = []
        for item in items:
            offsets.append(self._offset)
            self._offset += len(item["token"])
        return {"tokens": [i["token"] for i in items],
                "token_logprobs": [i["logprob"] for i in items],
                "top_logprobs": [{t["token"]: t["logprob"] for t in i["top_logprobs"]} for i in items],
                "text_offset": offsets}

    def _base(self, chunk: bool) -> Dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, said: Dict[str, Any], finish: Optional[str], items: Optional[list]) -> Dict[str, Any]:
        return {"index": 0, **said, "finish_reason": finish, "logprobs": self._logprobs(items)}

    def whole(self, answer: Answer, counts: Usage) -> Dict[str, Any]:
        """The response of a request that does not stream."""
        said = {"message": _said({"role": "assistant", "content": answer.text}, answer.reasoning, answer.calls)} \
            if self.kind == "chat" else {"text": answer.text}
        return {**self._base(chunk=False), "choices": [self._choice(said, answer.finish, answer.items)],
                "usage": usage(counts)}

    def chunk(self, text: Optional[str], finish: Optional[str], first: bool = False,
              logprobs: Optional[list] = None, reasoning: str = "",
              tool_calls: Optional[list] = None) -> Dict[str, Any]:
        """One streamed event (`first`: the chat chunk that names the role; logprobs: the
        entries of the tokens whose text this is)."""
        said: Dict[str, Any] = {"text": text or ""}
        if self.kind == "chat":
            delta: Dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            said = {"delta": _said(delta, reasoning, tool_calls)}
        return {**self._base(chunk=True), "choices": [self._choice(said, finish, logprobs)]}

    def usage_chunk(self, counts: Usage) -> Dict[str, Any]:
        """The last streamed event under stream_options.include_usage: no choices, the usage."""
        return {**self._base(chunk=True), "choices": [], "usage": usage(counts)}


def _said(fields: Dict[str, Any], reasoning: str, tool_calls: Optional[list]) -> Dict[str, Any]:
    """A chat message or delta with the answer's reasoning and tool calls, where there are any."""
    if reasoning:
        # mlx_lm.server's name, and the one other clients read.
        fields["reasoning"] = fields["reasoning_content"] = reasoning
    if tool_calls:
        fields["tool_calls"] = tool_calls
    return fields


def usage(counts: Usage) -> Dict[str, Any]:
    """OpenAI's usage object, with the reused prompt tokens as cached_tokens."""
    return {"prompt_tokens": counts.prompt_tokens, "completion_tokens": counts.completion_tokens,
            "total_tokens": counts.prompt_tokens + counts.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": counts.cached_tokens}}


class OpenAiAnswer:
    """POST /v1/chat/completions's or /v1/completions's answer to a submitted request."""

    def __init__(self, state: ServeState, call: ApiCall, ticket: Ticket):
        self.call = call
        self.usage = Usage(len(call.request.prompt))
        self.shape = CompletionShape(call.kind, call.model)
        self.chat = ChatText(state.tokenizer, list(call.request.prompt), call.tools, call.stream) \
            if call.kind == "chat" else None

    def whole(self, answer: Answer) -> Dict[str, Any]:
        return self.shape.whole(answer, self.usage)

    def error_event(self, err: ApiError) -> SseEvent:
        return SseEvent(err.body())

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[List[SseEvent]]:
        shape, chat, logprobs_asked = self.shape, self.chat, self.call.request.logprobs is not None
        if chat is not None:
            yield [SseEvent(shape.chunk("", None, first=True))]
        async for piece in pieces:
            if piece is IDLE:
                yield [KEEP_ALIVE]
                continue
            logprobs = piece.items if logprobs_asked and not piece.finish else None
            said = piece.said
            if chat is None:
                yield [SseEvent(shape.chunk(said["content"], None, logprobs=logprobs) if not piece.finish
                                else shape.chunk("", piece.finish))]
                continue
            out = []
            if said["content"] or said["reasoning"] or said["tool_calls"] or logprobs:
                out.append(SseEvent(shape.chunk(said["content"] or None, None, logprobs=logprobs,
                                                reasoning=said["reasoning"], tool_calls=said["tool_calls"])))
            if piece.finish:
                out.append(SseEvent(shape.chunk(None, piece.finish)))
            yield out
        tail = [SseEvent(shape.usage_chunk(self.usage))] if self.call.include_usage else []
        yield tail + [SseEvent("[DONE]")]


def parse(body: dict, state: ServeState, kind: str) -> ApiCall:
    """A chat ("chat") or completions ("text") request checked against this server: every field,
    the model named, the prompt's length, its grammar compiled."""
    call = parse_request(body, kind, state.tokenizer, model_ids=state.model_ids,
                         default_max_tokens=state.http.default_max_tokens,
                         context_length=state.context_length, vocab_size=state.vocab_size,
                         defaults=state.http.sampling)
    check_grammar(state.grammars, call.request.options.grammar)
    return call
