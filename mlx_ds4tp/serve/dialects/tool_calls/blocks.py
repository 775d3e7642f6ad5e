"""Formats that write one block a parameter, its value typed by the tool's schema as the
format's parser reads it back:

  qwen3_coder  `\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n`
               (Qwen3-Coder): a string parameter's value raw, other types' JSON, "null" None.
  glm47        `NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...` (GLM-4.7; laguna is
  (laguna)     the same parser): a `"type": "string"` parameter's value raw, stripped; any other
               schema's JSON (its parser tries json.loads first).
  longcat      glm47's blocks with `longcat_` tags; a call with no argument is written as JSON
               (`{"name": ..., "arguments": {}}`), which its parser returns as it is.
  minimax_m2   `\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n...</invoke>\\n`
               (MiniMax-M2): the value converted by the parameter's one type, "null" None.
  minicpm5     `"NAME"><param name="KEY">VALUE</param>...` after `<function name=` (MiniCPM5):
               minimax_m2's conversion; a whole-CDATA value is its content.
  muse_spark   `<atem:invoke name="NAME"><atem:parameter name="KEY">VALUE</atem:parameter>...
               </atem:invoke>` (Muse Spark): each value JSON (its parser tries json.loads first).

A parameter a format reads by one type only (a raw string, or one JSON type) and whose schema
names several (anyOf, a list of types) is refused by name: its value could come back as another
type than written.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Optional, Tuple

from ....lockstep.errors import GrammarError
from .base import CallFormat, RawText, closed_text, json_value, keyed_sequence, properties_of, raw_string, resolved

# Values a format reads as one JSON type (its parser converts by the schema's type).
JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}
NUMBER_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum", "const"}
NULL = "(?i:null)"


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One block format: the texts around a call's name and each parameter ({name}, {key}
    filled in), the text closing a value, what follows it, the call's close; how values are
    typed (`typing`: "coder", "string_raw", "typed" or "json"); `raw` how a raw value is read;
    `empty`, the text of a call without arguments where the blocks' form cannot be (or "")."""

    opening: str
    param: str
    close: str
    after: str
    ending: str
    typing: str
    raw: RawText
    empty: str = ""


FORMATS = {
    "qwen3_coder": Blocks("\n<function={name}>\n", "<parameter={key}>\n", "\n</parameter>\n", "", "</function>\n",
                          "coder", RawText("\n</parameter>\n", never=(NULL,))),
    "glm47": Blocks("{name}", "<arg_key>{key}</arg_key><arg_value>", "</arg_value>", "", "", "string_raw",
                    RawText("</arg_value>", strip=True)),
    "longcat": Blocks("{name}", "<longcat_arg_key>{key}</longcat_arg_key><longcat_arg_value>",
                      "</longcat_arg_value>", "", "", "string_raw", RawText("</longcat_arg_value>", strip=True),
                      empty='{{"name":{quoted},"arguments":{{}}}}'),
    "minimax_m2": Blocks('\n<invoke name="{name}">\n', '<parameter name="{key}">', "</parameter>", "\n",
                         "</invoke>\n", "typed", RawText("</parameter>", strip=True, never=(NULL,))),
    "minicpm5": Blocks('"{name}">', '<param name="{key}">', "</param>", "", "", "typed",
                       RawText("</param>", strip=True, never=(NULL, r"<!\[CDATA\[(?s:.*)\]\]>"))),
    "muse_spark": Blocks('<atem:invoke name="{name}">', '<atem:parameter name="{key}">', "</atem:parameter>", "",
                         "</atem:invoke>", "json", RawText("</atem:parameter>")),
}
FORMATS["laguna"] = FORMATS["glm47"]
# The markers these formats write inside a call (tokens of their own in some tokenizers).
MARKS = {"glm47": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
         "longcat": ("<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>")}
MARKS["laguna"] = MARKS["glm47"]
# muse_spark's raw string: its parser reads JSON first, so the text must not be JSON (a string,
# number, array, object, or one of the words json.loads takes).
NOT_JSON = RawText("</atem:parameter>", strip=True, never=("(true|false|null|NaN|Infinity)",),
                   shape=(r'([^\s"\[{\-0-9](?s:.*))?',))
# A name or key is written bare or between double quotes: it cannot hold blanks, quotes or <>.
PLAIN_NAME = re.compile(r"[^\s<>\"'&]+")


def block_call(fmt: CallFormat, rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """The rules of `rule`: one call to `name` in `fmt`'s block format."""
    spec = FORMATS[fmt.parser]
    _plain(name, f"tool {name!r}: its name")
    opening = fmt.spell(spec.opening.format(name=name))
    ending = fmt.spell(spec.ending) if spec.ending else ""
    properties = properties_of(name, params, fmt.parser)
    if properties is None:
        # Any parameters (a tool that is not strict): keys free, each value raw text or JSON.
        key = f"/{PLAIN_NAME.pattern}/"
        before, after_key = (fmt.spell(s) for s in spec.param.split("{key}"))
        value, rules = _free_value(fmt, tag, spec)
        param = f"param_{tag}"
        rules.append(f"{param}: {before} {key} {after_key} {value}")
        return [_call_line(rule, (opening, f"{param}*", ending), spec, name, True), *rules]
    parts, rules = {}, []
    for j, key in enumerate(properties):
        _plain(key, f"tool {name!r}, parameter {key!r}")
        part = f"p_{tag}_{j}"
        where = f"tool {name!r}, parameter {key!r}"
        value, value_rules = _value(fmt, f"{tag}_{j}", where, properties[key], spec, params)
        rules.append(f"{part}: {fmt.spell(spec.param.format(key=key))} {value}")
        rules += value_rules
        parts[key] = part
    body = keyed_sequence(parts, params, "")
    return [_call_line(rule, (opening, body, ending), spec, name, not params.get("required")), *rules]


def _call_line(rule: str, parts: Tuple[str, str, str], spec: Blocks, name: str, may_be_empty: bool) -> str:
    """`rule`'s line: the opening, the blocks (`body`), the ending. Where every block may be
    left out (`body` ends in ? or *) and the format writes a call without arguments otherwise
    (longcat's parser cannot read a name alone): one block or more, or that text."""
    opening, body, ending = parts
    if not spec.empty or not may_be_empty:
        return f"{rule}: {opening} {body} {ending}"
    some = body[:-1] if body.endswith("?") else body[:-1] + "+"
    return f"{rule}: {opening} {some} {ending} | {json.dumps(spec.empty.format(quoted=json.dumps(name)))}"


def _resolved(where: str, schema: Any, params: Dict[str, Any]) -> Any:
    try:
        return resolved(schema, params)
    except GrammarError as exc:
        raise GrammarError(f"{where}: {exc}") from None


def _plain(text: str, where: str) -> None:
    if not PLAIN_NAME.fullmatch(text):
        raise GrammarError(f"{where} cannot be written in this format (no blanks, quotes or '<>')")


def _free_value(fmt: CallFormat, tag: str, spec: Blocks) -> Tuple[str, List[str]]:
    if spec.typing == "json":
        return f"{json_value({})} {fmt.spell(spec.close)}{_after(fmt, spec)}", []
    regexes = [r"(\S((?s:.*)\S)?)?"] if spec.raw.strip else [r"(?s:.*)"]
    value, rules = closed_text(fmt, f"f_{tag}", regexes, spec.raw)
    return value + _after(fmt, spec), rules


def _after(fmt: CallFormat, spec: Blocks) -> str:
    return f" {fmt.spell(spec.after)}" if spec.after else ""


def _value(fmt: CallFormat, tag: str, where: str, schema: Any, spec: Blocks,
           params: Dict[str, Any]) -> Tuple[str, List[str]]:
    """(the Lark expression of one parameter's value and its close, the rules it needs). The
    parser types the value by the property's schema as written (a `$ref` unfollowed)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: its schema must be an object")
    close = f" {fmt.spell(spec.close)}{_after(fmt, spec)}"
    as_json = f"{json_value(_resolved(where, schema, params))}{close}"
    if spec.typing == "json":
        if schema.get("type") != "string":
            return as_json, []
        # A string as JSON, or raw where its text is not JSON (which the parser would read as such).
        value, rules = raw_string(fmt, tag, where, schema, NOT_JSON)
        return f"({value}{_after(fmt, spec)} | {as_json})", rules
    if spec.typing == "string_raw":
        # Its parser reads a parameter raw when the schema's type is "string", else as JSON.
        if schema.get("type") != "string":
            return as_json, []
    else:
        kind = _one_type(where, schema, fmt.parser)
        if kind in ("integer", "number") and not set(schema) & NUMBER_BOUNDS:
            # Their parsers convert through float(): a number of no bounds is written without
            # an exponent and at most 15 digits a side, so it never overflows to inf (whose
            # int() raises, and the call was lost) and an integer comes back exact.
            fraction = r"(\.[0-9]{1,15})?" if kind == "number" else ""
            return f"/-?(0|[1-9][0-9]{{0,14}}){fraction}/{close}", []
        if kind in JSON_TYPES:
            return as_json, []
    value, rules = raw_string(fmt, tag, where, schema, spec.raw)
    return value + _after(fmt, spec), rules


def _one_type(where: str, schema: Dict[str, Any], parser: str) -> str:
    """The one type a "coder" or "typed" parser converts the value by; GrammarError otherwise."""
    kind = schema.get("type")
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if kind is None and values and all(isinstance(v, str) for v in values):
        kind = "string"
    several = [k for k in ("anyOf", "oneOf", "allOf") if k in schema]
    if several or not isinstance(kind, str) or (kind != "string" and values is not None and parser != "qwen3_coder"
                                                and len({_json_type(v) for v in values} | {kind}) > 1):
        raise GrammarError(f"{where}: a {parser} call reads a parameter by one 'type' (string, integer, number, "
                           f"boolean, object, array), not {json.dumps(schema)[:80]}")
    if kind not in JSON_TYPES | {"string"} or (parser == "qwen3_coder" and kind == "null"):
        raise GrammarError(f"{where}: its type {kind!r} is not one this format reads back")
    return kind


def _json_type(value: Any) -> Optional[str]:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value))
