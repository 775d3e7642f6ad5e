"""`ds4tp serve --kv-bits`: mlx-lm's quantized KV cache with batching kept on (the batched
quantized cache, lockstep/caches/quantized_cache.py), and the prompt cache bounded in bytes."""

from __future__ import annotations

import json
import threading
import time

import pytest

from serveutil import ServedPair, _load, build_chat_model, client, open_stream, post_raw, text_ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("kv-model"))


def quantized_reference(model_dir, prompt, max_tokens: int, bits: int, group_size: int) -> str:
    """mlx_lm.generate's greedy text with a quantized KV cache from the first token."""
    from mlx_lm import generate
    from mlx_lm.models.cache import QuantizedKVCache

    model, tokenizer = _load(model_dir)
    cache = [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]
    return generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens, prompt_cache=cache)


def _hold(served: ServedPair, tokens: int):
    """A streamed request that holds the KV budget until its connection closes."""
    from mlx_ds4tp.synthetic.tiny_model import EOS_ID

    return open_stream(served, json.dumps({"prompt": [5, 6, 7], "max_tokens": tokens, "stream": True,
                                           "logit_bias": {str(EOS_ID): -100}}).encode())


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_bits_keep_the_batch_decoding_together_each_as_mlx_lm_alone(model_dir, tmp_path, bits):
    pytest.importorskip("openai", reason="the openai package (pip install openai)")
    group = 32
    prompts = [text_ids(model_dir, p) for p in ("the sea", "a longer prompt about the sky above",
                                                 "one two three", "quantized caches")]
    lengths = [20, 14, 18, 16]
    want = [quantized_reference(model_dir, p, n, bits, group) for p, n in zip(prompts, lengths)]
    holder_tokens = 4000
    budget = 3 + holder_tokens + min(len(p) + n for p, n in zip(prompts, lengths)) - 1
    served = ServedPair(model_dir, tmp_path, extra=["--kv-bits", str(bits), "--kv-group-size", str(group),
                                                    "--max-kv-tokens", str(budget), "--debug-hash", "2"])
    holder = None
    try:
        served.wait_healthy()
        holder = _hold(served, holder_tokens)
        got, errors = [None] * 4, []

        def ask(i):
            try:
                got[i] = client(served, timeout=120).completions.create(
                    model=str(model_dir), prompt=prompts[i], max_tokens=lengths[i]).choices[0].text
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while served.health()[1]["queued"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        holder.close()  # the four start in one turn and decode in one batch
        holder = None
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert got == want
        health = served.health()[1]
        assert health["decode_batch_rows"] >= 4, health
        if bits == 4:
            # At 4 bits this model's answers differ from the float cache's: the flag took effect
            # (at 8 they are the same text).
            from serveutil import reference

            assert [reference(model_dir, p, n) for p, n in zip(prompts, lengths)] != want
    finally:
        if holder is not None:
            holder.close()
        served.close()


def test_a_group_size_the_head_does_not_divide_is_refused_at_start(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, extra=["--kv-bits", "4", "--kv-group-size", "64"])
    try:
        rc = served.procs["leader"].wait(60)
        assert rc != 0
        assert "--kv-group-size 64: the model's head size [32]" in served.log("leader")
        assert "give --kv-group-size 32" in served.log("leader")
    finally:
        served.close()


def test_the_prompt_cache_is_bounded_in_bytes(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, extra=["--prompt-cache-bytes", "400KB"])
    try:
        served.wait_healthy()
        sizes = []
        for i in range(6):
            body = {"prompt": [5 + i] * 40, "max_tokens": 4}
            assert post_raw(served, "/v1/completions", json.dumps(body).encode())[0] == 200
            sizes.append(served.health()[1]["prompt_cache_bytes"])
        health = served.health()[1]
        # Each stored cache takes 128 KiB on a rank here (mlx-lm's KVCache grows in steps of
        # 256 tokens): three fit in 400 KB; the --prompt-cache-size of 10 never binds.
        assert sizes[:3] == [131072, 262144, 393216] and sizes[3:] == [393216] * 3, sizes
        assert health["prompt_cache_entries"] == 3, health
        # The oldest were dropped on both ranks: the first prompt is computed afresh, right.
        code, answer = post_raw(served, "/v1/completions", json.dumps({"prompt": [5] * 40, "max_tokens": 4}).encode())
        assert code == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer
    finally:
        served.close()
