"""Structured output through `ds4tp serve` (JSON Schema, JSON mode, strict tool calls), with the
official openai client, against mlx_lm.server on the same model.

The model has random weights (its unconstrained output is noise) and a Qwen-style template
whose tool calls are json_tools' JSON. Twenty pydantic models (nested objects, enums, booleans,
bounded integers, arrays and strings) go through `chat.completions.parse`, four at a time, and
all parse and validate; JSON mode gives a JSON object; a strict tool's arguments validate; the
Responses API's `parse` too. mlx_lm.server accepts the same requests and ignores the schema, so
its answers do not validate. Constrained and unconstrained sessions decoding in one batch get,
token for token, what each gets alone (greedy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import List, Literal, Optional

import pytest

openai = pytest.importorskip("openai", reason="the openai package (pip install openai)")
pytest.importorskip("llguidance", reason="the llguidance package (pip install llguidance)")

import pydantic  # noqa: E402
from openai.lib._pydantic import to_strict_json_schema  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from typing_extensions import Annotated  # noqa: E402

import scripted_model  # noqa: E402
from pairutil import free_port  # noqa: E402
from serveutil import ServedPair, client, post_raw  # noqa: E402

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 160
Short = Annotated[str, Field(max_length=8)]


class Address(BaseModel):
    city: Short
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: Annotated[int, Field(ge=0, le=30)]


# The fields the twenty models are made of: each model takes a different run of them.
FIELDS = {
    "name": (Short, ...),
    "active": (bool, ...),
    "role": (Literal["admin", "user", "guest"], ...),
    "age": (Annotated[int, Field(ge=0, le=120)], ...),
    "tags": (Annotated[List[Short], Field(max_length=3)], ...),
    "address": (Address, ...),
    "pets": (Annotated[List[Pet], Field(max_length=2)], ...),
    "nickname": (Optional[Short], ...),
    "verified": (bool, ...),
    "level": (Literal["low", "mid", "high"], ...),
}


def _models() -> list:
    names = list(FIELDS)
    out = []
    for i in range(20):
        picked = [names[(i + j) % len(names)] for j in range(1 + i % 5)] + ([names[i % 3 + 5]] if i >= 10 else [])
        fields = {n: FIELDS[n] for n in dict.fromkeys(picked)}
        out.append(pydantic.create_model(f"Answer{i}", **fields))
    return out


MODELS = _models()


class Weather(BaseModel):
    city: Short
    unit: Literal["celsius", "fahrenheit"]
    days: Annotated[int, Field(ge=1, le=7)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny llama with random weights and the tool-calling template."""
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    path = save_llama(tmp_path_factory.mktemp("structured") / "llama", "tiny", seed=5)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = scripted_model.TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    served = ServedPair(model_dir, tmp_path_factory.mktemp("structured-logs"))
    try:
        served.wait_healthy()
        yield served
    finally:
        served.close()


# ---------------------------------------------------------------------------------------------
# The grammar and the sampler on their own
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(model_dir):
    from mlx_lm.utils import load_tokenizer

    from mlx_ds4tp.lockstep.sampling.grammar import Grammars

    return Grammars(load_tokenizer(model_dir))


def test_grammars_are_cached_and_refused_keywords_named(grammars):
    from mlx_ds4tp.lockstep.errors import GrammarError
    from mlx_ds4tp.lockstep.sampling.grammar import json_schema_grammar

    grammar = json_schema_grammar(to_strict_json_schema(MODELS[19]))
    assert grammars.compile(grammar) > 0.0
    assert grammars.compile(grammar) == 0.0  # the second time, from the cache
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammars.compile(json_schema_grammar({"type": "array", "uniqueItems": True}))


def test_masked_draws_follow_the_schema_with_penalties_and_logprobs(grammars):
    """A seeded, penalised sampler with logprobs, drawing from random logits: its text validates,
    and the log-probabilities it reports give the disallowed tokens nothing. Its SAMPLER frame
    carries the grammar to the other rank, whose sampler draws the same tokens."""
    import mlx.core as mx
    import numpy as np

    from mlx_ds4tp.lockstep.protocol.commands import Sampler
    from mlx_ds4tp.lockstep.sampling.grammar import json_schema_grammar
    from mlx_ds4tp.lockstep.sampling.options import SamplingOptions
    from mlx_ds4tp.lockstep.sampling.row_sampling import RowSampler

    options = SamplingOptions(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=7,
                              grammar=json_schema_grammar(to_strict_json_schema(MODELS[11])))
    _, options_there, context, seed = Sampler.unpack(Sampler.pack(1, options, [5, 6], 7))
    assert options_there == options
    vocab = 512
    here = RowSampler(options, [5, 6], 7, vocab, keep_logprobs=True, grammar=grammars.row(options.grammar, vocab))
    there = RowSampler(options_there, context, seed, vocab, grammar=grammars.row(options.grammar, vocab))
    rng = np.random.default_rng(0)
    tokens, eos = [], 1
    for _ in range(400):
        logits = mx.array(rng.normal(size=(1, vocab)).astype(np.float32) * 4)
        token = here.draw(logits)
        assert there.draw(logits).item() == token.item()
        assert bool(mx.isinf(here.last_logprobs).any())  # the mask at work
        if token.item() == eos:
            break
        tokens.append(token.item())
    else:
        pytest.fail("the grammar never let the row end")
    MODELS[11].model_validate_json(grammars._hf.decode(tokens))


def _schema_format(model) -> dict:
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": to_strict_json_schema(model),
                                                   "strict": True}}


def test_constrained_and_plain_rows_in_one_batch_decode_as_alone(pair):
    """Greedy: each session's tokens in a mixed batch are those it decodes alone."""
    c = client(pair)
    requests = [dict(response_format=_schema_format(MODELS[3])), dict(),
                dict(response_format=_schema_format(MODELS[16])), dict()]

    def ask(extra: dict) -> tuple:
        r = c.chat.completions.create(model=pair_model(pair), messages=ASK, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=True, **extra)
        return r.choices[0].message.content, [t.token for t in r.choices[0].logprobs.content]

    alone = [ask(extra) for extra in requests]
    assert pair.health()[1]["decode_batch_rows"] == 1
    start = threading.Barrier(len(requests))

    def together(extra: dict) -> tuple:
        start.wait(10)
        return ask(extra)

    with ThreadPoolExecutor(len(requests)) as pool:
        batched = list(pool.map(together, requests))
    assert pair.health()[1]["decode_batch_rows"] >= 2, "the sessions never shared a decode step"
    assert batched == alone
    MODELS[3].model_validate_json(alone[0][0])
    MODELS[16].model_validate_json(alone[2][0])
    with pytest.raises(ValueError):
        json.loads(alone[1][0])  # the unconstrained answer is the random model's noise


def pair_model(pair) -> str:
    return client(pair).models.list().data[0].id


def test_twenty_pydantic_models_parse_four_at_a_time(pair):
    c, model = client(pair), pair_model(pair)

    def parse(schema):
        r = c.chat.completions.parse(model=model, messages=ASK, response_format=schema, max_tokens=MAX_TOKENS,
                                     temperature=0.7, seed=11)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content.startswith("{") and " " not in r.choices[0].message.content.split('"')[0]
        return r.choices[0].message.parsed

    with ThreadPoolExecutor(4) as pool:
        parsed = list(pool.map(parse, MODELS))
    for schema, answer in zip(MODELS, parsed):
        assert isinstance(answer, schema)
        schema.model_validate(answer.model_dump())


def test_json_mode_strict_tools_and_responses(pair):
    c, model = client(pair), pair_model(pair)
    # JSON mode bounds no string: a seed whose draw closes the object within the budget.
    r = c.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                  max_tokens=MAX_TOKENS, temperature=1.0, seed=1)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict) and len(r.choices[0].message.content) > 2

    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    assert tool["function"]["strict"] is True
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(model=model, messages=ASK, tools=[tool], tool_choice=choice,
                                      max_tokens=MAX_TOKENS)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        Weather.model_validate_json(call.function.arguments)

    answer = c.responses.parse(model=model, input="Describe a person.", text_format=MODELS[7],
                               max_output_tokens=MAX_TOKENS)
    assert isinstance(answer.output_parsed, MODELS[7])
    r = c.responses.create(model=model, input="Weather?", max_output_tokens=MAX_TOKENS, tool_choice="required",
                           tools=[{"type": "function", "name": "get_weather", "strict": True,
                                   "parameters": to_strict_json_schema(Weather)}])
    (call,) = [item for item in r.output if item.type == "function_call"]
    Weather.model_validate_json(call.arguments)


def test_bounds_length_and_refused_keywords(pair):
    model = pair_model(pair)
    r = client(pair).chat.completions.create(model=model, messages=ASK, max_tokens=3,
                                             response_format=_schema_format(MODELS[12]))
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.content) < 40
    body = {"model": model, "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}
    status, answer = post_raw(pair, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and "uniqueItems" in answer["error"]["message"], answer
    status, answer = post_raw(pair, "/v1/chat/completions", json.dumps(
        {**body, "response_format": {"type": "xml"}}).encode())
    assert status == 400 and answer["error"]["param"] == "response_format", answer


@pytest.fixture(scope="module")
def mlx_lm_server(model_dir, tmp_path_factory):
    """mlx_lm.server on the same model (127.0.0.1): it accepts response_format and ignores it."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("mlx-lm-server") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, open(log.name).read()
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=5):
                    break
            except OSError:
                time.sleep(0.3)
        else:
            pytest.fail("mlx_lm.server did not start within 90 s")
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        proc.kill()
        proc.wait(10)


def test_mlx_lm_server_answers_do_not_validate(mlx_lm_server, model_dir):
    """The same requests, to mlx_lm.server: its output ignores the schema, so none validates
    (what makes the tests above able to fail)."""
    model = str(model_dir)
    valid = 0
    for schema in MODELS:
        r = mlx_lm_server.chat.completions.create(model=model, messages=ASK, response_format=_schema_format(schema),
                                                  max_tokens=MAX_TOKENS, temperature=0.7, seed=11)
        try:
            schema.model_validate_json(r.choices[0].message.content)
            valid += 1
        except pydantic.ValidationError:
            pass
    assert valid == 0
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    r = mlx_lm_server.chat.completions.create(model=model, messages=ASK, tools=[tool], max_tokens=MAX_TOKENS)
    assert not r.choices[0].message.tool_calls
