"""A tool call's grammar (lockstep.grammar's engine, Lark): the call in the model's own format,
written between its markers as its tokenizer holds them.

A marker that is one added or special token (Qwen's `<tool_call>`, id 151657 in Qwen2.5 and
Qwen3; Mistral's special `[TOOL_CALLS]`, id 5) is that token in the grammar (`<[id]>`): the
engine never reads such a token as the bytes it spells, so the marker written as text could not
match the one token the model draws for it. A marker in ordinary tokens is text, which any of
its tokenizations matches.

The formats are mlx-lm's tool parsers whose arguments a JSON Schema can bound: json_tools
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5/Qwen3), mistral
(`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`), kimi_k2 (JSON arguments after a
`functions.NAME:0` header), qwen3_coder (`<function=NAME>` with one `<parameter=KEY>` block a
property, Qwen3-Coder's) and pythonic (`[NAME(key=value, ...)]`, LFM2's, the values JSON, which
its parser reads as Python literals): their calls are constrained, the others' refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import GrammarError
from .grammar import with_compact


def marker(tokenizer, text: str) -> str:
    """`text` (a tool-call marker) as a Lark expression for this tokenizer: each part of it that
    is one added token as that token (`<[id]>`), the rest as text. Added tokens are matched first
    and longest, as the tokenizer splits them off before its model."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds HF's
    added = {content: i for content, i in hf.get_added_vocab().items() if content and content in text}
    parts: List[str] = []
    plain, at = "", 0
    while at < len(text):
        hit = max((c for c in added if text.startswith(c, at)), key=len, default="")
        if hit:
            if plain:
                parts.append(json.dumps(plain))
                plain = ""
            parts.append(f"<[{added[hit]}]>")
            at += len(hit)
        else:
            plain += text[at]
            at += 1
    if plain:
        parts.append(json.dumps(plain))
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class CallFormat:
    """How one tokenizer writes a tool call: mlx-lm's tool parser (`parser`, the module's name),
    the markers as Lark expressions (marker(); `end` "" where the format has none, as Mistral's),
    the opening marker as text (plain text must never contain it), the markers a format writes
    inside a call (kimi_k2's), and the tokenizer's reasoning markers where each is one token
    (Qwen3's `<think>`, `</think>`; () otherwise)."""

    parser: str
    start: str
    end: str
    start_text: str
    inner: Tuple[str, ...] = ()
    think: Tuple[str, ...] = ()


# mlx-lm's parsers whose calls constrain -> the markers inside a call.
KIMI_K2_INNER = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
CONSTRAINED_FORMATS = {"json_tools": (), "mistral": (), "kimi_k2": KIMI_K2_INNER, "qwen3_coder": (), "pythonic": ()}


def call_format(tokenizer, parser: str, start: str, end: str) -> CallFormat:
    """The CallFormat of mlx-lm's tool parser `parser` with its markers on this tokenizer;
    GrammarError when its calls cannot be constrained."""
    if parser not in CONSTRAINED_FORMATS:
        raise GrammarError(f"this model's tool calls are in mlx-lm's {parser!r} format; constrained calls "
                           f"support the formats {sorted(CONSTRAINED_FORMATS)}")
    if not start:
        raise GrammarError(f"mlx-lm's {parser!r} tool format names no opening marker")
    think = [marker(tokenizer, m) for m in (getattr(tokenizer, "think_start", None),
                                              getattr(tokenizer, "think_end", None)) if m] \
        if getattr(tokenizer, "has_thinking", False) else []
    # Reasoning markers that are one token each (Qwen3's) only: the engine cannot end a lexeme
    # of free text at a marker spelled in text when a token of its own follows.
    single = len(think) == 2 and all(m.startswith("<[") and " " not in m for m in think)
    return CallFormat(parser, marker(tokenizer, start), marker(tokenizer, end) if end else "", start,
                      tuple(marker(tokenizer, m) for m in CONSTRAINED_FORMATS[parser]),
                      tuple(think) if single else ())


def _json(schema: Dict[str, Any]) -> str:
    return f"%json {json.dumps(with_compact(schema))}"


def _call_rules(calls: Sequence[Tuple[str, Dict[str, Any]]], fmt: CallFormat) -> List[str]:
    """The rules of `call`: one call, in `fmt`, to one of `calls` with its arguments' schema."""
    if fmt.parser in ("kimi_k2", "qwen3_coder", "pythonic"):
        names = [f"call_{i}" for i in range(len(calls))]
        rules = [f"call: {fmt.start} ({' | '.join(names)}) {fmt.end}".rstrip()]
        for i, (rule, (name, params)) in enumerate(zip(names, calls)):
            if fmt.parser == "kimi_k2":
                # <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{args}<|tool_call_end|>
                begin, args, close = fmt.inner
                rules.append(f"{rule}: {begin} {json.dumps(f'functions.{name}:0')} {args} {_json(params)} {close}")
            elif fmt.parser == "pythonic":
                rules += _pythonic_rules(rule, f"c{i}", name, params)
            else:
                rules += _coder_rules(rule, f"c{i}", name, params)
        return rules
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": name}, "arguments": params}} for name, params in calls]
    body = f"body: {_json(options[0] if len(options) == 1 else {'anyOf': options})}"
    if fmt.parser == "mistral":
        # [TOOL_CALLS] [{"name": ..., "arguments": {...}}] (no closing marker: EOS ends it)
        return [f'call: {fmt.start} " "? "[" body "]"', body]
    # json_tools: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (Qwen's newlines optional)
    return [f'call: {fmt.start} "\\n"? body "\\n"? {fmt.end}', body]


def _pythonic_rules(rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """pythonic's call to `name`: `[NAME(key=value, ...)]`, each value the JSON of its property's
    schema (a Python literal as the parser reads it, true/false/null included); the required
    keys first, in the schema's order, then each optional one or not."""
    properties = params.get("properties")
    if not isinstance(properties, dict) or not properties:
        # Any keyword arguments (a tool that is not strict).
        item = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {_json({})}'
        return [f'{rule}: {json.dumps("[" + name + "(")} (args_{tag})? ")]"',
                f'args_{tag}: {item} (", " {item})*']
    required = set(params.get("required") or [])
    items = {key: f"{json.dumps(key + '=')} {_json(schema)}" for key, schema in properties.items()}
    first = [items[k] for k in properties if k in required]
    rest = [items[k] for k in properties if k not in required]
    if first:
        body = ' ", " '.join(first) + "".join(f' (", " {item})?' for item in rest)
    else:
        body = "(" + rest[0] + "".join(f' (", " {item})?' for item in rest[1:]) + ")?"
    return [f'{rule}: {json.dumps("[" + name + "(")} {body} ")]"']


# qwen3_coder: what a parameter's value may be, as mlx-lm's parser reads it back (a string
# type's value is the raw text; other types' are JSON; "null" in any case is None).
_CODER_STRING_KEYWORDS = {"type", "enum", "const", "minLength", "maxLength", "pattern", "title", "description",
                          "default", "examples"}
_CODER_JSON_TYPES = {"integer", "number", "boolean", "object", "array"}
NL = "\n"
CLOSE = "\\n<\\/parameter>\\n"  # a parameter block's end, in a Lark regex


def _coder_rules(rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """qwen3_coder's call to `name`: `\\n<function=NAME>\\n`, one `<parameter=KEY>\\nVALUE\\n</parameter>\\n`
    a property (the required ones always, in the schema's order), `</function>\\n`."""
    properties = params.get("properties")
    if params.get("type", "object") != "object" or not isinstance(properties, dict) or not properties:
        if params.get("properties") or params.get("required"):
            raise GrammarError(f"tool {name!r}: qwen3_coder calls need parameters of type object")
        # Any parameters (a tool that is not strict): keys and values free, no block in a value.
        free = f"free_{tag}"
        return [f'{rule}: {_opening(name)} param_{tag}* "</function>\\n"',
                f'param_{tag}: "<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" {free}',
                f"{free}[lazy]: /(?s:.*){CLOSE}/"]
    required = set(params.get("required") or [])
    parts, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        part = f"p_{tag}_{j}"
        value, value_rules = _coder_value(f"{tag}_{j}", name, key, schema)
        rules.append(f'{part}: {json.dumps("<parameter=" + key + ">" + NL)} {value}')
        rules += value_rules
        parts.append(part if key in required else f"{part}?")
    return [f'{rule}: {_opening(name)} {" ".join(parts)} "</function>\\n"', *rules]


def _opening(name: str) -> str:
    return json.dumps(NL + "<function=" + name + ">" + NL)


def _coder_value(tag: str, name: str, key: str, schema: Any) -> Tuple[str, List[str]]:
    """(the Lark expression of one parameter's value, the rules it needs)."""
    where = f"tool {name!r}, parameter {key!r}"
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: its schema must be an object")
    kind = schema.get("type")
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if values is not None:
        if not values:
            raise GrammarError(f"{where}: an empty enum allows no value")
        # As the parser reads them back: a string's value raw, another type's as JSON; with no
        # 'type', only strings come back as they were.
        if kind is None and not all(isinstance(v, str) for v in values):
            raise GrammarError(f"{where}: give the enum's 'type' (a qwen3_coder call reads an untyped value as text)")
        return "(" + " | ".join(json.dumps(v if isinstance(v, str) and kind in (None, "string") else json.dumps(v))
                                for v in values) + ") " + json.dumps(NL + "</parameter>" + NL), []
    if kind in _CODER_JSON_TYPES:
        return _json(schema) + " " + json.dumps(NL + "</parameter>" + NL), []
    if kind != "string":
        raise GrammarError(f"{where}: qwen3_coder calls constrain a parameter of one 'type' (string, integer, "
                           f"number, boolean, object, array), not {json.dumps(kind or schema)[:80]}")
    unknown = sorted(set(schema) - _CODER_STRING_KEYWORDS)
    if unknown:
        raise GrammarError(f"{where}: a string parameter of a qwen3_coder call cannot be held to {unknown}")
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    terminal = f"v_{tag}"
    # Raw text of the length asked, then the block's end: one lexeme, ended lazily at the first
    # end (a greedy value would swallow the end's first bytes); never "null" (the parser's None).
    regex = f"/(?s:.{{{low},{'' if high is None else int(high)}}}){CLOSE}/ & ~/(?i:null){CLOSE}/"
    if "pattern" in schema:
        regex += f" & /{_pattern_regex(where, schema['pattern'])}{CLOSE}/"
    return terminal, [f"{terminal}[lazy]: {regex}"]


def _pattern_regex(where: str, pattern: Any) -> str:
    """A JSON Schema `pattern` (found anywhere in the string) as a Lark regex of the whole value."""
    import llguidance

    if not isinstance(pattern, str):
        raise GrammarError(f"{where}: 'pattern' must be a string")
    body = pattern[1:] if pattern.startswith("^") else ".*" + pattern
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body + ".*"
    try:
        return f"(?s:{llguidance.regex_to_lark(body, 'dw')})"
    except Exception as exc:  # noqa: BLE001 - the engine names what it cannot read
        raise GrammarError(f"{where}: its pattern {pattern!r} cannot be used: {exc}") from None


def tool_call_grammar(calls: Sequence[Tuple[str, Dict[str, Any]]], fmt: CallFormat, required: bool,
                      text_schema: Optional[Dict[str, Any]] = None) -> str:
    """A tool call in the tokenizer's format `fmt` whose arguments follow the tool's parameters
    schema, for each (name, schema) of `calls`; unless `required`, an answer without a call
    instead: plain text, or JSON that follows `text_schema` ({}: any object) when one is given."""
    if not calls:
        raise GrammarError("a tool call grammar needs at least one tool")
    text = "TEXT" if text_schema is None else "text"
    rules = [f"start: {'call' if required else _unforced(fmt, text)}", *_call_rules(calls, fmt)]
    if not required and fmt.think:
        rules += _think_rules(fmt.think)
    if not required and text_schema is not None:
        rules.append(f"text: {_json(text_schema or {'type': 'object'})}")
    elif not required:
        # Text that never opens a call: a call the model begins is always a schema's call. (An
        # added-token marker cannot occur in text at all; its spelling in ordinary tokens would
        # open a call as mlx-lm reads the text, so that is excluded too.)
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{_regex_literal(fmt.start_text)}.*)/")
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


def _regex_literal(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "\\" + c if c in r"\^$.|?*+()[]{}/" else c
                   for c in text)
