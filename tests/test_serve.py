"""`ds4tp serve` end to end: two real processes, driven with the official openai client."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the openai package (pip install openai)")

from serveutil import (  # noqa: E402
    API_KEY,
    ServedPair,
    anthropic_client,
    build_chat_model,
    chat_ids,
    client,
    get_raw,
    open_stream,
    post_raw,
    reference,
    text_ids,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    # Every 3rd decode step the ranks compare their logits: a drift fails the test loudly.
    served = ServedPair(model_dir, tmp_path_factory.mktemp("serve-logs"), extra=["--debug-hash", "3"])
    try:
        served.wait_healthy()
        yield served
    finally:
        served.close()


def test_models_and_health(pair, model_dir):
    models = client(pair).models.list()
    # The served id is short (the directory's own name); the path --model gave is accepted too.
    assert [m.id for m in models.data] == [model_dir.name]
    assert get_raw(pair, "/v1/models/" + model_dir.name)[0] == 200
    assert get_raw(pair, "/v1/models/" + str(model_dir))[0] == 200
    assert get_raw(pair, "/v1/models/nope")[0] == 404
    code, body = pair.health()
    assert code == 200 and body["status"] == "ok"
    # No --max-kv-tokens: the budget is what this machine's memory holds, as the log says.
    import re

    # The last figure logged: the leader's own, or the worker's where its machine holds fewer.
    logged = re.findall(r"KV budget (\d+) tokens", pair.log("leader"))
    assert logged and body["kv_budget_tokens"] == int(logged[-1]) > 0, body


def test_model_demo_is_served_as_demo_on_both_ranks(tmp_path, monkeypatch):
    # The README's loopback recipe: `ds4tp serve --model demo` on both ranks, a client asking
    # for model "demo" (or none, or the built directory), any other name a 404.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    served = ServedPair("demo", tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
                        api_key=None)
    try:
        served.wait_healthy()
        from mlx_ds4tp.synthetic.demo_model import demo_model_dir

        built = demo_model_dir()  # the ranks built it under the lock; found, not rebuilt
        c = client(served, api_key="unused")
        assert [m.id for m in c.models.list().data] == ["demo"]
        want = reference(built, text_ids(built, "Hello"), 6)
        for name in ("demo", str(built)):
            r = c.completions.create(model=name, prompt="Hello", max_tokens=6)
            assert r.choices[0].text == want and r.model == name
        code, answer = post_raw(served, "/v1/completions",
                                json.dumps({"prompt": "Hello", "max_tokens": 6}).encode())
        assert code == 200 and answer["choices"][0]["text"] == want and answer["model"] == "demo"
        with pytest.raises(openai.NotFoundError, match="this server serves 'demo'"):
            c.completions.create(model="demo-llama", prompt="Hello", max_tokens=2)
        assert "serving demo (" in served.log("leader")
    finally:
        served.close()


def test_served_model_name_is_the_id_listed_and_asked_for(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, extra=["--served-model-name", "tiny-chat"])
    try:
        served.wait_healthy()
        c = client(served)
        assert [m.id for m in c.models.list().data] == ["tiny-chat"]
        want = reference(model_dir, text_ids(model_dir, "name"), 4)
        for name in ("tiny-chat", str(model_dir)):
            assert c.completions.create(model=name, prompt="name", max_tokens=4).choices[0].text == want
        with pytest.raises(openai.NotFoundError):  # the default id is not served under a given name
            c.completions.create(model=model_dir.name, prompt="name", max_tokens=2)
        assert get_raw(served, "/v1/models/tiny-chat")[0] == 200
    finally:
        served.close()


def test_chat_greedy_equals_mlx_lm(pair, model_dir):
    messages = [{"role": "user", "content": "tell me about two machines"}]
    want = reference(model_dir, chat_ids(model_dir, messages), 16)
    c = client(pair)
    r = c.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16,
                                  temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens == len(chat_ids(model_dir, messages))
    chunks = list(c.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 16


def test_completions_greedy_and_seeded_equal_mlx_lm(pair, model_dir):
    prompt = "the quick brown fox"
    ids = text_ids(model_dir, prompt)
    c = client(pair)
    r = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == reference(model_dir, ids, 12)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0, stream=True) if ch.choices)
    assert streamed == r.choices[0].text
    seeded = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0.9,
                                  top_p=0.95, seed=1234, extra_body={"top_k": 50})
    assert seeded.choices[0].text == reference(model_dir, ids, 12, temp=0.9, seed=1234, top_p=0.95,
                                               top_k=50)


def test_four_concurrent_clients_get_their_own_text(pair, model_dir):
    prompts = ["alpha beta gamma", "one two", "a much longer prompt about the sea and the sky",
               "zebra"]
    lengths = [20, 9, 14, 17]
    want = [reference(model_dir, text_ids(model_dir, p), n) for p, n in zip(prompts, lengths)]
    got = [None] * 4
    errors = []

    def ask(i):
        try:
            got[i] = client(pair).completions.create(model=str(model_dir), prompt=prompts[i],
                                                     max_tokens=lengths[i]).choices[0].text
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == want
    # Several sessions shared decode steps: fewer steps than tokens.
    assert pair.health()[1]["decode_steps"] < pair.health()[1]["generated_tokens"]


def test_concurrent_seeded_requests_each_draw_their_own_numbers(pair, model_dir):
    asks = [("red fish", dict(temperature=0.8, seed=1)), ("blue fish", dict(temperature=1.1, seed=2)),
            ("one fish", dict(temperature=0.7, seed=3, top_p=0.9))]
    want = [reference(model_dir, text_ids(model_dir, p), 10, temp=kw["temperature"], seed=kw["seed"],
                      top_p=kw.get("top_p", 0.0)) for p, kw in asks]
    got = [None] * len(asks)

    def ask(i):
        prompt, kw = asks[i]
        got[i] = client(pair).completions.create(model=str(model_dir), prompt=prompt, max_tokens=10,
                                                 **kw).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want


def test_second_turn_reuses_the_cache(pair, model_dir):
    c = client(pair)
    first = [{"role": "user", "content": "remember the number forty two please"}]
    r1 = c.chat.completions.create(model=str(model_dir), messages=first, max_tokens=6)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "what was it"}]
    before = pair.health()[1]["prefilled_tokens"]
    r2 = c.chat.completions.create(model=str(model_dir), messages=second, max_tokens=6)
    after = pair.health()[1]["prefilled_tokens"]
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    # Only the tokens past the reused prefix were computed.
    assert after - before == r2.usage.prompt_tokens - cached
    assert r2.choices[0].message.content == reference(model_dir, chat_ids(model_dir, second), 6)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"max_tokens": 4}).encode(), 400, "messages"),
    (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(), 400,
     "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), 400,
     "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}).encode(), 400,
     "stream"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}).encode(), 404,
     "model"),
])
def test_bad_chat_input_is_a_4xx_then_service_continues(pair, model_dir, body, status, param):
    code, answer = post_raw(pair, "/v1/chat/completions", body)
    assert code == status
    assert answer["error"]["param"] == param and answer["error"]["message"]
    prompt = "still here"
    r = client(pair).completions.create(model=str(model_dir), prompt=prompt, max_tokens=5)
    assert r.choices[0].text == reference(model_dir, text_ids(model_dir, prompt), 5)


def test_prompt_longer_than_context_token_past_the_vocabulary_and_wrong_key(pair, model_dir):
    code, answer = post_raw(pair, "/v1/completions", json.dumps(
        {"prompt": [5] * 5000, "max_tokens": 2}).encode())
    assert code == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["param"] == "prompt"
    code, answer = post_raw(pair, "/v1/completions", json.dumps(
        {"prompt": [5, 1 << 20], "max_tokens": 2}).encode())
    assert code == 400 and answer["error"]["param"] == "prompt" and "vocabulary" in answer["error"]["message"]
    assert pair.health()[0] == 200
    with pytest.raises(openai.AuthenticationError):
        client(pair, api_key="wrong").models.list()


def test_client_disconnect_mid_stream_frees_the_session(pair, model_dir):
    body = json.dumps({"prompt": "go on forever", "max_tokens": 2000, "stream": True}).encode()
    sock = open_stream(pair, body)
    sock.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = pair.health()[1]
        if health["decoding"] == 0 and health["prefilling"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.1)
    assert health["decoding"] == 0, health
    assert health["generated_tokens"] < 2000
    r = client(pair).completions.create(model=str(model_dir), prompt="after", max_tokens=4)
    assert r.choices[0].text == reference(model_dir, text_ids(model_dir, "after"), 4)


def test_concurrent_clients_over_the_emulated_rdma_device_then_idle_worker_death(model_dir, tmp_path):
    """The same batching over the emulated Thunderbolt device: a long prompt's prefill goes
    out as bulk rounds, the decode rows as gates. Then the worker dies while nothing runs."""
    served = ServedPair(model_dir, tmp_path, extra=["--transport", "rdma", "--rdma-device", "ucsim"])
    try:
        served.wait_healthy()
        prompts = ["short one", " ".join(["the long prompt goes on"] * 12)]
        want = [reference(model_dir, text_ids(model_dir, p), 8) for p in prompts]
        got = [None, None]

        def ask(i):
            got[i] = client(served).completions.create(model=str(model_dir), prompt=prompts[i],
                                                       max_tokens=8).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == want
        assert "transport rdma" in served.log("leader")
        # A worker that dies while the server is idle: /health stops answering 200 at once.
        served.kill("worker")
        deadline = time.monotonic() + 5
        while served.health()[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        code, body = served.health()
        assert code == 503 and "rank 1" in body["error"], body
        code, answer = post_raw(served, "/v1/completions", json.dumps({"prompt": "x"}).encode())
        assert code == 503 and answer["error"]["code"] == "pair_unavailable"
    finally:
        served.close()


def test_client_gone_without_streaming_frees_the_session(pair, model_dir):
    body = json.dumps({"prompt": "talk a lot", "max_tokens": 3000}).encode()
    before = pair.health()[1]["generated_tokens"]
    sock = socket.create_connection(("127.0.0.1", pair.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while pair.health()[1]["decoding"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close()
    while time.monotonic() < deadline:
        health = pair.health()[1]
        if health["decoding"] == 0:
            break
        time.sleep(0.1)
    assert health["decoding"] == 0, health
    assert health["generated_tokens"] - before < 3000


def test_worker_killed_fails_requests_within_the_gate_timeout(model_dir, tmp_path):
    timeout = 8
    served = ServedPair(model_dir, tmp_path, env={"DS4_TP_TIMEOUT_SEC": str(timeout)})
    try:
        served.wait_healthy()
        c = client(served, timeout=120)
        stream = c.completions.create(model=str(model_dir), prompt="long", max_tokens=100000,
                                      stream=True)
        next(iter(stream))
        served.kill("worker")
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="group of machines is down"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < timeout
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model=str(model_dir), prompt="again", max_tokens=3)
        assert info.value.status_code == 503
        assert served.health()[0] == 503
        assert served.procs["leader"].poll() is None
    finally:
        served.close()


def test_bench_serve_prints_each_client_count(pair, capsys):
    from mlx_ds4tp.cli import main

    assert main(["bench", "--serve", "--url", pair.base, "--api-key", API_KEY, "--max-tokens", "4",
                 "--rounds", "1", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    *counts, constrained = records
    assert [r["clients"] for r in counts] == [1, 2, 4, 8]
    for r in counts:
        assert 0 < r["tokens"] <= 4 * r["clients"] and r["tok_s"] > 0 and r["ttft_p50_ms"] > 0
    # Structured output's figures (bench/structured.py): constrained against plain decode.
    assert constrained["name"] == "serve-json" and constrained["constrained_decode_tok_s"] > 0
    assert constrained["constrained_over_plain"] > 0


def test_run_takes_the_same_sampling_options(model_dir, tmp_path, procs):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from pairutil import free_port
    from serveutil import _load

    port, out = free_port(), tmp_path / "tokens.json"
    # `ds4tp run`'s rank as the local pair spawns it (it can write the tokens record).
    common = ["-m", "mlx_ds4tp.cli.rank", "run", "--model", str(model_dir), "--transport", "tcp",
              "--max-tokens", "12", "--temp", "0.9", "--top-k", "40", "--seed", "11"]
    leader = procs.spawn(common + ["--prompt", "hello", "--tokens-out", str(out), "--role", "leader",
                                   "--listen", "127.0.0.1", str(port)])
    worker = procs.spawn(common + ["--role", "worker", "--coordinator", "127.0.0.1", str(port)])
    assert leader.wait(120) == 0 and worker.wait(60) == 0, leader.stderr.read()
    record = json.loads(out.read_text())
    assert record["prompt_tokens"] == chat_ids(model_dir, [{"role": "user", "content": "hello"}])
    model, tokenizer = _load(model_dir)
    mx.random.seed(11)
    want = []
    for token, _ in generate_step(mx.array(record["prompt_tokens"]), model, max_tokens=12,
                                  sampler=make_sampler(0.9, top_k=40)):
        want.append(token)
        if token in tokenizer.eos_token_ids:
            break
    assert record["tokens"] == want
    bad = procs.spawn(["-m", "mlx_ds4tp", "run", "--model", "nobody/no-such-model", "--prompt", "x",
                       "--role", "leader", "--listen", "127.0.0.1", str(free_port())],
                      env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    _, err = bad.communicate(timeout=60)
    assert bad.returncode != 0 and "nobody/no-such-model" in err and "download" in err



# ---------------------------------------------------------------------------------------------
# HTTP details browsers and keep-alive clients rely on
# ---------------------------------------------------------------------------------------------


def test_cors_preflight_allows_the_headers_a_browser_sdk_asks_for(pair):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", pair.port, timeout=10)
    asked = "x-stainless-os, x-stainless-lang, content-type, authorization"
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked})
    r = conn.getresponse()
    r.read()
    allowed = {h.strip().lower() for h in r.getheader("Access-Control-Allow-Headers").split(",")}
    assert r.status == 204 and r.getheader("Access-Control-Allow-Origin") == "*"
    assert {"x-stainless-os", "x-stainless-lang", "content-type", "authorization"} <= allowed
    # Without a list asked for: everything, Authorization named (a "*" does not cover it).
    conn.request("OPTIONS", "/v1/models")
    r = conn.getresponse()
    r.read()
    assert {"*", "authorization"} <= {h.strip().lower() for h in r.getheader("Access-Control-Allow-Headers").split(",")}
    conn.close()


def test_a_response_that_closes_the_connection_says_so(pair, model_dir):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", pair.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=b"{not json",
                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    assert r.status == 400 and r.getheader("Connection") == "close"
    conn.close()
    # A 404 for a model id with a "/" in it (as the SDK sends it, %2F) is found once decoded.
    assert get_raw(pair, "/v1/models/" + str(model_dir).replace("/", "%2F"))[0] == 200
    code, _ = get_raw(pair, "/v1/models/no%2Fsuch")
    assert code == 404


def test_a_stream_that_has_not_started_sends_keep_alive_comments(model_dir, tmp_path):
    import http.client

    served = ServedPair(model_dir, tmp_path, extra=["--keepalive-sec", "0.001"])
    try:
        served.wait_healthy()
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
        body = json.dumps({"prompt": [5] * 1500, "max_tokens": 2, "stream": True})
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        r = conn.getresponse()
        lines = [ln for ln in r.read().decode().split("\n") if ln]
        conn.close()
        assert r.status == 200
        # The 1500-token prefill takes far longer than 1 ms: comments come before the first data.
        assert lines[0] == ": keep-alive", lines[:3]
        data = [ln for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and all(ln.startswith((": keep-alive", "data: ")) for ln in lines)
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in data[:-1])
        assert text == reference(model_dir, [5] * 1500, 2)
    finally:
        served.close()


# ---------------------------------------------------------------------------------------------
# Penalties, logit_bias and logprobs, as mlx-lm computes them; every request field acted on or refused
# ---------------------------------------------------------------------------------------------


def _text(model_dir, tokens):
    from serveutil import _load

    return _load(model_dir)[1].decode([t for t in tokens if t not in _load(model_dir)[1].eos_token_ids])


def test_penalties_and_logit_bias_change_the_output_as_mlx_lm_does(pair, model_dir):
    from serveutil import reference_steps

    prompt = "the quick brown fox"
    ids = text_ids(model_dir, prompt)
    plain = [t for t, _ in reference_steps(model_dir, ids, 12)]
    favoured = plain[1]
    settings = {"presence_penalty": 1.5, "frequency_penalty": 0.8, "logit_bias": {str(favoured): 6.0}}
    want = [t for t, _ in reference_steps(model_dir, ids, 12, presence_penalty=1.5, frequency_penalty=0.8,
                                          logit_bias={favoured: 6.0})]
    assert want != plain  # the processors do change this model's output
    r = client(pair).completions.create(model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0,
                                        **{k: v for k, v in settings.items() if k != "logit_bias"},
                                        logit_bias=settings["logit_bias"])
    assert r.choices[0].text == _text(model_dir, want)


def test_chat_logprobs_equal_mlx_lms_whole_and_streamed(pair, model_dir):
    import numpy as np

    from serveutil import reference_steps

    messages = [{"role": "user", "content": "count the stars"}]
    steps = reference_steps(model_dir, chat_ids(model_dir, messages), 8)
    c = client(pair)
    r = c.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=3)
    whole = r.choices[0].logprobs.content
    chunks = list(c.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [item for ch in chunks if ch.choices and ch.choices[0].logprobs
                for item in ch.choices[0].logprobs.content]
    for got in (whole, streamed):
        assert len(got) == len(steps)
        for item, (token, logprobs) in zip(got, steps):
            want = np.array(logprobs)
            assert abs(item.logprob - float(want[token])) <= 1e-4
            top = np.argsort(-want)[:3]
            listed = [t.logprob for t in item.top_logprobs]
            assert listed == sorted(listed, reverse=True)
            assert all(abs(t.logprob - float(want[i])) <= 1e-4 for t, i in zip(item.top_logprobs, top))
            assert item.bytes == list(item.token.encode())
    # Without logprobs asked for, none come back.
    plain = c.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_equal_mlx_lms(pair, model_dir):
    import numpy as np

    from serveutil import reference_steps

    prompt = "one two three"
    steps = reference_steps(model_dir, text_ids(model_dir, prompt), 6)
    r = client(pair).completions.create(model=str(model_dir), prompt=prompt, max_tokens=6, temperature=0,
                                        logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(steps) and lp.text_offset[0] == 0
    for got, top, (token, logprobs) in zip(lp.token_logprobs, lp.top_logprobs, steps):
        assert abs(got - float(np.array(logprobs)[token])) <= 1e-4
        assert len(top) <= 2
    assert "".join(lp.tokens) == r.choices[0].text


# A value for every field of the openai package's request types: acted on (200) or refused
# with a 400 naming the field; a field the SDK adds later fails the first assertion.
_CHAT_FIELDS = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5,
    "function_call": "auto", "functions": [{"name": "f", "parameters": {}}], "logit_bias": {"5": 1.0},
    "logprobs": True, "max_completion_tokens": 2, "max_tokens": 2, "messages": None, "metadata": {"a": "b"},
    "modalities": ["text", "audio"], "model": None, "moderation": {"type": "auto"}, "n": 2,
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"},
    "presence_penalty": 0.5, "prompt_cache_key": "k", "prompt_cache_options": {"x": 1},
    "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "u1", "seed": 3,
    "service_tier": "auto", "stop": ["zz"], "store": True, "stream_options": {"include_usage": True},
    "temperature": 0.0, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "top_logprobs": 2,
    "top_p": 0.9, "user": "u1", "verbosity": "low", "web_search_options": {},
}
_TEXT_FIELDS = {
    "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}, "logprobs": 2,
    "max_tokens": 2, "model": None, "n": 2, "presence_penalty": 0.5, "prompt": None, "seed": 3,
    "stop": ["zz"], "stream_options": {"include_usage": True}, "suffix": "tail", "temperature": 0.0,
    "top_p": 0.9, "user": "u1",
}


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_every_request_field_is_acted_on_or_refused_naming_it(pair, kind):
    from openai.types import completion_create_params as text_params
    from openai.types.chat import completion_create_params as chat_params

    shape = (chat_params if kind == "chat" else text_params).CompletionCreateParamsBase
    samples = _CHAT_FIELDS if kind == "chat" else _TEXT_FIELDS
    assert set(shape.__annotations__) <= set(samples), set(shape.__annotations__) - set(samples)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    base = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
    base["max_tokens"] = 2
    outcome = {}
    for field, value in samples.items():
        if value is None:
            continue
        body = {**base, field: value}
        if field == "top_logprobs":
            body["logprobs"] = True
        code, answer = post_raw(pair, path, json.dumps(body).encode())
        if code == 200:
            outcome[field] = "acted"
        else:
            assert code == 400 and answer["error"]["param"] == field, (field, code, answer)
            assert field in answer["error"]["message"]
            outcome[field] = "refused"
    acted = {f for f, o in outcome.items() if o == "acted"}
    assert {"frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "seed", "stop"} <= acted
    assert outcome["n"] == "refused"
    assert kind == "text" or {outcome[f] for f in ("audio", "tools")} == {"refused"}
    assert kind == "text" or outcome["response_format"] == "acted"  # structured output (test_structured.py)
    # An unknown field is refused too, naming it.
    code, answer = post_raw(pair, path, json.dumps({**base, "temprature": 0.5}).encode())
    assert code == 400 and answer["error"]["param"] == "temprature"


# ---------------------------------------------------------------------------------------------
# Anthropic's Messages API: the same sessions, the same text
# ---------------------------------------------------------------------------------------------


def _anthropic_client(pair):
    pytest.importorskip("anthropic", reason="the anthropic package (pip install anthropic)")
    return anthropic_client(pair)


def test_messages_answer_as_chat_completions_do(pair, model_dir):
    ac = _anthropic_client(pair)
    system, question = "be brief", "tell me about two machines"
    chat = client(pair).chat.completions.create(
        model=model_dir.name, messages=[{"role": "system", "content": system},
                                        {"role": "user", "content": question}],
        max_tokens=12, temperature=0)
    r = ac.messages.create(model=model_dir.name, system=system, max_tokens=12,
                           messages=[{"role": "user", "content": [{"type": "text", "text": question}]}])
    assert r.type == "message" and r.role == "assistant"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == chat.choices[0].message.content
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 12
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    with ac.messages.stream(model=model_dir.name, system=system, max_tokens=12,
                            messages=[{"role": "user", "content": question}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == chat.choices[0].message.content and final.stop_reason == "max_tokens"
    counted = ac.messages.count_tokens(model=model_dir.name, system=system,
                                       messages=[{"role": "user", "content": question}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_messages_refuse_what_they_cannot_do_in_anthropics_error_shape(pair, model_dir):
    import anthropic

    ac = _anthropic_client(pair)
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        ac.messages.create(model=model_dir.name, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                           thinking={"type": "enabled", "budget_tokens": 1024})
    code, answer = post_raw(pair, "/v1/messages", json.dumps(
        {"model": model_dir.name, "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert code == 400 and answer["type"] == "error" and "max_tokens" in answer["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(pair, api_key="wrong").messages.create(
            model=model_dir.name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------
# OpenAI's Responses API: the same sessions, the same text, previous_response_id
# ---------------------------------------------------------------------------------------------


def test_responses_answer_as_chat_completions_do(pair, model_dir):
    c = client(pair)
    question = "tell me about two machines"
    chat = c.chat.completions.create(model=model_dir.name, max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": question}])
    r = c.responses.create(model=model_dir.name, instructions="be brief", input=question,
                           max_output_tokens=10, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 10
    events = list(c.responses.create(model=model_dir.name, instructions="be brief", input=question,
                                     max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_previous_response_id_continues_the_conversation(pair, model_dir):
    c = client(pair)
    first = c.responses.create(model=model_dir.name, input="hello there", max_output_tokens=6, temperature=0)
    second = c.responses.create(model=model_dir.name, input="and again", previous_response_id=first.id,
                                max_output_tokens=6, temperature=0)
    chat = c.chat.completions.create(model=model_dir.name, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and again"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # The first turn's prefix came from the prompt cache.
    assert second.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        c.responses.create(model=model_dir.name, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        c.responses.create(model=model_dir.name, input="x", reasoning={"effort": "high"}, max_output_tokens=2)


def test_metrics_in_the_prometheus_format_count_what_was_served(pair, model_dir):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        import urllib.request

        req = urllib.request.Request(pair.base + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    c = client(pair)
    r = c.completions.create(model=model_dir.name, prompt="count me", max_tokens=5, temperature=0)
    list(c.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "again"}],
                                   max_tokens=4, temperature=0, stream=True))
    post_raw(pair, "/v1/completions", b"{not json")
    after = scrape()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("ds4tp_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("ds4tp_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("ds4tp_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("ds4tp_completion_tokens_total") == r.usage.completion_tokens + 4
    assert delta("ds4tp_prompt_tokens_total") >= r.usage.prompt_tokens
    assert delta("ds4tp_time_to_first_token_seconds_count") == 2
    assert after[("ds4tp_pair_up", ())] == 1.0 and after[("ds4tp_sessions_decoding", ())] == 0
    assert after[("ds4tp_gate_latency_p50_microseconds", ())] > 0
    assert delta("ds4tp_decode_steps") >= r.usage.completion_tokens
    assert delta("ds4tp_prefill_batches") >= 1
    assert after[("ds4tp_kv_budget_tokens", ())] == pair.health()[1]["kv_budget_tokens"] > 0
    assert after[("ds4tp_prompt_cache_bytes", ())] > 0


# ---------------------------------------------------------------------------------------------
# Memory-bounded admission
# ---------------------------------------------------------------------------------------------


def test_a_kv_budget_queues_what_does_not_fit_and_refuses_past_the_queue(model_dir, tmp_path):
    import http.client

    from mlx_ds4tp.synthetic.tiny_model import EOS_ID
    from serveutil import reference_steps

    # Each request below reserves 3 prompt tokens + 1000 (EOS biased away, so each decodes them
    # all and the first two are still running while the others arrive): the budget fits two.
    served = ServedPair(model_dir, tmp_path, extra=["--max-kv-tokens", "2100", "--max-queued", "1"])
    try:
        served.wait_healthy()
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1000, "stream": True,
                           "logit_bias": {str(EOS_ID): -100}}).encode()

        def start() -> http.client.HTTPResponse:
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
            return conn

        running = [start(), start()]
        deadline = time.monotonic() + 30
        while served.health()[1]["kv_reserved_tokens"] < 2006 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = served.health()[1]
        assert health["kv_reserved_tokens"] == 2006, health
        third = start()  # no room: it waits, in the queue of one
        deadline = time.monotonic() + 30
        while served.health()[1]["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        code, answer = post_raw(served, "/v1/completions", body)
        assert code == 429 and answer["error"]["code"] == "server_busy" and "--max-queued" in answer["error"]["message"]
        import urllib.request

        req = urllib.request.Request(served.base + "/v1/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("expected a 429")
        except urllib.error.HTTPError as e:
            assert e.code == 429 and e.headers["Retry-After"].isdigit()
        # A request that could never fit is a 400 naming the budget.
        code, answer = post_raw(served, "/v1/completions", json.dumps({"prompt": [5], "max_tokens": 2100}).encode())
        assert code == 400 and "--max-kv-tokens 2100" in answer["error"]["message"]
        # Everyone admitted finishes, the queued one once there was room, with the right text.
        from serveutil import _load

        steps = reference_steps(model_dir, [5, 6, 7], 1000, logit_bias={EOS_ID: -100.0})
        detok = _load(model_dir)[1].detokenizer  # the streaming detokenizer, as the server's
        detok.reset()
        for token, _ in steps:
            detok.add_token(token)
        detok.finalize()
        want = detok.text
        for conn in running + [third]:
            r = conn.getresponse()
            data = [ln[6:] for ln in r.read().decode().split("\n") if ln.startswith("data: ")]
            assert r.status == 200 and data[-1] == "[DONE]"
            assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == want
            conn.close()
        health = served.health()[1]
        assert health["kv_reserved_tokens"] == 0 and health["queued"] == 0
    finally:
        served.close()
