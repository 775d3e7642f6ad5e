"""The gate's sum in C (tp_sum2, and through it tp_tcp_gate_sum / tp_gate_sum): bit-identical
to MLX's own a + b for float32, float16 and bfloat16, whatever the bits of the partials."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ds4tp.link.native import load_verbs, sum_partials

# (MLX dtype, C code, the numpy type its bits are read as)
DTYPES = [(mx.float32, 1, np.uint32), (mx.float16, 2, np.uint16), (mx.bfloat16, 3, np.uint16)]


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
        sum_partials(1, 0, a, a.copy(), a.copy())
    with pytest.raises(ValueError, match="must match"):
        sum_partials(1, 0, np.zeros(4, np.uint8), np.zeros(8, np.uint8), np.zeros(4, np.uint8))
    assert lib.tp_sum2(9, ffi.NULL, ffi.NULL, ffi.NULL, 0) == lib.TP_EINVAL


def test_sum_gate_refuses_a_wrong_size_and_a_closed_pair_before_sending():
    """tp_sum_gate_run checks before it touches the socket or device: a partial of another
    size is TP_EINVAL naming both sizes, a closed pair TP_ECLOSED, and neither spends a
    sequence number."""
    ffi, lib = load_verbs()
    state = ffi.new("tp_pair_state *")
    gate = ffi.new("tp_sum_gate *")
    gate.pair = state
    gate.fd = -1
    gate.bytes = 16
    src = ffi.new("char[]", 16)
    assert lib.tp_sum_gate_run(gate, src, 8) == lib.TP_EINVAL
    assert "the partial is 8 bytes, this gate takes 16" in ffi.string(gate.err).decode()
    state.closed = 1
    assert lib.tp_sum_gate_run(gate, src, 16) == lib.TP_ECLOSED
    assert "this pair is closed" in ffi.string(gate.err).decode()
    assert state.seq == 0


def test_sum_gate_refuses_a_latency_count_without_room_for_the_total():
    from mlx_ds4tp.link.sum_gates import make_sum_gate

    ffi, lib = load_verbs()

    class Tcp:
        spin_ns = 0

        def fileno(self):
            return -1

    buf = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="latency_count holds 1 uint64; it needs 2"):
        make_sum_gate(ffi.new("tp_pair_state *"), Tcp(), None, 0, buf, buf.copy(), lib.TP_SUM_F32, 0, 0,
                      np.zeros(8, np.int64), np.zeros(1, np.uint64))


@pytest.mark.parametrize("shape", [(8192,), (2, 3, 4), (), (0,), (2, 0, 3)], ids=str)
def test_bfloat16_export_copies_the_bits_into_a_new_evaluated_array(shape):
    from mlx_ds4tp.collectives.dlpack import Bf16Export

    count = int(np.prod(shape, dtype=np.int64))
    bits_in = np.random.default_rng(5).integers(0, 1 << 16, size=count, dtype=np.uint64).astype(np.uint16)
    export = Bf16Export(bits_in, shape)
    original = bits_in.copy()
    first = export()
    assert first.dtype == mx.bfloat16 and first.shape == tuple(shape)
    assert np.array_equal(np.array(first.view(mx.uint16)).ravel(), original)
    bits_in[:] = 0x3F80  # the next gate reuses the buffer: the array made before must not change
    second = export()
    assert np.array_equal(np.array(first.view(mx.uint16)).ravel(), original)
    assert np.all(np.array(second.view(mx.uint16)) == 0x3F80)
    with pytest.raises(ValueError, match="cannot hold shape"):
        Bf16Export(np.zeros(3, np.uint16), (4,))
