"""Tool calls and reasoning through `ds4tp serve`, against mlx_lm.server on the same model.

The model's output is scripted (tests/scripted_model.py): thinking, then one tool call in the
json_tools format its Qwen-style template names. The official openai client gets the call parsed
(whole and streamed, finish_reason "tool_calls") and the thinking apart from the answer; the
follow-up turn carrying the tool's result renders into exactly the prompt mlx_lm.server renders
(same prompt_tokens), and both servers return the same call and reasoning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the openai package (pip install openai)")

import scripted_model  # noqa: E402
from pairutil import free_port  # noqa: E402
from serveutil import API_KEY, ServedPair, anthropic_client, client  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return scripted_model.build(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    served = ServedPair(model_dir, tmp_path_factory.mktemp("tools-logs"))
    try:
        served.wait_healthy()
        yield served
    finally:
        served.close()


@pytest.fixture(scope="module")
def mlx_lm_server(model_dir, tmp_path_factory):
    """mlx_lm.server on the same model (127.0.0.1), as the reference."""
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


def _call(tool_call) -> tuple:
    return tool_call.function.name, json.loads(tool_call.function.arguments)


def test_a_tool_call_comes_back_parsed_with_the_reasoning_apart(pair):
    r = client(pair).chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=20,
                                             temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [_call(c) for c in choice.message.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert choice.message.tool_calls[0].type == "function" and choice.message.tool_calls[0].id
    assert choice.message.content == ""
    extra = choice.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == "The user wants the weather."


def test_a_streamed_tool_call_arrives_as_deltas(pair):
    chunks = list(client(pair).chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                                       max_tokens=20, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    reasoning = "".join((d.model_extra or {}).get("reasoning", "") or "" for d in deltas)
    assert reasoning == "The user wants the weather."
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_hides_the_tools_and_forcing_a_call_constrains_it(pair, mlx_lm_server):
    c = client(pair)
    hidden = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=2, temperature=0)
    plain = c.chat.completions.create(model="scripted", messages=ASK, max_tokens=2, temperature=0)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    # A forced call is a grammar (serve.structured; tests/test_structured.py): the answer opens
    # with the call marker, whatever the script says first.
    forced = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=1, temperature=0, logprobs=True)
    assert [t.token for t in forced.choices[0].logprobs.content] == ["<tool_call>"]
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=1,
                                  tool_choice={"type": "function", "function": {"name": "no_such_tool"}})


def test_the_follow_up_renders_as_mlx_lm_server_renders_it(pair, mlx_lm_server):
    ours, theirs = client(pair), mlx_lm_server
    first = [s.chat.completions.create(model="scripted" if s is ours else "default_model", messages=ASK,
                                       tools=TOOLS, max_tokens=20, temperature=0) for s in (ours, theirs)]
    assert first[0].usage.prompt_tokens == first[1].usage.prompt_tokens
    assert [_call(c) for c in first[0].choices[0].message.tool_calls] == \
        [_call(c) for c in first[1].choices[0].message.tool_calls]
    call = first[0].choices[0].message.tool_calls[0]
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})},
    ]
    again = [s.chat.completions.create(model="scripted" if s is ours else "default_model", messages=follow,
                                       tools=TOOLS, max_tokens=20, temperature=0) for s in (ours, theirs)]
    assert again[0].usage.prompt_tokens == again[1].usage.prompt_tokens > first[0].usage.prompt_tokens
    assert again[0].choices[0].finish_reason == again[1].choices[0].finish_reason == "tool_calls"


def test_tools_for_a_model_without_a_tool_format_are_refused(tmp_path):
    from serveutil import build_chat_model, post_raw

    served = ServedPair(build_chat_model(tmp_path), tmp_path)
    try:
        served.wait_healthy()
        code, answer = post_raw(served, "/v1/chat/completions", json.dumps(
            {"messages": ASK, "tools": TOOLS, "max_tokens": 2}).encode(), api_key=API_KEY)
        assert code == 400 and answer["error"]["param"] == "tools"
        assert "no tool-call format" in answer["error"]["message"]
    finally:
        served.close()


def test_messages_api_returns_the_thinking_and_the_tool_use(pair):
    pytest.importorskip("anthropic", reason="the anthropic package (pip install anthropic)")
    ac = anthropic_client(pair)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = ac.messages.create(model="scripted", max_tokens=20, messages=ASK, tools=tools)
    assert [b.type for b in r.content] == ["thinking", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].thinking == "The user wants the weather."
    use = r.content[1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    with ac.messages.stream(model="scripted", max_tokens=20, messages=ASK, tools=tools) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    assert (final.content[1].name, final.content[1].input) == ("get_weather", {"city": "Paris"})
    # The result goes back as a tool_result block: the same prompt as chat completions' tool turn.
    follow = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                       "input": use.input}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": json.dumps({"temperature_c": 18})}]}]
    counted = ac.messages.count_tokens(model="scripted", messages=follow, tools=tools)
    chat = client(pair).chat.completions.create(model="scripted", tools=TOOLS, max_tokens=1, temperature=0,
                                                messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": json.dumps({"temperature_c": 18})}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_responses_api_returns_the_function_call(pair):
    c = client(pair)
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    r = c.responses.create(model="scripted", input=ASK[0]["content"], tools=tools, max_output_tokens=20)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "function_call"]
    call = r.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    events = list(c.responses.create(model="scripted", input=ASK[0]["content"], tools=tools,
                                     max_output_tokens=20, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning", "function_call"] and events[-1].type == "response.completed"
    # The call's output goes back as a function_call_output item after the previous response.
    follow = c.responses.create(model="scripted", previous_response_id=r.id, tools=tools, max_output_tokens=20,
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": json.dumps({"temperature_c": 18})}])
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_langchain_bind_tools_gets_the_call_whole_streamed_and_over_responses(pair):
    pytest.importorskip("langchain_openai", reason="the langchain-openai package (pip install langchain-openai)")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city"""
        return "sunny"

    def llm(**extra):
        return ChatOpenAI(base_url=pair.base + "/v1", api_key=API_KEY, model="scripted", max_tokens=20,
                          max_retries=0, **extra).bind_tools([get_weather])

    want = [("get_weather", {"city": "Paris"})]
    whole = llm().invoke(ASK[0]["content"])
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == want
    chunks = list(llm().stream(ASK[0]["content"]))
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == want
    over_responses = llm(use_responses_api=True).invoke(ASK[0]["content"])
    assert [(c["name"], c["args"]) for c in over_responses.tool_calls] == want


def _raw_chat(base: str, body: dict, key: str = API_KEY) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_logprobs_and_logit_bias_equal_mlx_lm_servers(pair, mlx_lm_server):
    theirs_base = str(mlx_lm_server.base_url).rstrip("/").removesuffix("/v1")
    body = {"messages": ASK, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    ours = _raw_chat(pair.base, {**body, "model": "scripted"})
    theirs = _raw_chat(theirs_base, body)
    mine = ours["choices"][0]["logprobs"]["content"]
    other = theirs["choices"][0]["logprobs"]["content"]
    assert len(mine) == len(other) > 0
    for a, b in zip(mine, other):
        assert abs(a["logprob"] - b["logprob"]) <= 1e-4
        assert [t["logprob"] for t in a["top_logprobs"]] == pytest.approx(
            sorted((t["logprob"] for t in b["top_logprobs"]), reverse=True), abs=1e-4)
    # A bias that forbids the script's first token changes the answer, alike on both servers.
    first = scripted_model.token_id(scripted_model.SCRIPT[0])
    biased = {"messages": ASK, "max_tokens": 6, "temperature": 0, "logit_bias": {str(first): -100}}
    got = _raw_chat(pair.base, {**biased, "model": "scripted"})["choices"][0]["message"]
    want = _raw_chat(theirs_base, biased)["choices"][0]["message"]
    assert got["content"] == want["content"] and (got.get("reasoning") or "") == (want.get("reasoning") or "")
    assert got != ours["choices"][0]["message"]
