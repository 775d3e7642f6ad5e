"""One rank of a mesh of N (tests/test_mesh.py runs N of these), run as a script:

    mesh_child.py RANK PORT TRANSPORT SIZE CASE [ARG]

RANK 0 leads (listens on PORT), the others dial it and ask for RANK. TRANSPORT: tcp or rdma
(the emulated device, ucsim). CASE:
  exact   every collective exact and identical on every rank, float32/float16/bfloat16,
          1 element to 4 MiB (each rank checks against the rank-order reference it builds
          from every rank's seeded partial: equal to it on every rank is identical on all)
  matrix  MLX's collective test matrix (tests/collective_child.py's, for N ranks), split
          subgroups, mx.compile and mx.grad through the collectives
  shard   mlx-lm's own shard() of a small random llama (heads divisible by 4): logits and
          greedy tokens against the unsplit model
  die     a stream of collectives; rank ARG exits in the middle (writing when to ARG file
          "died.txt" beside its cwd), the others report what they raised and when
  links   each link's transport and queue pair builds
  stats   decode gates' statistics over every link; a split with every rank in reversed order;
          then the closed group's refusal
Prints one JSON object as its last stdout line.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mlx_ds4tp as tp  # noqa: E402

FLOATS = [mx.float32, mx.float16, mx.bfloat16]
DTYPES = [mx.int8, mx.uint8, mx.int32, mx.uint32, mx.float32, mx.float16, mx.bfloat16]
SHAPES = [(), (7,), (10,), (1024,), (1024, 1024)]
REDUCTIONS = {"all_sum": (tp.all_sum, mx.add), "all_max": (tp.all_max, mx.maximum),
              "all_min": (tp.all_min, mx.minimum)}


def partial(rank: int, dtype, shape, salt: int) -> mx.array:
    """Rank `rank`'s partial: every rank can make every rank's (same seed)."""
    name = str(dtype).split(".")[-1]
    rng = np.random.default_rng([rank, DTYPES.index(dtype), len(shape), int(np.prod(shape)), salt])
    if dtype in FLOATS:
        x = mx.array((rng.standard_normal(shape) * 8).astype(np.float32)).astype(dtype)
    else:
        info = np.iinfo(np.dtype(name))
        x = mx.array(rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=np.dtype(name)))
    mx.eval(x)
    return x


def same(got: mx.array, want: mx.array) -> bool:
    mx.eval(got, want)
    return (got.dtype == want.dtype and got.shape == want.shape
            and bytes(memoryview(got)) == bytes(memoryview(want)))


def in_order(combine, parts):
    """The ranks' partials combined in rank order, ((p0 . p1) . p2) ..., as the mesh does."""
    return functools.reduce(combine, parts)


class Report:
    def __init__(self) -> None:
        self.cases = 0
        self.failed: list = []

    def check(self, name: str, ok: bool) -> None:
        self.cases += 1
        if not ok:
            self.failed.append(name)


def collectives(g, report: Report, dtype, shape, salt: int, label: str = "") -> None:
    """Every collective of g on one dtype and shape, against the rank-order reference."""
    n, rank = g.size(), g.rank()
    parts = [partial(r, dtype, shape, salt) for r in range(n)]
    mine = parts[rank]
    case = f"{label}{dtype} {shape}"
    for name, (ours, combine) in REDUCTIONS.items():
        report.check(f"{name} {case}", same(ours(mine, group=g), in_order(combine, parts)))
    want = mx.stack(parts) if not shape else mx.concatenate(parts, axis=0)
    report.check(f"all_gather {case}", same(tp.all_gather(mine, group=g), want))
    if shape and shape[0] % n == 0:
        rows = shape[0] // n
        want = in_order(mx.add, parts)[rank * rows:(rank + 1) * rows]
        report.check(f"sum_scatter {case}", same(tp.sum_scatter(mine, group=g), want))
    else:
        try:
            tp.sum_scatter(mine, group=g)
            report.check(f"sum_scatter refuses {case}", False)
        except ValueError as exc:
            report.check(f"sum_scatter refuses {case}", f"divisible by the group size {n}" in str(exc))
    # send/recv around the ring: each rank sends to the next, receives from the one before.
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:
        ok = same(tp.send(mine, nxt, group=g), mine)
        ok = same(tp.recv(shape, dtype, prev, group=g), parts[prev]) and ok
    else:
        ok = same(tp.recv_like(mine, prev, group=g), parts[prev])
        ok = same(tp.send(mine, nxt, group=g), mine) and ok
    report.check(f"send/recv {case}", ok)


def exact(g) -> dict:
    report = Report()
    for dtype in FLOATS:
        item = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}[dtype]
        # 1 element, odd counts, both sides of the 64 KiB switch, an uneven reduce-scatter,
        # 1 MiB and 4 MiB.
        counts = [1, 7, 4096, 65536 // item, 65536 // item + 3, (1 << 20) // item + 5, (4 << 20) // item]
        for count in counts:
            parts = [partial(r, dtype, (count,), 3) for r in range(g.size())]
            case = f"{dtype} {count * item} bytes"
            report.check(f"all_sum {case}", same(tp.all_sum(parts[g.rank()], group=g), in_order(mx.add, parts)))
            report.check(f"all_max {case}",
                         same(tp.all_max(parts[g.rank()], group=g), in_order(mx.maximum, parts)))
            report.check(f"all_gather {case}",
                         same(tp.all_gather(parts[g.rank()], group=g), mx.concatenate(parts)))
    # A decode step's gates: the same signature again and again (over RDMA the window stays
    # armed and every peer's block is posted before any is awaited), new values each time.
    for salt in range(10, 30):
        parts = [partial(r, mx.float32, (4096,), salt) for r in range(g.size())]
        report.check(f"steady all_sum {salt}", same(tp.all_sum(parts[g.rank()], group=g), in_order(mx.add, parts)))
    return {"cases": report.cases, "failed": report.failed}


def matrix(g) -> dict:
    report = Report()
    for dtype in DTYPES:
        for shape in SHAPES:
            collectives(g, report, dtype, shape, 0)
    # Subgroups over the same links: even and odd ranks, ordered by descending rank.
    sub = g.split(g.rank() % 2, key=g.size() - g.rank())
    evens = list(range(0, g.size(), 2))
    members = evens if g.rank() % 2 == 0 else [r for r in range(g.size()) if r % 2]
    report.check("split size", sub.size() == len(members))
    report.check("split rank", sub.rank() == sorted(members, reverse=True).index(g.rank()))
    for dtype in FLOATS:
        if sub.size() > 1:
            collectives(sub, report, dtype, (12, 3), 1, label="split ")
    # The whole group still runs after its subgroups did.
    collectives(g, report, mx.float32, (24,), 2, label="after split ")
    compiled = mx.compile(lambda a: tp.all_sum(a * 2, group=g) + 1)
    x = mx.ones((16,)) * (g.rank() + 1)
    total = sum(range(1, g.size() + 1))
    report.check("compile", same(compiled(x), mx.full((16,), 2.0 * total + 1)))

    def loss(w):
        return (tp.all_sum(w * (g.rank() + 1), group=g) ** 2).sum()

    grad = mx.grad(loss)(mx.ones((4,)))
    report.check("grad", same(grad, mx.full((4,), 2.0 * total * (g.rank() + 1))))
    return {"cases": report.cases, "failed": report.failed}


def _llama(seed: int):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                           rms_norm_eps=1e-6, vocab_size=256, max_position_embeddings=128,
                           rope_theta=10000.0, tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _greedy(model, prompt, steps: int):
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(mx.array([tokens]))
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return tokens[len(prompt):]


def shard(g) -> dict:
    prompt = [1, 5, 9, 42, 7, 3, 100, 200]
    reference = _llama(0)
    model = _llama(0)
    model.shard(g)
    want, got = reference(mx.array([prompt])), model(mx.array([prompt]))
    mx.eval(want, got)
    ref = np.array(want, dtype=np.float64)
    rel = float(np.max(np.abs(np.array(got, dtype=np.float64) - ref)) / np.max(np.abs(ref)))
    gathered = np.array(tp.all_gather(got.reshape(1, -1), group=g))
    return {"max_rel": rel, "identical_on_all": bool(all(np.array_equal(gathered[0], row) for row in gathered)),
            "tokens_equal": _greedy(model, prompt, 6) == _greedy(reference, prompt, 6)}


def die(g, victim: int) -> dict:
    x = mx.ones((4096,))
    for _ in range(20):
        mx.eval(tp.all_sum(x, group=g))
    if g.rank() == victim:
        with open("died.txt", "w") as f:
            f.write(repr(time.time()))
        os._exit(3)
    error, when = None, None
    try:
        for _ in range(100000):  # the stream: its evaluated graphs meet the dead rank
            y = x
            for _ in range(4):
                y = tp.all_sum(y, group=g) * 0.25
            mx.eval(y)
    except RuntimeError as exc:
        error, when = str(exc), time.time()
    alive = float(mx.sum(mx.ones(3)).item())
    return {"error": error, "raised_at": when, "alive": alive}


def stats(g) -> dict:
    report = Report()
    x = mx.ones((4096,))
    before = g.gates()
    for _ in range(30):
        mx.eval(tp.all_sum(x, group=g))
    p50, p99 = g.gate_latency_us()
    gates, seconds = g.gates() - before, g.exchange_seconds()
    # Every rank in one subgroup, in reverse rank order: a group of two splits as any other.
    sub = g.split(0, key=g.size() - g.rank())
    report.check("split size", sub.size() == g.size())
    report.check("split rank", sub.rank() == g.size() - 1 - g.rank())
    for dtype in FLOATS:
        collectives(sub, report, dtype, (12, 3), 4, label="reversed ")
    g.close()
    try:
        mx.eval(tp.all_sum(x, group=g))
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    return {"gates": gates, "p50": p50, "p99": p99, "seconds": seconds,
            "refused": refused, "cases": report.cases, "failed": report.failed}


def join_from_argv():
    """(the group, the case) of a child started as `RANK PORT TRANSPORT SIZE CASE`."""
    rank, port, transport, size, case = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                         int(sys.argv[4]), sys.argv[5])
    where = ({"role": "leader", "listen": ("127.0.0.1", port)} if rank == 0
             else {"role": "worker", "coordinator": ("127.0.0.1", port), "rank": rank})
    kw = {"rdma_device": "ucsim"} if transport == "rdma" else {}
    g = tp.init(transport=transport, timeout=float(os.environ.get("CHILD_TIMEOUT", 60)), size=size,
                **where, **kw)
    if g.rank() != rank or g.size() != size or g.transport != transport:
        raise SystemExit(f"asked for rank {rank} of {size} over {transport}, got {g!r}")
    return g, case


def main() -> None:
    g, case = join_from_argv()
    if case == "exact":
        result = exact(g)
    elif case == "matrix":
        result = matrix(g)
    elif case == "shard":
        result = shard(g)
    elif case == "die":
        result = die(g, int(sys.argv[6]))
    elif case == "stats":
        result = stats(g)
    else:
        result = {"links": {str(k): v for k, v in g.links().items()}}
    result["rank"] = g.rank()
    print(json.dumps(result), flush=True)
    g.close()


if __name__ == "__main__":
    main()
