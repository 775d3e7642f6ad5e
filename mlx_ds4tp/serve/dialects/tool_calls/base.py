"""What every tool-call format's grammar is made of: the markers as the tokenizer holds them,
JSON values, and raw text values that end at a closing marker.

A marker that is one added or special token is that token in the grammar (`<[id]>`): the engine
never reads such a token as the bytes it spells. A marker in ordinary tokens is text, which any
of its tokenizations matches.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ....lockstep.errors import GrammarError
from ....lockstep.sampling.grammar import with_compact


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
    inside a call (`marks`: (text, Lark expression)), the tokenizer's reasoning markers where
    each is one token (Qwen3's `<think>`, `</think>`; () otherwise), and the closing marker as
    text (a raw value must never hold it: mlx-lm's reading ends the call at its first)."""

    parser: str
    start: str
    end: str
    start_text: str
    marks: Tuple[Tuple[str, str], ...] = ()
    think: Tuple[str, ...] = ()
    end_text: str = ""

    def mark(self, text: str) -> str:
        """The Lark expression of `text`: a marker of the format's as the tokenizer holds it,
        other text as text."""
        return self.spell(text)

    def spell(self, text: str) -> str:
        """The Lark expression of `text`, each of the format's markers in it as mark() has it
        (the longest first), the rest as text; "" for no text."""
        marks = dict(self.marks)
        parts: List[str] = []
        plain, at = "", 0
        while at < len(text):
            hit = max((m for m in marks if text.startswith(m, at)), key=len, default="")
            if hit:
                parts += [json.dumps(plain)] if plain else []
                parts.append(marks[hit])
                plain, at = "", at + len(hit)
            else:
                plain, at = plain + text[at], at + 1
        return " ".join(parts + ([json.dumps(plain)] if plain else []))


def json_value(schema: Any) -> str:
    """JSON text (compact) that validates against `schema`."""
    return f"%json {json.dumps(with_compact(schema if isinstance(schema, dict) else {}))}"


def regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark regex (/.../)."""
    blanks = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(blanks.get(c) or (c if c.isalnum() or c == "_" else "\\" + c if c in r"\^$.|?*+()[]{}/" else c)
                   for c in text)


@dataclasses.dataclass(frozen=True)
class RawText:
    """A value written as raw text up to a closing marker, as a parser reads it back: `strip`
    where the parser strips the value (no blank at either end), `never` the regexes the whole
    value must not match (a parser's null, a CDATA block), `forbid` text it must not hold,
    `shape` regexes it must match besides its schema's."""

    close: str
    strip: bool = False
    never: Tuple[str, ...] = ()
    forbid: Tuple[str, ...] = ()
    shape: Tuple[str, ...] = ()


# The keywords a raw string value is held to (the rest describe it).
STRING_KEYWORDS = {"type", "enum", "const", "minLength", "maxLength", "pattern", "title", "description", "default",
                   "examples"}


def raw_string(fmt: CallFormat, tag: str, where: str, schema: Dict[str, Any], raw: RawText) -> Tuple[str, List[str]]:
    """(the Lark expression of a string value written raw, then its closing marker; the rules
    it needs) for a string `schema`: an enum or const as its values, else text of the length
    and pattern asked; GrammarError naming a keyword it cannot be held to."""
    unknown = sorted(set(schema) - STRING_KEYWORDS)
    if unknown:
        raise GrammarError(f"{where}: a string written raw in a {fmt.parser} call cannot be held to {unknown}")
    close = fmt.mark(raw.close)
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        kept = [v for v in values if isinstance(v, str) and _fits(v, raw) and not (fmt.end_text and fmt.end_text in v)]
        if not kept:
            raise GrammarError(f"{where}: none of its values {json.dumps(values)[:80]} can be written raw in a "
                               f"{fmt.parser} call")
        return "(" + " | ".join(json.dumps(v) for v in kept) + f") {close}", []
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    regexes = [f"(?s:.{{{low},{'' if high is None else int(high)}}})"]
    if raw.strip:
        regexes.append(r"(\S((?s:.*)\S)?)?")
    if "pattern" in schema:
        regexes.append(pattern_regex(where, schema["pattern"]))
    return closed_text(fmt, tag, regexes + list(raw.shape), raw)


def closed_text(fmt: CallFormat, tag: str, regexes: Sequence[str], raw: RawText) -> Tuple[str, List[str]]:
    """(text matching every one of `regexes` and none of `raw.never`, then `raw.close`; its rule).
    The value never holds the close (the parser's value ends at its first), nor `raw.forbid`."""
    close = fmt.mark(raw.close)
    end = regex_literal(raw.close)
    forbid = "|".join(regex_literal(f) for f in (*raw.forbid, fmt.end_text) if f)
    term = f"v_{tag.lower()}"  # a rule of one lexeme: [lazy] is a rule's attribute
    if "<[" not in close:
        # The close is text: one lexeme up to it, ended lazily at its first occurrence (and
        # never past it: a greedy value would swallow the close's first bytes).
        parts = [f"/{r}{end}/" for r in regexes] + [f"~/{n}{end}/" for n in raw.never]
        parts.append(f"~/(?s:.*{end}.+)/")
        if forbid:
            parts.append(f"~/(?s:.*({forbid}).*{end})/")
        return term, [f"{term}[lazy]: {' & '.join(parts)}"]
    # The close is a token: text that cannot hold it, nor its spelling in ordinary tokens.
    term = term.upper()
    parts = [f"/{r}/" for r in regexes] + [f"~/{n}/" for n in raw.never]
    parts += [f"~/(?s:.*({'|'.join(filter(None, [end, forbid]))}).*)/", "/(?s:.+)/"]
    empty = all(_empty_fits(r) for r in regexes) and not any(n in ("", "()") for n in raw.never)
    return f"{term}{'?' if empty else ''} {close}", [f"{term}: {' & '.join(parts)}"]


def _empty_fits(regex: str) -> bool:
    import re

    try:
        return re.fullmatch(regex, "") is not None
    except re.error:
        return False


def _fits(value: str, raw: RawText) -> bool:
    import re

    return (not raw.strip or value == value.strip()) and raw.close not in value and \
        not any(f in value for f in raw.forbid) and not any(re.fullmatch(n, value) for n in raw.never) and \
        all(re.fullmatch(r, value) for r in raw.shape)


def pattern_regex(where: str, pattern: Any) -> str:
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


def properties_of(name: str, params: Dict[str, Any], parser: str) -> Optional[Dict[str, Any]]:
    """The tool's parameters' properties (None for a tool that takes any arguments: no
    properties, not strict); GrammarError when they are not an object's."""
    properties = params.get("properties")
    if params.get("type", "object") != "object" or (properties is not None and not isinstance(properties, dict)):
        raise GrammarError(f"tool {name!r}: {parser} calls need parameters of type object with 'properties'")
    if not properties:
        if params.get("required"):
            raise GrammarError(f"tool {name!r}: its 'required' names keys it has no 'properties' for")
        return None
    return properties


def sequence(required: List[str], optional: List[str], sep: str) -> str:
    """Lark: every one of `required` in order, each of `optional` or not after them, `sep`
    (an expression) between any two written."""
    if required:
        return f" {sep} ".join(required) + "".join(f" ({sep} {item})?" for item in optional)
    if not optional:
        return ""
    # The first optional one written starts it; each after it may follow.
    firsts = [" ".join([item] + [f"({sep} {later})?" for later in optional[i + 1:]])
              for i, item in enumerate(optional)]
    return "(" + " | ".join(firsts) + ")?"


def keyed_sequence(items: Dict[str, str], params: Dict[str, Any], sep: str) -> str:
    """Lark: the item of every required key of `params` (a parameters' or object's schema),
    in the order of `items` (its properties'), then each optional one's or not (sequence)."""
    required = set(params.get("required") or [])
    missing = sorted(required - set(items))
    if missing:
        raise GrammarError(f"'required' names {missing}, which are not in 'properties'")
    return sequence([item for key, item in items.items() if key in required],
                    [item for key, item in items.items() if key not in required], sep)


def resolved(schema: Any, root: Dict[str, Any]) -> Any:
    """`schema`, a local `$ref` (to the parameters' `$defs` or `definitions`) followed, the
    root's definitions kept beside it so that JSON of it still finds its own references."""
    for _ in range(16):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str):
            break
        section, _, name = ref.removeprefix("#/").partition("/")
        target = (root.get(section) or {}).get(name) if section in ("$defs", "definitions") else None
        if not isinstance(target, dict):
            raise GrammarError(f"its $ref {ref!r} names no schema under the parameters' $defs")
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    if isinstance(schema, dict):
        for section in ("$defs", "definitions"):
            if section in root and section not in schema:
                schema = {**schema, section: root[section]}
    return schema
