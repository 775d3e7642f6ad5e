"""Our Group is an mx.distributed.Group: MLX's collective test matrix (dtypes int8, uint8,
int32, uint32, float32, float16, bfloat16; shapes (), (7,), (10,), (1024,), (1024, 1024);
all_sum, all_max, all_min, all_gather) plus sum_scatter, send/recv and group=None, through
mx.distributed over tcp, the emulated RDMA device and the real ibverbs provider on the fake
libibverbs; gradients, mx.compile and mx.vmap against the unsplit computation.

One pair of rank processes per transport runs the whole matrix (tests/collective_child.py).
"""

from __future__ import annotations

import json
import os
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

import mlx_ds4tp as tp
from mlx_ds4tp.gate_ops import SUPPORTED_DTYPES
from pairutil import Procs, fake_verbs_library, free_port, make_groups, run_both, run_mlx_ranks

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collective_child.py")
# 7 dtypes x 5 shapes x (all_sum, all_max, all_min, all_gather, sum_scatter, send/recv)
# + 7 dtypes x 6 collectives with group=None + group=None before init.
MATRIX_CASES = 7 * 5 * 6 + 7 * 6 + 1


@pytest.fixture(scope="module", params=["tcp", "rdma", "rdma-fake"])
def reports(request):
    procs = Procs()
    port = str(free_port())
    env = {"DS4_TP_VERBS_LIBRARY": fake_verbs_library()} if request.param == "rdma-fake" else None
    try:
        ranks = [procs.spawn([CHILD, role, port, request.param], env=env) for role in ("leader", "worker")]
        out = []
        for p in ranks:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        procs.kill_all()
    return out


def test_mlx_collective_matrix_passes_on_both_ranks(reports):
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["failed"] == [], report["failed"]
        assert report["cases"] == MATRIX_CASES == 253


def test_gradients_match_the_unsplit_computation(reports):
    for report in reports:
        assert report["gradients"] == {"all_sum": True, "all_gather": True, "sum_scatter": True}


def test_compile_and_vmap_of_collectives_match_the_unsplit_computation(reports):
    for report in reports:
        assert report["transforms"] == {"compile": True, "vmap": True, "pair_intact": True}


@pytest.fixture(scope="module")
def groups():
    lg, wg = make_groups("tcp", timeout=5.0)
    yield lg, wg
    lg.close()
    wg.close()


def evaluated(y: mx.array) -> mx.array:
    """y evaluated in the calling thread: each rank's thread runs its own collective (a
    collective is lazy; evaluating both ranks' in one thread would wait on itself)."""
    mx.eval(y)
    return y


def evaluated_op(op, x: mx.array, group) -> mx.array:
    """op(x, group=group), evaluated in the calling thread."""
    return evaluated(op(x, group=group))


def test_different_collectives_on_the_two_ranks_are_named():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        x = mx.zeros((8,), dtype=mx.int32)
        mx.eval(x)
        (_, le), (_, we) = run_both(lambda: evaluated(tp.all_sum(x, group=lg)),
                                    lambda: evaluated(tp.all_max(x, group=wg)))
    # Raised inside MLX's evaluation: MLX hands it on as a RuntimeError.
    assert isinstance(le, RuntimeError) and isinstance(we, RuntimeError)
    assert "this rank has all_sum int32 (8,), the peer has all_max int32 (8,)" in str(le)
    assert "this rank has all_max int32 (8,), the peer has all_sum int32 (8,)" in str(we)


def test_two_senders_are_named():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        x = mx.zeros((3,), dtype=mx.uint8)
        mx.eval(x)
        (_, le), (_, we) = run_both(lambda: evaluated(tp.send(x, 1, group=lg)),
                                    lambda: evaluated(tp.send(x, 0, group=wg)))
    assert isinstance(le, RuntimeError)
    assert "this rank has send/recv from rank 0 uint8 (3,), the peer has send/recv from rank 1" in str(le)


def test_recv_of_a_wrong_shape_is_named():
    lg, wg = make_groups("tcp", timeout=5.0)
    with lg, wg:
        x = mx.arange(6, dtype=mx.int16)
        mx.eval(x)
        (_, le), (_, we) = run_both(lambda: evaluated(tp.send(x, 1, group=lg)),
                                    lambda: evaluated(tp.recv((5,), mx.int16, 0, group=wg)))
    assert "this rank has send/recv from rank 0 int16 (6,), the peer has send/recv from rank 0 int16 (5,)" in str(le)


def test_every_mlx_dtype_round_trips_exactly(groups):
    """Beyond the matrix: bool, the other integer widths, float64 and complex64."""
    lg, wg = groups
    cases = {mx.bool_: ([True, False, False], [True, True, False]),
             mx.int16: ([32767, -5, 3], [1, -32768, 4]),
             mx.int64: ([2**62, -1, 7], [2**62, 1, -7]),
             mx.uint16: ([65535, 0, 1], [1, 2, 3]),
             mx.uint64: ([2**63, 1, 0], [2**63, 2, 5]),
             mx.float64: ([1e300, 0.1, -2.5], [1e300, 0.2, 2.5]),
             mx.complex64: ([1 + 2j, -3j, 4], [1 - 2j, 3j, 4j])}
    for dtype, (a, b) in cases.items():
        np_dtype = {mx.bool_: "bool"}.get(dtype, str(dtype).split(".")[-1])
        xa, xb = (mx.array(np.array(v, dtype=np_dtype), dtype=dtype) for v in (a, b))
        mx.eval(xa, xb)
        for ours, theirs in ((tp.all_sum, mx.add), (tp.all_max, mx.maximum), (tp.all_min, mx.minimum)):
            ya, yb = run_both(partial(evaluated_op, ours, xa, lg), partial(evaluated_op, ours, xb, wg))
            want = theirs(xa, xb)
            for y, exc in (ya, yb):
                assert exc is None, exc
                assert y.dtype == dtype and bytes(memoryview(y)) == bytes(memoryview(want)), (dtype, ours, y, want)


def _all_sum_or_error(x: mx.array, group):
    """(the all_sum of x, the error its evaluation raised or None), in the calling thread."""
    y = tp.all_sum(x, group=group)
    try:
        mx.eval(y)
    except RuntimeError as exc:
        return y, str(exc)
    return y, None


def test_every_dtype_is_named_by_its_code_and_a_failed_float_output_is_nan():
    """The exchange header carries the dtype's code (csrc/exchange_codes.h): the C++ backend
    writes it, the C exchange names it in the mismatch error, so every dtype must come back
    under MLX's own name. A failed collective's output is poisoned with NaN where the dtype has
    one, so even a reader that never sees the error gets no plausible sum."""
    dtypes = list(SUPPORTED_DTYPES)
    assert len(dtypes) == 14
    for mine, theirs in zip(dtypes[::2], dtypes[1::2]):
        lg, wg = make_groups("tcp", timeout=5.0)
        with lg, wg:
            xa, xb = mx.ones((3,), dtype=mine), mx.ones((3,), dtype=theirs)
            mx.eval(xa, xb)
            ((ya, le), _), ((yb, we), _) = run_both(partial(_all_sum_or_error, xa, lg),
                                                    partial(_all_sum_or_error, xb, wg))
        a, b = (str(d).split(".")[-1] for d in (mine, theirs))
        assert f"this rank has all_sum {a} (3,), the peer has all_sum {b} (3,)" in le, le
        assert f"this rank has all_sum {b} (3,), the peer has all_sum {a} (3,)" in we, we
        for y in (ya, yb):
            if mx.issubdtype(y.dtype, mx.inexact):
                assert mx.isnan(y).all().item(), (y.dtype, y)


def test_unsupported_dtype_is_refused_with_the_list(groups):
    lg, _ = groups
    with pytest.raises(TypeError, match="dtype .* is not supported by the collectives; use one of float32"):
        tp.recv((2,), "int32", 1, group=lg)


MLX_RANK_SCRIPT = """
import json, mlx.core as mx, mlx_ds4tp as tp
g = tp.init(transport="mlx")
r = g.rank()
x = mx.arange(6, dtype=mx.int32) * (r + 1) - 3 * r
out = {"max": tp.all_max(x).tolist(), "min": tp.all_min(x, group=g).tolist(),
       "scatter": tp.sum_scatter(x).tolist()}
if r == 0:
    mx.eval(tp.send(x, 1))
    out["recv"] = tp.recv((6,), mx.int32, 1).tolist()
else:
    out["recv"] = tp.recv_like(x, 0).tolist()
    mx.eval(tp.send(x, 0))
print(json.dumps(out))
"""


def test_mlx_transport_delegates_every_collective(procs, tmp_path):
    """transport="mlx": all_max, all_min, sum_scatter, send and recv go to mx.distributed
    (sum_scatter as its all_sum and the slice: MLX's own runs only on NCCL)."""
    outs = run_mlx_ranks(procs, tmp_path, MLX_RANK_SCRIPT)
    x0, x1 = list(range(6)), [2 * i - 3 for i in range(6)]
    for rank, o in enumerate(outs):
        assert o["max"] == [max(a, b) for a, b in zip(x0, x1)]
        assert o["min"] == [min(a, b) for a, b in zip(x0, x1)]
        assert o["scatter"] == [a + b for a, b in zip(x0, x1)][3 * rank:3 * rank + 3]
        assert o["recv"] == (x1 if rank == 0 else x0)
