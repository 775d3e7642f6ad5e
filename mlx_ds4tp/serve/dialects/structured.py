"""Structured output (docs/serving.md's "Structured output"): what a request's `response_format`, strict
tools and forced `tool_choice` ask of the model's output, as the grammar its sampler is masked
with (lockstep.sampling.grammar). A schema is enforced whether or not `strict` is set (as vLLM does): a
best effort that is always met is still met. Constrained calls are written in the model's own
tool-call format, its markers as its tokenizer holds them (one added or special token, or text):
every one of mlx-lm's tool parsers has its grammar (serve.dialects.tool_calls); a parameter schema a
format cannot write so that its parser reads it back (a function_gemma array, a minimax_m2
parameter of several types), or a parser mlx-lm adds later, is a 400 naming why.
"""

from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple

from ...lockstep.errors import GrammarError
from ...lockstep.protocol.commands.limits import MAX_SAMPLER_OPTIONS_BYTES
from ...lockstep.sampling.grammar import Grammars, json_object_grammar, json_schema_grammar
from ..errors import ApiError
from .tool_calls.call_grammar import CallFormat, call_format, tool_call_grammar

# The grammar travels in the SAMPLER command's options (at most MAX_SAMPLER_OPTIONS_BYTES of
# JSON, the other options included).
MAX_GRAMMAR_BYTES = MAX_SAMPLER_OPTIONS_BYTES - 4096


def _schema_of(response_format: Any) -> Optional[dict]:
    """The JSON Schema `response_format` asks for ({} for JSON mode), None for plain text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ApiError(400, "'response_format' must be an object with a 'type' (\"text\", \"json_object\" or "
                       "\"json_schema\")", "response_format", "invalid_type")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON Schema object "
                           "({\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}})",
                           "response_format", "invalid_value")
        return schema
    raise ApiError(400, f"'response_format.type' is {kind!r}; use \"text\", \"json_object\" or \"json_schema\"",
                   "response_format", "invalid_value")


def as_chat_tool(tool: dict, schema_key: str) -> dict:
    """A Responses or Messages tool (its parameters under `schema_key`) as the chat tool it means:
    strict only when it says so (its calls are constrained), else rendered as before."""
    strict = {"strict": True} if tool.get("strict") is True else {}
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                             **strict, "parameters": tool.get(schema_key, {"type": "object"})}}


def _forced(choice: Any, tools: List[dict]) -> Tuple[bool, List[dict]]:
    """(whether `tool_choice` forces a call, the tools it may call)."""
    if choice in (None, "auto"):
        return False, tools
    if choice == "required":
        return True, tools
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, f"'tool_choice'={json.dumps(choice)[:80]}: use \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice", "invalid_value")
    named = [t for t in tools if t["function"].get("name") == name]
    if not named:
        raise ApiError(400, f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice",
                       "invalid_value")
    return True, named


def _call_format(tokenizer) -> CallFormat:
    """The model's tool-call format with its markers as its tokenizer holds them; ApiError (400)
    naming why when its calls cannot be constrained."""
    parser = getattr(tokenizer, "tool_parser", None)
    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    name = str(getattr(parser, "__module__", "")).rsplit(".", 1)[-1]
    why = "this model's tokenizer has no tool-call format mlx-lm knows" if parser is None else None
    if why is None:
        try:
            return call_format(tokenizer, name, start or "", end or "")
        except GrammarError as exc:
            why = str(exc)
    raise ApiError(400, f"a constrained tool call ('strict' tools, or 'tool_choice' \"required\" or named) cannot "
                   f"be made: {why}; send 'tool_choice' \"auto\" with tools that are not strict instead", "tools",
                   "unsupported_parameter")


def request_grammar(body: dict, tokenizer, tools: Optional[List[dict]]) -> str:
    """The grammar a chat or completions request's output must follow ("" for none): its
    response_format, and (chat) its strict tools and tool_choice; ApiError naming the field."""
    schema = _schema_of(body.get("response_format"))
    grammar = ""
    if tools:
        required, callable_tools = _forced(body.get("tool_choice"), tools)
        if required or any(t["function"].get("strict") for t in callable_tools):
            fmt = _call_format(tokenizer)
            calls = [(t["function"]["name"], (t["function"].get("parameters") or {"type": "object"})
                      if t["function"].get("strict") else {"type": "object"}) for t in callable_tools]
            grammar = _compiled_text(lambda: tool_call_grammar(calls, fmt, required, schema), "tools")
    if not grammar and schema is not None:
        grammar = _compiled_text(lambda: json_schema_grammar(schema) if schema else json_object_grammar(),
                                 "response_format")
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise ApiError(400, f"the request's schema makes a grammar of {len(grammar.encode())} bytes; at most "
                       f"{MAX_GRAMMAR_BYTES} fit: send a smaller schema", "response_format", "invalid_value")
    return grammar


def _compiled_text(make, param: str) -> str:
    try:
        return make()
    except (GrammarError, ValueError, TypeError) as exc:
        raise ApiError(400, f"'{param}' cannot be turned into a grammar: {exc}", param, "invalid_value") from None


def check(grammars: Optional[Grammars], grammar: str) -> None:
    """Compile a request's grammar (cached for its session): a 400 naming what the engine
    refused, such as an unsupported JSON Schema keyword."""
    if not grammar:
        return
    if grammars is None:
        raise ApiError(400, "constrained output is not available on this server (no grammars for its "
                       "tokenizer)", "response_format", "unsupported_parameter")
    try:
        grammars.compile(grammar)
    except GrammarError as exc:
        raise ApiError(400, f"the requested schema cannot be enforced: {exc}; leave that keyword out of the "
                       "schema", "response_format", "invalid_value") from None
