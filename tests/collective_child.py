"""One rank of the collective matrix (tests/test_collectives.py runs two of these).

MLX's own collective test matrix against our Group, through mx.distributed (tp.all_sum and
its kin are thin names over it), with group=None, sum_scatter, send/recv, gradients against
the unsplit computation, and mx.compile / mx.vmap of functions with collectives inside.
Prints one JSON report as its last line.

    python collective_child.py leader|worker PORT tcp|rdma|rdma-fake

rdma-fake: the real ibverbs provider over the tests' fake libibverbs (DS4_TP_VERBS_LIBRARY
set by the caller), no device named.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mlx_ds4tp as tp  # noqa: E402

DTYPES = [mx.int8, mx.uint8, mx.int32, mx.uint32, mx.float32, mx.float16, mx.bfloat16]
SHAPES = [(), (7,), (10,), (1024,), (1024, 1024)]
REDUCTIONS = {"all_sum": (tp.all_sum, mx.add), "all_max": (tp.all_max, mx.maximum),
              "all_min": (tp.all_min, mx.minimum)}


def partial(rank: int, dtype, shape, salt: int) -> mx.array:
    """Rank `rank`'s partial: every rank can make both ranks' (same seed)."""
    rng = np.random.default_rng([rank, DTYPES.index(dtype), len(shape), int(np.prod(shape)), salt])
    if dtype in (mx.float32, mx.float16, mx.bfloat16):
        x = mx.array((rng.standard_normal(shape) * 8).astype(np.float32)).astype(dtype)
    else:
        # The whole range: sums overflow and must wrap exactly as MLX's do.
        info = np.iinfo(np.dtype(str(dtype).split(".")[-1]))
        x = mx.array(rng.integers(info.min, info.max, size=shape, endpoint=True,
                                  dtype=np.dtype(str(dtype).split(".")[-1])))
    mx.eval(x)
    return x


def same(got: mx.array, want: mx.array) -> bool:
    mx.eval(got, want)
    return (got.dtype == want.dtype and got.shape == want.shape
            and bytes(memoryview(got)) == bytes(memoryview(want)))


class Report:
    def __init__(self) -> None:
        self.cases = 0
        self.failed: list = []

    def check(self, name: str, ok: bool) -> None:
        self.cases += 1
        if not ok:
            self.failed.append(name)


def matrix(g, rank: int, report: Report) -> None:
    for dtype in DTYPES:
        for shape in SHAPES:
            mine, parts = partial(rank, dtype, shape, 0), [partial(r, dtype, shape, 0) for r in (0, 1)]
            case = f"{dtype} {shape}"
            for name, (ours, combine) in REDUCTIONS.items():
                report.check(f"{name} {case}", same(ours(mine, group=g), combine(parts[0], parts[1])))
            want = mx.stack(parts) if not shape else mx.concatenate(parts, axis=0)
            report.check(f"all_gather {case}", same(tp.all_gather(mine, group=g), want))
            if shape and shape[0] % 2 == 0:
                n = shape[0] // 2
                want = (parts[0] + parts[1])[rank * n:(rank + 1) * n]
                report.check(f"sum_scatter {case}", same(tp.sum_scatter(mine, group=g), want))
            else:
                try:
                    tp.sum_scatter(mine, group=g)
                    report.check(f"sum_scatter refuses {case}", False)
                except ValueError as exc:
                    report.check(f"sum_scatter refuses {case}", "divisible by the group size 2" in str(exc))
            # send/recv both ways: rank 0 -> 1 with recv_like, then 1 -> 0 with recv.
            if rank == 0:
                ok = same(tp.send(mine, 1, group=g), mine)
                ok = same(tp.recv(shape, dtype, 1, group=g), parts[1]) and ok
            else:
                ok = same(tp.recv_like(mine, 0, group=g), parts[0])
                ok = same(tp.send(mine, 0, group=g), mine) and ok
            report.check(f"send/recv {case}", ok)


def default_group(rank: int, report: Report) -> None:
    """Every collective with group= left out: the group init returned last."""
    for dtype in DTYPES:
        mine, parts = partial(rank, dtype, (10,), 1), [partial(r, dtype, (10,), 1) for r in (0, 1)]
        for name, (ours, combine) in REDUCTIONS.items():
            report.check(f"group=None {name} {dtype}", same(ours(mine), combine(parts[0], parts[1])))
        report.check(f"group=None all_gather {dtype}", same(tp.all_gather(mine), mx.concatenate(parts)))
        report.check(f"group=None sum_scatter {dtype}",
                     same(tp.sum_scatter(mine), (parts[0] + parts[1])[rank * 5:(rank + 1) * 5]))
        got = tp.send(mine, 1) if rank == 0 else tp.recv_like(mine, 0)
        report.check(f"group=None send/recv {dtype}", same(got, parts[0]))


def gradients(g, rank: int) -> dict:
    """mx.grad through split layers against the unsplit computation."""
    rng = np.random.default_rng(42)
    inputs, up, down, proj, gather_weight, scatter_weight = (
        mx.array(rng.standard_normal(s).astype(np.float32))
        for s in [(4, 8), (8, 16), (16, 8), (8, 5), (4, 5), (4, 3)])
    partials = [mx.array(rng.standard_normal((4, 3)).astype(np.float32)) for _ in (0, 1)]
    cols, rows = slice(8 * rank, 8 * rank + 8), slice(2 * rank, 2 * rank + 2)
    out = {}

    # all_sum: a column- then row-parallel MLP, the gate after the row-parallel matmul.
    def mlp_split(w1, w2):
        return (tp.all_sum(mx.tanh(inputs @ w1) @ w2, group=g) ** 2).sum()

    def mlp(w1, w2):
        return ((mx.tanh(inputs @ w1) @ w2) ** 2).sum()

    g1, g2 = mx.grad(mlp_split, argnums=(0, 1))(up[:, cols], down[cols])
    u1, u2 = mx.grad(mlp, argnums=(0, 1))(up, down)
    out["all_sum"] = bool(mx.allclose(g1, u1[:, cols], rtol=1e-5, atol=1e-5)
                          and mx.allclose(g2, u2[cols], rtol=1e-5, atol=1e-5)
                          and mx.abs(g1).max().item() > 0)

    # all_gather: rows of a batch on each rank, the weight replicated (data parallel).
    def gather_split(w, x):
        return (tp.all_gather(x @ w, group=g) * gather_weight).sum()

    def gather(w, x):
        return ((x @ w) * gather_weight).sum()

    gw, gx = mx.grad(gather_split, argnums=(0, 1))(proj, inputs[rows])
    uw, ux = mx.grad(gather, argnums=(0, 1))(proj, inputs)
    # Each rank's weight gradient covers its rows of the batch: summed, the whole.
    out["all_gather"] = bool(mx.allclose(gx, ux[rows], rtol=1e-5, atol=1e-5)
                             and mx.allclose(tp.all_sum(gw, group=g), uw, rtol=1e-5, atol=1e-5))

    # sum_scatter: the loss of each rank's rows, summed over the ranks.
    def scatter_split(a):
        return tp.all_sum((tp.sum_scatter(a, group=g) * scatter_weight[rows]).sum(), group=g)

    ga = mx.grad(scatter_split)(partials[rank])
    ua = mx.grad(lambda a: ((a + partials[1 - rank]) * scatter_weight).sum())(partials[rank])
    out["sum_scatter"] = bool(mx.allclose(ga, ua, rtol=1e-5, atol=1e-5))
    return out


def transforms(g, rank: int) -> dict:
    """mx.compile and mx.vmap of functions with collectives inside, against the unsplit
    computation: the collectives are primitives in MLX's graph, so both transform them."""
    x = mx.ones((16,)) * (rank + 1)
    out = {}
    compiled = mx.compile(lambda a: tp.all_sum(a * 2, group=g) + 1)
    out["compile"] = same(compiled(x), mx.full((16,), 7.0)) and same(compiled(x * 2), mx.full((16,), 13.0))
    rows = mx.arange(16, dtype=mx.float32).reshape(2, 8) * (rank + 1)
    out["vmap"] = same(mx.vmap(lambda a: tp.all_max(a, group=g))(rows),
                       mx.arange(16, dtype=mx.float32).reshape(2, 8) * 2)
    out["pair_intact"] = bool(mx.array_equal(tp.all_sum(x, group=g), mx.full((16,), 3.0)))
    return out


def main() -> None:
    role, port, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = 0 if role == "leader" else 1
    report = Report()
    try:
        tp.all_sum(mx.zeros((2,)))
        report.check("group=None before init", False)
    except RuntimeError as exc:
        report.check("group=None before init", "call mlx_ds4tp.init(...) first" in str(exc))
    where = {"listen": ("127.0.0.1", port)} if rank == 0 else {"coordinator": ("127.0.0.1", port)}
    kwargs = {"rdma_device": "ucsim"} if transport == "rdma" else {}
    wire = "rdma" if transport == "rdma-fake" else transport
    with tp.init(role=role, transport=wire, timeout=60.0, **where, **kwargs) as g:
        if g.transport != wire:
            raise SystemExit(f"asked for {wire}, got {g.transport}")
        if not isinstance(g, mx.distributed.Group):
            raise SystemExit(f"{g!r} is not an mx.distributed.Group")
        matrix(g, rank, report)
        default_group(rank, report)
        grads = gradients(g, rank)
        transformed = transforms(g, rank)
    print(json.dumps({"rank": rank, "cases": report.cases, "failed": report.failed,
                      "gradients": grads, "transforms": transformed}), flush=True)


if __name__ == "__main__":
    main()
