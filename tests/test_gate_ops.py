"""init / Group / all_sum / all_gather, over tcp, ucsim rdma and mx.distributed."""

from __future__ import annotations

import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest

import mlx_ds4tp as tp
from pairutil import both_ok, make_groups, run_both, run_mlx_ranks

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


@pytest.fixture(scope="module", params=["tcp", "rdma"])
def groups(request):
    lg, wg = make_groups(request.param, timeout=10.0)
    yield lg, wg
    lg.close()
    wg.close()


def partials(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    a = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    # MLX streams are per thread: evaluate here, the ranks run in other threads.
    mx.eval(a, b)
    return a, b


def bits(x: mx.array) -> np.ndarray:
    return np.frombuffer(memoryview(x).cast("B"), dtype=np.uint8).copy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4096,), (1, 1, 4096), (3, 7), (8192,), (64, 4096), ()])
def test_all_sum_is_exact_and_identical_on_both_ranks(groups, dtype, shape):
    lg, wg = groups
    a, b = partials(shape, dtype, seed=len(shape) * 31 + 7)
    ya, yb = both_ok(lambda: tp.all_sum(a, group=lg), lambda: tp.all_sum(b, group=wg))
    expected = a + b  # MLX's own sum of the two partials, rank 0's first
    for y in (ya, yb):
        assert y.dtype == dtype and y.shape == a.shape
        assert np.array_equal(bits(y), bits(expected)), "not bit-identical to MLX's a + b"
    assert np.array_equal(bits(ya), bits(yb))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2048), (5,), (2, 3, 4), (40, 4096)])
def test_all_gather_concatenates_in_rank_order(groups, dtype, shape):
    lg, wg = groups
    a, b = partials(shape, dtype, seed=3)
    za, zb = both_ok(lambda: tp.all_gather(a, group=lg), lambda: tp.all_gather(b, group=wg))
    expected = mx.concatenate([a, b], axis=0)
    for z in (za, zb):
        assert z.dtype == dtype and z.shape == expected.shape
        assert np.array_equal(bits(z), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_result_is_a_new_array_the_next_gate_leaves_alone(groups, dtype):
    """The gate reuses its buffers from call to call; what it returns is a copy."""
    lg, wg = groups
    a, b = partials((4096,), dtype, seed=11)
    first = both_ok(lambda: tp.all_sum(a, group=lg), lambda: tp.all_sum(b, group=wg))
    kept = [bits(y) for y in first]
    a2, b2 = partials((4096,), dtype, seed=12)
    second = both_ok(lambda: tp.all_sum(a2, group=lg), lambda: tp.all_sum(b2, group=wg))
    assert [bits(y).tolist() for y in first] == [k.tolist() for k in kept]
    assert np.array_equal(bits(second[0]), bits(a2 + b2))


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_pair_closed_under_its_group_refuses_the_gate(transport):
    """The float gate keeps its C arguments (socket, device) from gate to gate: once the pair
    is closed they must not be used, and the peer hears of it as an error, not a hang."""
    lg, wg = make_groups(transport, timeout=5.0)
    with lg, wg:
        ones = mx.ones((4096,))
        mx.eval(ones)
        both_ok(lambda: tp.all_sum(ones, group=lg), lambda: tp.all_sum(ones, group=wg))
        lg.link_to(1).close()
        started = time.monotonic()
        # Collectives run inside MLX's evaluation, which hands their errors on as RuntimeError.
        with pytest.raises(RuntimeError, match="this group is closed"):
            mx.eval(tp.all_sum(ones, group=lg))
        with pytest.raises(RuntimeError):
            mx.eval(tp.all_sum(ones, group=wg))
        assert time.monotonic() - started < 2.5


def test_non_contiguous_partials(groups):
    lg, wg = groups
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4).T
    b = (mx.arange(12, dtype=mx.float32) * 10).reshape(3, 4).T
    mx.eval(a, b)
    ya, yb = both_ok(lambda: tp.all_sum(a, group=lg), lambda: tp.all_sum(b, group=wg))
    assert mx.array_equal(ya, a + b) and mx.array_equal(yb, a + b)


def test_lazy_graph_input_is_evaluated(groups):
    lg, wg = groups

    def lazy(scale):  # built and reduced in the rank's own thread, unevaluated
        base = mx.ones((4096,))
        return tp.all_sum(mx.exp(base * 0) * scale, group=lg if scale == 1 else wg)

    ya, yb = both_ok(lambda: lazy(1), lambda: lazy(2))
    assert mx.array_equal(ya, mx.full((4096,), 3.0)) and mx.array_equal(yb, ya)


def test_shape_mismatch_names_both_shapes():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        x4, x2 = mx.zeros((1, 4096)), mx.zeros((1, 2048))
        mx.eval(x4, x2)
        (_, le), (_, we) = run_both(lambda: tp.all_sum(x4, group=lg), lambda: tp.all_sum(x2, group=wg))
    for exc, mine, theirs in ((le, "(1, 4096)", "(1, 2048)"), (we, "(1, 2048)", "(1, 4096)")):
        assert isinstance(exc, RuntimeError), exc  # raised inside MLX's evaluation
        assert f"this rank has all_sum float32 {mine}, the peer has all_sum float32 {theirs}" in str(exc)


def test_dtype_mismatch_names_both_dtypes():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        h, f = mx.zeros((8,), mx.float16), mx.zeros((8,), mx.float32)
        mx.eval(h, f)
        (_, le), (_, we) = run_both(lambda: tp.all_sum(h, group=lg), lambda: tp.all_sum(f, group=wg))
    assert "this rank has all_sum float16 (8,), the peer has all_sum float32 (8,)" in str(le)
    assert "this rank has all_sum float32 (8,), the peer has all_sum float16 (8,)" in str(we)


def test_bad_arguments_are_clear():
    with pytest.raises(TypeError, match="pass the Group returned by mlx_ds4tp.init"):
        tp.all_sum(mx.zeros((2,)), group="g")
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        with pytest.raises(ValueError, match="sum_scatter: x.shape.0. must be divisible by the group size 2"):
            tp.sum_scatter(mx.zeros((3,)), group=lg)
        with pytest.raises(ValueError, match=r"dst=0: give another rank of this group of 2 \(0 .. 1, not this rank"):
            tp.send(mx.zeros((3,)), 0, group=lg)
    with pytest.raises(ValueError, match="role='captain'"):
        tp.init(role="captain", listen=("127.0.0.1", 1))


def test_group_surface_and_close():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg as g0, wg as g1:
        assert (g0.rank(), g0.size(), g0.transport) == (0, 2, "tcp")
        assert (g1.rank(), g1.size()) == (1, 2)
        assert "rank=0" in repr(g0)
    with pytest.raises(RuntimeError, match="this group is closed"):
        mx.eval(tp.all_sum(mx.zeros((4,)), group=lg))


def test_reconnect_refuses_what_it_cannot_rejoin():
    from mlx_ds4tp import gate_ops
    from mlx_ds4tp.link.config import LinkSettings, PairAddress

    with pytest.raises(TypeError, match="reconnect.. takes a group mlx_ds4tp.init"):
        gate_ops.reconnect("g")
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        with pytest.raises(ValueError, match="transport='mlx'"):
            gate_ops.reconnect(lg, LinkSettings(PairAddress("leader", None, None), "mlx"))
        with pytest.raises(tp.TransportError, match="still open"):
            lg.reattach(lg.mesh)


def test_gate_latency_is_recorded():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        ones = mx.ones((4096,))
        mx.eval(ones)
        for _ in range(20):
            both_ok(lambda: tp.all_sum(ones, group=lg), lambda: tp.all_sum(ones, group=wg))
        p50, p99 = lg.gate_latency_us()
        assert 0 < p50 <= p99


def test_exchange_seconds_count_gates_bulk_exchanges_and_the_wait_for_the_peer():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        assert lg.exchange_seconds() == 0.0
        ones = mx.ones((4096,))
        mx.eval(ones)
        for _ in range(20):
            both_ok(lambda: tp.all_sum(ones, group=lg), lambda: tp.all_sum(ones, group=wg))
        assert lg.gates() >= 20
        gates = lg.exchange_seconds()
        # The float gates time themselves in C (into the group's latency ring): the total is the
        # sum of their round trips, and of the one signature check before the first.
        in_gates = lg._rings[1].recent().sum() / 1e9
        assert in_gates > 0 and in_gates <= gates < in_gates + 0.5
        # A gate the worker reaches 0.3 s late: the leader's time in it is mostly the wait.
        both_ok(lambda: tp.all_sum(ones, group=lg),
                lambda: (time.sleep(0.3), tp.all_sum(ones, group=wg))[1])
        waited = lg.exchange_seconds() - gates
        assert 0.25 < waited < 5.0, waited
        # A bulk exchange (over the gate's 16 KiB) counts too, with its signature check, where
        # the wait for a late peer lands.
        logits = mx.ones((1, 40000))
        mx.eval(logits)
        before = lg.exchange_seconds()
        both_ok(lambda: tp.all_gather(logits, group=lg),
                lambda: (time.sleep(0.2), tp.all_gather(logits, group=wg))[1])
        assert 0.15 < lg.exchange_seconds() - before < 5.0


def test_drop_in_gate_layer(groups):
    """The gate as an nn.Module in user model code."""
    from mlx_ds4tp.model_split import AllSumGate

    lg, wg = groups
    gates = AllSumGate(lg), AllSumGate(wg)
    a, b = partials((2, 16), mx.float32, seed=11)
    ya, yb = both_ok(lambda: gates[0](a), lambda: gates[1](b))
    assert mx.array_equal(ya, a + b) and mx.array_equal(yb, a + b)


MLX_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, mlx.core as mx, mlx_ds4tp as tp
    g = tp.init(transport="mlx")
    x = mx.arange(6, dtype=mx.float32) * (g.rank() + 1)
    y = tp.all_sum(x, group=g)
    z = tp.all_gather(x[None], group=g)
    print(json.dumps({"rank": g.rank(), "size": g.size(), "transport": g.transport,
                      "sum": y.tolist(), "gather": z.tolist()}))
    """
)


def test_mlx_transport_uses_mx_distributed(procs, tmp_path):
    """transport="mlx": the same Group API over MLX's own ring backend."""
    outs = run_mlx_ranks(procs, tmp_path, MLX_RANK_SCRIPT)
    for r, o in enumerate(outs):
        assert (o["rank"], o["size"], o["transport"]) == (r, 2, "mlx")
        assert o["sum"] == [3.0 * i for i in range(6)]
        assert o["gather"] == [[float(i) for i in range(6)], [2.0 * i for i in range(6)]]
