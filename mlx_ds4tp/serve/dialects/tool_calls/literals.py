"""Formats that write a call as a function applied to literals:

  pythonic        `[NAME(key=value, ...)]` (LFM2's): each value the JSON of its property's schema,
                  which the parser reads as a Python literal (true/false/null included).
  function_gemma  `call:NAME{key:value,...}` (FunctionGemma's): a string `<escape>TEXT<escape>`,
                  any other value the text up to the next `,` read as JSON. Its parser ends the
                  call at the first `}` and a bare value at the first `,`, so a parameter whose
                  schema allows an array or an object (or a JSON string) cannot be written:
                  such a tool is refused by name; a string value never holds `}`.
  gemma4          `call:NAME{key:value,...}` (Gemma 4's): JSON with bare keys and strings
                  between `<|"|>` delimiters, written from the tool's schema by gemma4_value()
                  (objects, arrays, strings, numbers, enums, anyOf, $ref); a keyword it cannot
                  hold to is refused by name.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Set

from ....lockstep.errors import GrammarError
from .base import CallFormat, RawText, closed_text, json_value, keyed_sequence, properties_of, raw_string, resolved

ESCAPE = "<escape>"
QUOTE = '<|"|>'
# Keywords that describe a value without bounding it.
DESCRIBING = {"title", "description", "default", "examples", "$schema", "$defs", "definitions", "$comment",
              "readOnly", "writeOnly", "deprecated", "$id"}
NUMBER_KEYWORDS = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
BARE_KEY = re.compile(r"[A-Za-z0-9_]+")


def pythonic_call(fmt: CallFormat, rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """pythonic's call to `name`: `[NAME(key=value, ...)]`, the required keys first, in the
    schema's order, then each optional one or not."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
        raise GrammarError(f"tool {name!r}: a pythonic call's name is a Python name")
    opening = json.dumps("[" + name + "(")
    properties = properties_of(name, params, "pythonic")
    if properties is None:
        # Any keyword arguments (a tool that is not strict).
        item = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {json_value({})}'
        return [f'{rule}: {opening} (args_{tag})? ")]"', f'args_{tag}: {item} (", " {item})*']
    for key in properties:
        if not key.isidentifier():
            raise GrammarError(f"tool {name!r}, parameter {key!r}: a pythonic call's keys are Python names")
    items = {key: f"{json.dumps(key + '=')} {json_value(resolved(schema, params))}"
             for key, schema in properties.items()}
    body = keyed_sequence(items, params, '", "')
    return [f'{rule}: {opening} {body} ")]"']


def function_gemma_call(fmt: CallFormat, rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """function_gemma's call to `name`: `call:NAME{key:value,...}`."""
    if not BARE_KEY.fullmatch(name):
        raise GrammarError(f"tool {name!r}: a function_gemma call's name is letters, digits and '_'")
    opening = json.dumps(f"call:{name}{{")
    escape = fmt.mark(ESCAPE)
    raw = RawText(ESCAPE, forbid=("}",))
    properties = properties_of(name, params, "function_gemma")
    if properties is None:
        text, rules = closed_text(fmt, f"s_{tag}", ["(?s:.*)"], raw)
        scalar = json_value({"type": ["number", "boolean", "null"]})
        item = f'/[A-Za-z0-9_]+/ ":" ({escape} {text} | {scalar})'
        return [f'{rule}: {opening} ({item} ("," {item})*)? "}}"', *rules]
    items, rules = {}, []
    for j, (key, schema) in enumerate(properties.items()):
        where = f"tool {name!r}, parameter {key!r}"
        if not re.fullmatch(r"[^:,{}<>\s]+", key):
            raise GrammarError(f"{where}: a function_gemma call's keys cannot hold ':', ',', braces or blanks")
        kinds = json_types(schema)
        if kinds == {"string"}:
            text, text_rules = raw_string(fmt, f"{tag}_{j}", where, schema, raw)
            value, rules = f"{escape} {text}", rules + text_rules
        elif kinds and kinds <= {"integer", "number", "boolean", "null"}:
            value = json_value(resolved(schema, params))
        else:
            raise GrammarError(f"{where}: a function_gemma call holds a string or a number, boolean or null "
                               f"(its parser ends the call at the first '}}' and a bare value at the first ','), "
                               f"not {json.dumps(schema)[:80]}")
        items[key] = f"{json.dumps(key + ':')} {value}"
    body = keyed_sequence(items, params, '","')
    return [f'{rule}: {opening} {body} "}}"', *rules]


def json_types(schema: Any) -> Optional[Set[str]]:
    """The JSON types a schema's values may have (None: any)."""
    if not isinstance(schema, dict):
        return None
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return {"string" if isinstance(v, str) else "boolean" if isinstance(v, bool) else "null" if v is None
                else "integer" if isinstance(v, int) else "number" if isinstance(v, float) else "other"
                for v in values}
    if "anyOf" in schema or "oneOf" in schema:
        found: Set[str] = set()
        for option in schema.get("anyOf", schema.get("oneOf")) or []:
            kinds = json_types(option)
            if kinds is None:
                return None
            found |= kinds
        return found
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def gemma4_call(fmt: CallFormat, rule: str, tag: str, name: str, params: Dict[str, Any]) -> List[str]:
    """gemma4's call to `name`: `call:NAME{...}`, the arguments as gemma4_value() writes them."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise GrammarError(f"tool {name!r}: a gemma4 call's name is letters, digits, '_' and '-'")
    properties_of(name, params, "gemma4")
    writer = Gemma4Writer(fmt, tag, params)
    args = writer.value(params, f"tool {name!r}")
    return [f'{rule}: {json.dumps("call:" + name)} {args}', *writer.rules]


class Gemma4Writer:
    """A JSON Schema as the Lark rules of gemma4's values: JSON with bare keys, strings between
    `<|"|>` delimiters (one token in Gemma 4's tokenizer, text otherwise)."""

    def __init__(self, fmt: CallFormat, tag: str, root: Dict[str, Any]):
        self.fmt, self.tag, self.root = fmt, tag, root
        self.quote = fmt.mark(QUOTE)
        self.rules: List[str] = []
        self._named: Dict[str, str] = {}
        self._count = 0

    def _rule(self, expression: str) -> str:
        self._count += 1
        name = f"g_{self.tag}_{self._count}"
        self.rules.append(f"{name}: {expression}")
        return name

    def value(self, schema: Any, where: str) -> str:
        """The Lark expression of a value of `schema`."""
        if schema is True or schema == {} or (isinstance(schema, dict) and set(schema) <= DESCRIBING):
            return self.any()
        if not isinstance(schema, dict):
            raise GrammarError(f"{where}: its schema must be an object")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        for key in ("enum", "const"):
            if key in schema:
                values = schema[key] if key == "enum" else [schema[key]]
                return "(" + " | ".join(self.literal(v, where) for v in values) + ")"
        if "anyOf" in schema:
            return "(" + " | ".join(self.value(option, where) for option in schema["anyOf"]) + ")"
        unknown = sorted(set(schema) - DESCRIBING - NUMBER_KEYWORDS - {"minLength", "maxLength", "pattern", "items",
                                                                         "minItems", "maxItems", "properties",
                                                                         "required", "additionalProperties"})
        if unknown:
            raise GrammarError(f"{where}: a gemma4 call cannot hold a value to {unknown}")
        kind = schema.get("type", "object" if "properties" in schema else None)
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}, where) for k in kind) + ")"
        return self._typed(kind, schema, where)

    def _typed(self, kind: Any, schema: Dict[str, Any], where: str) -> str:
        if kind in ("integer", "number"):
            return json_value({k: v for k, v in schema.items() if k in NUMBER_KEYWORDS})
        if kind in ("boolean", "null"):
            return '("true" | "false")' if kind == "boolean" else '"null"'
        if kind == "string":
            text, rules = raw_string(self.fmt, f"{self.tag}_{self._count}s", where,
                                     {k: v for k, v in schema.items() if k not in DESCRIBING}, RawText(QUOTE))
            self._count += 1
            self.rules += rules
            return f"{self.quote} {text}"
        if kind == "array":
            return self._array(schema, where)
        if kind == "object":
            return self._object(schema, where)
        if kind is None:
            return self.any()
        raise GrammarError(f"{where}: {kind!r} is not a JSON Schema type")

    def _array(self, schema: Dict[str, Any], where: str) -> str:
        item = self.value(schema.get("items", {}), f"{where}, its items")
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) < low:
            raise GrammarError(f"{where}: its minItems is over its maxItems: no array fits")
        if high is not None and int(high) == 0:
            return '"[" "]"'
        more = f'("," {item})' + (f"{{{max(low - 1, 0)},{int(high) - 1}}}" if high is not None
                                  else "*" if low <= 1 else f"{{{low - 1},}}")
        items = f"{item} {more}"
        return f'"[" {items} "]"' if low else f'"[" ({items})? "]"'

    def _object(self, schema: Dict[str, Any], where: str) -> str:
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties", True)
        if not properties:
            if isinstance(extra, dict):
                pair = f'/{BARE_KEY.pattern}/ ":" {self.value(extra, where)}'
                return f'"{{" ({pair} ("," {pair})*)? "}}"'
            return self.any_object() if extra is not False else '"{" "}"'
        items = {}
        for key, sub in properties.items():
            if not BARE_KEY.fullmatch(key):
                raise GrammarError(f"{where}: the key {key!r} cannot be written bare in a gemma4 call")
            items[key] = f"{json.dumps(key + ':')} {self.value(sub, f'{where}, key {key!r}')}"
        body = keyed_sequence(items, schema, '","')
        return self._rule(f'"{{" {body} "}}"')

    def _ref(self, ref: Any, where: str) -> str:
        """A `$ref` to the root's `$defs` (or `definitions`): one rule, so a schema may nest itself."""
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        target = (self.root.get(match.group(1)) or {}).get(match.group(2)) if match else None
        if target is None:
            raise GrammarError(f"{where}: its $ref {ref!r} names no schema under the parameters' $defs")
        if ref not in self._named:
            self._count += 1
            name = f"r_{self.tag}_{self._count}"
            self._named[ref] = name
            self.rules.append(f"{name}: {self.value(target, f'{where} ({ref})')}")
        return self._named[ref]

    def literal(self, value: Any, where: str) -> str:
        """One JSON value (an enum's, a const) as gemma4 writes it."""
        if isinstance(value, str):
            if QUOTE in value:
                raise GrammarError(f"{where}: the value {value!r} holds gemma4's string delimiter {QUOTE}")
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if isinstance(value, list):
            return '"[" ' + ' "," '.join(self.literal(v, where) for v in value) + ' "]"'
        if isinstance(value, dict):
            if not all(BARE_KEY.fullmatch(k) for k in value):
                raise GrammarError(f"{where}: the keys of {json.dumps(value)[:60]} cannot be written bare")
            return '"{" ' + ' "," '.join(f"{json.dumps(k + ':')} {self.literal(v, where)}"
                                         for k, v in value.items()) + ' "}"'
        return json.dumps(json.dumps(value))

    def any(self) -> str:
        """Any value (a tool that is not strict, a schema without bounds): one set of rules."""
        if "any" not in self._named:
            value, obj, arr = (f"any_{self.tag}_{k}" for k in ("v", "o", "a"))
            self._named["any"] = value
            text, rules = closed_text(self.fmt, f"a_{self.tag}", ["(?s:.*)"], RawText(QUOTE))
            self.rules += rules + [
                f'{value}: {obj} | {arr} | {self.quote} {text} | {json_value({"type": "number"})} | "true" | '
                f'"false" | "null"',
                f'{obj}: "{{" (/{BARE_KEY.pattern}/ ":" {value} ("," /{BARE_KEY.pattern}/ ":" {value})*)? "}}"',
                f'{arr}: "[" ({value} ("," {value})*)? "]"']
        return self._named["any"]

    def any_object(self) -> str:
        self.any()
        return f"any_{self.tag}_o"
