"""A tool call's grammar (lockstep.sampling.grammar's engine, Lark): the call in the model's own format,
written between its markers as its tokenizer holds them.

A marker that is one added or special token (Qwen's `<tool_call>`, id 151657 in Qwen2.5 and
Qwen3; Mistral's special `[TOOL_CALLS]`, id 5) is that token in the grammar (`<[id]>`): the
engine never reads such a token as the bytes it spells, so the marker written as text could not
match the one token the model draws for it. A marker in ordinary tokens is text, which any of
its tokenizations matches.

Every one of mlx-lm's tool parsers has its grammar (serve.dialects.tool_calls): json_tools, mistral,
kimi_k2, kimi_k3, pythonic, function_gemma, gemma4, qwen3_coder, glm47, laguna, longcat,
minimax_m2, minicpm5 and muse_spark. A parameter schema a format cannot write so that its parser
reads it back as valid (a function_gemma array, a minimax_m2 parameter of several types) is
refused by name; so is a parser mlx-lm adds later, until it has its grammar here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ....lockstep.errors import GrammarError
from . import FORMATS, call_rules
from .base import CallFormat, json_value, marker, regex_literal

__all__ = ["CallFormat", "call_format", "marker", "tool_call_grammar"]

def call_format(tokenizer, parser: str, start: str, end: str) -> CallFormat:
    """The CallFormat of mlx-lm's tool parser `parser` with its markers on this tokenizer;
    GrammarError when its calls cannot be constrained."""
    if parser not in FORMATS:
        raise GrammarError(f"this model's tool calls are in mlx-lm's {parser!r} format, which has no grammar here; "
                           f"constrained calls support the formats {sorted(FORMATS)}")
    if not start:
        raise GrammarError(f"mlx-lm's {parser!r} tool format names no opening marker")
    think = [marker(tokenizer, m) for m in (getattr(tokenizer, "think_start", None),
                                              getattr(tokenizer, "think_end", None)) if m] \
        if getattr(tokenizer, "has_thinking", False) else []
    # Reasoning markers that are one token each (Qwen3's) only: the engine cannot end a lexeme
    # of free text at a marker spelled in text when a token of its own follows.
    single = len(think) == 2 and all(m.startswith("<[") and " " not in m for m in think)
    marks = tuple((m, marker(tokenizer, m)) for m in FORMATS[parser][0])
    return CallFormat(parser, marker(tokenizer, start), marker(tokenizer, end) if end else "", start, marks,
                      tuple(think) if single else (), end or "")


def tool_call_grammar(calls: Sequence[Tuple[str, Dict[str, Any]]], fmt: CallFormat, required: bool,
                      text_schema: Optional[Dict[str, Any]] = None) -> str:
    """A tool call in the tokenizer's format `fmt` whose arguments follow the tool's parameters
    schema, for each (name, schema) of `calls`; unless `required`, an answer without a call
    instead: plain text, or JSON that follows `text_schema` ({}: any object) when one is given."""
    if not calls:
        raise GrammarError("a tool call grammar needs at least one tool")
    text = "TEXT" if text_schema is None else "text"
    rules = [f"start: {'call' if required else _unforced(fmt, text)}", *call_rules(calls, fmt)]
    if not required and fmt.think:
        rules += _think_rules(fmt.think)
    if not required and text_schema is not None:
        rules.append(f"text: {json_value(text_schema or {'type': 'object'})}")
    elif not required:
        # Text that never opens a call: a call the model begins is always a schema's call. (An
        # added-token marker cannot occur in text at all; its spelling in ordinary tokens would
        # open a call as mlx-lm reads the text, so that is excluded too.)
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{regex_literal(fmt.start_text)}.*)/")
    return "\n".join(rules) + "\n"


def _unforced(fmt: CallFormat, text: str) -> str:
    """What an unforced answer may be: text or a call; after a reasoning block first where the
    tokenizer has one (a thinking model's reasoning is free; blanks may part it from a call)."""
    if not fmt.think:
        return f"{text} | call"
    return f"think? ({text} | CALL_WS? call)"


def _think_rules(think: Tuple[str, ...]) -> List[str]:
    """The reasoning block: its opening token, free text (which cannot hold a token of its own,
    so it ends at the closing one), its closing token."""
    begin, close = think
    return ["CALL_WS: /[ \\t\\r\\n]+/", f"think: {begin} THINK_TEXT? {close}", "THINK_TEXT: /(?s:.+)/"]
