"""The gate's sum in C (tp_sum2, which the MLX backend's all_sum and sum_scatter call for the
float dtypes): bit-identical to MLX's own a + b for float32, float16 and bfloat16, whatever the
bits of the partials."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ds4tp.link.native import load_verbs


def sum_partials(dtype: int, rank: int, mine, peer, out) -> None:
    """out = rank 0's partial + rank 1's (mine is this rank's), as the backend calls tp_sum2."""
    ffi, lib = load_verbs()
    a, b = ffi.from_buffer(mine), ffi.from_buffer(peer)
    o = ffi.from_buffer(out, require_writable=True)
    if not len(a) == len(b) == len(o):
        raise ValueError(f"{len(a)}, {len(b)} and {len(o)} bytes: they must match")
    item = 4 if dtype == lib.TP_DTYPE_FLOAT32 else 2
    first, second = (a, b) if rank == 0 else (b, a)
    if len(a) % item or lib.tp_sum2(dtype, first, second, o, len(a) // item) != lib.TP_OK:
        raise ValueError(f"dtype code {dtype} with {len(a)} bytes is not a whole number of items")

# (MLX dtype, C code, the numpy type its bits are read as)
_LIB = load_verbs()[1]
DTYPES = [(mx.float32, _LIB.TP_DTYPE_FLOAT32, np.uint32), (mx.float16, _LIB.TP_DTYPE_FLOAT16, np.uint16),
          (mx.bfloat16, _LIB.TP_DTYPE_BFLOAT16, np.uint16)]


def _not_nan_bits(rng, count: int, dtype, bits_type) -> np.ndarray:
    """Random bit patterns over the whole range of the type (subnormals, huge values,
    infinities, both zeros), NaNs left out (test_nan_sums_are_nan_on_both_ranks_alike)."""
    raw = rng.integers(0, np.iinfo(bits_type).max + 1, size=count, dtype=np.uint64).astype(bits_type)
    values = np.array(mx.array(raw).view(dtype).astype(mx.float32))
    return raw[~np.isnan(values)]


def _bits(x: mx.array) -> np.ndarray:
    return np.frombuffer(memoryview(x).cast("B"), dtype=np.uint8)


@pytest.mark.parametrize("dtype, code, bits_type", DTYPES, ids=lambda v: str(v))
def test_c_sum_equals_mlx_add_bit_for_bit(dtype, code, bits_type):
    rng = np.random.default_rng(code)
    a_bits = _not_nan_bits(rng, 300_000, dtype, bits_type)
    b_bits = _not_nan_bits(rng, 300_000, dtype, bits_type)
    n = min(len(a_bits), len(b_bits))
    # Plus ordinary activations: near-equal magnitudes, where rounding ties live.
    normal = rng.standard_normal(2 * 50_000).astype(np.float32)
    a = mx.concatenate([mx.array(a_bits[:n]).view(dtype), mx.array(normal[:50_000]).astype(dtype)])
    b = mx.concatenate([mx.array(b_bits[:n]).view(dtype), mx.array(normal[50_000:]).astype(dtype)])
    expected = a + b
    mx.eval(a, b, expected)
    out = np.empty(expected.nbytes, dtype=np.uint8)
    sum_partials(code, 0, memoryview(a).cast("B"), memoryview(b).cast("B"), out)
    assert np.array_equal(out, _bits(expected)), f"{int((out != _bits(expected)).sum())} bytes differ"
    # Rank 1 passes its own partial first: the sum is still rank 0's + rank 1's.
    out1 = np.empty_like(out)
    sum_partials(code, 1, memoryview(b).cast("B"), memoryview(a).cast("B"), out1)
    assert np.array_equal(out1, out)


def test_nan_sums_are_nan_on_both_ranks_alike():
    """inf + -inf and a NaN partial give a NaN (its payload bits are the C conversion's, which
    may differ from MLX's own; both ranks compute the same bits)."""
    inf = np.float32(np.inf)
    for dtype, code, _ in DTYPES:
        a = mx.array(np.array([inf, -inf, np.nan, 2.0], np.float32)).astype(dtype)
        b = mx.array(np.array([-inf, inf, 1.0, np.nan], np.float32)).astype(dtype)
        mx.eval(a, b)
        out0, out1 = np.empty(a.nbytes, dtype=np.uint8), np.empty(a.nbytes, dtype=np.uint8)
        sum_partials(code, 0, memoryview(a).cast("B"), memoryview(b).cast("B"), out0)
        sum_partials(code, 1, memoryview(b).cast("B"), memoryview(a).cast("B"), out1)
        assert np.array_equal(out0, out1)
        got = np.array(mx.array(out0).view(dtype).astype(mx.float32))
        assert np.isnan(got).all(), (dtype, got)


def test_bad_sizes_and_dtypes_are_refused():
    ffi, lib = load_verbs()
    a = np.zeros(3, np.uint8)
    with pytest.raises(ValueError, match="not a whole number"):
        sum_partials(lib.TP_DTYPE_FLOAT32, 0, a, a.copy(), a.copy())
    with pytest.raises(ValueError, match="must match"):
        sum_partials(lib.TP_DTYPE_FLOAT32, 0, np.zeros(4, np.uint8), np.zeros(8, np.uint8), np.zeros(4, np.uint8))
    # The other dtypes are combined by the backend itself, never by tp_sum2.
    assert lib.tp_sum2(lib.TP_DTYPE_UINT8, ffi.NULL, ffi.NULL, ffi.NULL, 0) == lib.TP_EINVAL
