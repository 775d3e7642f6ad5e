"""Formats whose arguments are one JSON object, so a JSON Schema bounds them whatever its
keywords (the engine's %json): json_tools (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
Qwen2.5/Qwen3), mistral (`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`), kimi_k2 (the
arguments after a `functions.NAME:0` header) and kimi_k3 (XTML: a call block holding one `json`
block, which its parser reads with json.loads and takes when it is an object)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence, Tuple

from .base import CallFormat, json_value

Calls = Sequence[Tuple[str, Dict[str, Any]]]

KIMI_K2_MARKS = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
KIMI_K3_MARKS = ("<|open|>", "<|sep|>", "<|close|>")


def named_object_rules(calls: Calls, fmt: CallFormat) -> List[str]:
    """json_tools and mistral: `{"name": NAME, "arguments": {...}}` between the markers."""
    options, defs = [], {}
    for i, (name, params) in enumerate(calls):
        arguments, own = _hoisted(params, f"t{i}_")
        defs.update(own)
        options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": name}, "arguments": arguments}})
    envelope = options[0] if len(options) == 1 else {"anyOf": options}
    body = f"body: {json_value({**envelope, '$defs': defs} if defs else envelope)}"
    if fmt.parser == "mistral":
        # [TOOL_CALLS] [{"name": ..., "arguments": {...}}] (no closing marker: EOS ends it)
        return [f'call: {fmt.start} " "? "[" body "]"', body]
    # json_tools: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (Qwen's newlines optional)
    return [f'call: {fmt.start} "\\n"? body "\\n"? {fmt.end}', body]


def _hoisted(params: Any, prefix: str) -> Tuple[Any, Dict[str, Any]]:
    """A tool's parameters set inside the call's envelope: their `$defs` (or `definitions`),
    which a `$ref` names from the schema's root, moved to the envelope's root under `prefix`
    (two tools may name a definition alike), each reference to them renamed."""
    if not isinstance(params, dict):
        return params, {}
    defs = {f"{prefix}{k}": v for section in ("$defs", "definitions") for k, v in (params.get(section) or {}).items()}
    if not defs:
        return params, {}

    def renamed(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            out = {k: renamed(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            for section in ("$defs", "definitions"):
                if isinstance(ref, str) and ref.startswith(f"#/{section}/"):
                    out["$ref"] = f"#/$defs/{prefix}{ref[len(section) + 3:]}"
            return out
        return [renamed(v) for v in node] if isinstance(node, list) else node

    return renamed(params), {k: renamed(v) for k, v in defs.items()}


def kimi_k2_call(fmt: CallFormat, rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{args}<|tool_call_end|>"""
    begin, args, close = (fmt.mark(m) for m in KIMI_K2_MARKS)
    return [f"{rule}: {begin} {json.dumps(f'functions.{name}:0')} {args} {json_value(params)} {close}"]


def kimi_k3_call(fmt: CallFormat, rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """<|open|>call tool="NAME" index="1"<|sep|><|open|>json type="object"<|sep|>{args}
    <|close|>json<|sep|><|close|>call<|sep|> (the name escaped as the parser unescapes it)."""
    opened, sep, closed = (fmt.mark(m) for m in KIMI_K3_MARKS)
    attribute = name.replace("&", "&amp;").replace('"', "&quot;")
    header = json.dumps(f'call tool="{attribute}" index="1"')
    block = json.dumps('json type="object"')
    return [f'{rule}: {opened} {header} {sep} {opened} {block} {sep} {json_value(params)} {closed} "json" {sep} '
            f'{closed} "call" {sep}']
