"""The default KV budget (serve/memory.py): bytes a cache token takes, read off a forward that
is built and never run, and the machine's memory less the weights and a headroom."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_ds4tp.serve import memory


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_lm import load

    from mlx_ds4tp.testing.tiny_model import save_llama

    return load(str(save_llama(tmp_path_factory.mktemp("mem") / "m", "tiny", seed=1)))[0]


def _filled_bytes(model, tokens: int, bits: int = 0) -> float:
    from mlx_ds4tp.lockstep.compute import make_cache
    from mlx_ds4tp.lockstep.quantized_cache import quantize_session_cache

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
        0, "no KV budget: this machine's memory could not be read")


def test_this_machines_memory_is_read():
    assert memory.total_memory() > memory.resident_memory() > 0
