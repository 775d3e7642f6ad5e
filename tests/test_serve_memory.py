"""The default KV budget (lockstep/caches/memory.py): bytes a cache token takes, read off a forward that
is built and never run, and the machine's memory less the weights and a headroom."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_ds4tp.lockstep.caches import memory


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_lm import load

    from mlx_ds4tp.synthetic.tiny_model import save_llama

    return load(str(save_llama(tmp_path_factory.mktemp("mem") / "m", "tiny", seed=1)))[0]


def _filled_bytes(model, tokens: int, bits: int = 0) -> float:
    from mlx_ds4tp.lockstep.caches.quantized_cache import quantize_session_cache
    from mlx_ds4tp.lockstep.compute import make_cache

    cache = make_cache(model)
    if bits:
        cache = quantize_session_cache(cache, bits, 32)
    model(mx.arange(tokens, dtype=mx.int32)[None] % 50, cache=cache)
    mx.eval([c.state for c in cache])
    arrays = [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    return sum(a.nbytes for a in arrays) / tokens


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_bytes_a_token_take_are_those_of_a_filled_cache(model, bits):
    probe = memory.kv_bytes_per_token(model, bits, 32)
    # mlx-lm grows caches 256 tokens at a time: a filled multiple of that is the exact figure.
    assert probe == pytest.approx(_filled_bytes(model, 512, bits))
    if bits:
        assert probe < memory.kv_bytes_per_token(model) / 2


def test_the_budget_is_the_memory_left_after_the_weights_and_the_headroom(model):
    per = memory.kv_bytes_per_token(model)
    gib = 1 << 30
    tokens, how = memory.default_kv_budget(model, total=64 * gib, resident=20 * gib)
    assert tokens == int((64 - 20 - 16) * gib // per)
    assert "64.0 GiB of memory" in how and "--max-kv-tokens" in how
    # A machine already full leaves nothing: every request then waits or is refused, never
    # runs the machine out of memory.
    assert memory.default_kv_budget(model, total=8 * gib, resident=7 * gib)[0] == 0
    assert memory.default_kv_budget(model, total=0, resident=0) == (
        None, "no KV budget: this machine's memory could not be read")


def test_this_machines_memory_is_read():
    assert memory.total_memory() > memory.resident_memory() > 0


def test_a_memory_limit_caps_the_machines_figure(model, monkeypatch):
    gib = 1 << 30
    monkeypatch.setenv("DS4_TP_MEMORY_LIMIT_BYTES", str(3 * gib))
    tokens, how = memory.default_kv_budget(model, resident=gib // 2)
    assert "3.0 GiB of memory" in how
    assert tokens == int((3 * gib - gib // 2 - 2 * gib) // memory.kv_bytes_per_token(model))


def test_the_served_budget_is_the_smaller_of_the_two_machines(tmp_path):
    # Two different Macs: the worker's machine holds fewer cache tokens than the leader's (here
    # a cap on what the worker may use), so the leader admits no more than the worker holds.
    import re

    from serveutil import ServedPair, build_chat_model

    model_dir = build_chat_model(tmp_path / "model")
    served = ServedPair(model_dir, tmp_path, rank_env={"worker": {"DS4_TP_MEMORY_LIMIT_BYTES": str(3 << 30)}})
    try:
        body = served.wait_healthy()
        leader, worker = served.log("leader"), served.log("worker")
        own = int(re.search(r"on the leader, KV budget (\d+) tokens", leader).group(1))
        room = int(re.search(r"on the worker, KV budget (\d+) tokens .*3\.0 GiB of memory", worker).group(1))
        assert 0 < room < own, (own, room)
        assert (f"KV budget {room} tokens, the smaller of rank 0's ({own}) and the least of ranks 1 .. 1 "
                f"({room})") in leader
        assert body["kv_budget_tokens"] == room
    finally:
        served.close()
