"""Gate latency benchmark: our transports against the baselines, in one run.

Each record is one JSON object: name, bytes, iters, p50_us, p99_us. ``tcp`` and
``rdma-*`` time the exchange a decode step runs: the C entry point the MLX
backend calls (tp_link_exchange), on the group's link, from numpy buffers. The
baselines are measured in the same run: ``raw-floor`` (a bare write-then-read
of the same bytes on the same socket, no header, no checks) and
``mlx-ring`` (``mx.distributed.all_sum`` on MLX's ring backend, two local
ranks). ``*-all_sum`` records time ``mx.eval(all_sum(x))`` on our group, one
collective per evaluation, the like-for-like comparison with ``mlx-ring``.
``*-in-graph`` records the in-graph gate's own cost: a chain of gates with one
elementwise op between them, evaluated once, less the same chain without the
gates (MLX's own cost per op, in ``op_us``), per gate.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .. import gate_ops
from ..link.config import PairAddress
from ..link.exchange import Exchange, raw_floor
from ..onehost import localpair as _localpair

WARMUP_ITERS = 500
ROUNDS = 10

# Set by `ds4tp bench --plot` in the ranks it spawns: the raw samples ride in
# the records (as "samples_us") and the parent drops them before printing.
EMIT_SAMPLES_ENV = "DS4_TP_BENCH_SAMPLES"


def percentiles(samples_ns: Sequence[int]) -> Dict[str, float]:
    """p50 and p99 of nanosecond samples, in microseconds."""
    arr = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {"p50_us": round(float(np.percentile(arr, 50)), 2), "p99_us": round(float(np.percentile(arr, 99)), 2)}


def record(name: str, nbytes: int, samples_ns: Sequence[int]) -> Dict:
    """One bench record; with EMIT_SAMPLES_ENV set it carries the raw samples too."""
    rec = {"name": name, "bytes": nbytes, "iters": len(samples_ns), **percentiles(samples_ns)}
    if os.environ.get(EMIT_SAMPLES_ENV):
        rec["samples_us"] = [round(x / 1000.0, 2) for x in samples_ns]
    return rec


def _time_interleaved(contenders: Dict[str, object], iters: int) -> Dict[str, List[int]]:
    """Time each contender in ROUNDS alternating blocks, so a drift of the
    machine (frequency, the other rank's scheduling) hits all of them alike:
    the ratios between them are what the bench reports."""
    clock = time.perf_counter_ns
    samples: Dict[str, List[int]] = {name: [] for name in contenders}
    for fn in contenders.values():
        for _ in range(WARMUP_ITERS):
            fn()
    per_round = max(1, iters // ROUNDS)
    for r in range(ROUNDS):
        n = per_round if r < ROUNDS - 1 else iters - per_round * (ROUNDS - 1)
        for name, fn in contenders.items():
            out = samples[name]
            for _ in range(n):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return samples


def bench_group(group: gate_ops.Group, name: str, nbytes: int, iters: int) -> List[Dict]:
    """Time the exchange the backend calls (``name``: tp_link_exchange on the group's own
    link, from numpy buffers), our all_sum on an mx.array, and over TCP the raw floor on
    the same socket. Both ranks run this same sequence, so every exchange has its partner."""
    import mlx.core as mx

    # The link between ranks 0 and 1, the bench's two ranks.
    peer = 1 - group.rank()
    pair = group.link_to(peer)
    send = np.full(nbytes // 4, 1.0 + group.rank(), dtype=np.float32)
    recv = np.empty_like(send)
    exchange = Exchange(group.c_link(peer), send)
    x = mx.array(send)
    contenders = {
        name: lambda: exchange(send, recv),
        f"{name}-all_sum": lambda: mx.eval(gate_ops.all_sum(x, group=group)),
    }
    if pair.rdma is None:
        contenders["raw-floor"] = lambda: raw_floor(pair, send, recv)
    samples = _time_interleaved(contenders, iters)
    exchange(send, recv)
    if not np.all(recv == 2.0 - group.rank()):
        raise RuntimeError(f"{name}: the peer's partial arrived wrong: {recv[:4]}")
    records = [record(label, nbytes, got) for label, got in samples.items()]
    records.append(in_graph_record(group, f"{name}-in-graph", nbytes, iters))
    if pair.rdma is not None and pair.rdma.warmup_ms is not None:
        records[0]["warmup_ms"] = round(pair.rdma.warmup_ms, 2)
    return records


CHAIN = 64


def in_graph_record(group, name: str, nbytes: int, iters: int) -> Dict:
    """The in-graph gate's own cost: chains of CHAIN gates, each followed by one multiply and
    evaluated once, interleaved with the same chains without the gates; per gate, the chain's
    time less the gateless chain's. Both ranks run the same chains, so every gate pairs up."""
    import mlx.core as mx

    start = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(start)

    def chain(gates: bool) -> int:
        x = start
        t0 = time.perf_counter_ns()
        for _ in range(CHAIN):
            # Both ranks hold ones: the sum halved stays one, exactly, gate after gate.
            x = mx.distributed.all_sum(x, group=group) * 0.5 if gates else x * 1.0
        mx.eval(x)
        took = time.perf_counter_ns() - t0
        if float(x[0]) != 1.0:
            raise RuntimeError(f"{name}: the chain's value drifted to {float(x[0])}")
        return took

    rounds = max(ROUNDS, iters // CHAIN)
    for _ in range(4):
        chain(True), chain(False)
    gated, bare = [], []
    for _ in range(rounds):
        gated.append(chain(True) / CHAIN)
        bare.append(chain(False) / CHAIN)
    op_ns = float(np.median(bare))
    rec = record(name, nbytes, [g - op_ns for g in gated])
    rec["op_us"] = round(op_ns / 1000.0, 2)
    rec["chain"] = CHAIN
    return rec


def run_rank(address: PairAddress, transport: str, rdma_device: Optional[str],
             nbytes: int, iters: int, secret=None) -> List[Dict]:
    """One rank of the transport bench (the leader returns the records, the worker none)."""
    group = gate_ops.init(role=address.role, listen=address.listen, coordinator=address.coordinator,
                          transport=transport, rdma_device=rdma_device, secret=secret)
    with group:
        if transport == "rdma" and group.transport != "rdma":
            raise RuntimeError("rdma bench asked for but the group fell back to tcp")
        name = "tcp" if group.transport == "tcp" else f"rdma-{rdma_device or 'ibverbs'}"
        records = bench_group(group, name, nbytes, iters)
    return records if address.role == "leader" else []


def ring_rank(nbytes: int, iters: int) -> List[Dict]:
    """One rank of the mx.distributed ring baseline (environment set by spawn_ring)."""
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    x = mx.full((nbytes // 4,), 1.0 + group.rank(), dtype=mx.float32)

    def all_sum() -> None:
        mx.eval(mx.distributed.all_sum(x, group=group))

    return [record("mlx-ring", nbytes, _time_interleaved({"mlx-ring": all_sum}, iters)["mlx-ring"])]


def spawn_transport(transport: str, rdma_device: Optional[str], nbytes: int, iters: int,
                    timeout: float = 600.0) -> List[Dict]:
    """Both ranks of the transport bench on 127.0.0.1; the leader's records."""
    base = _localpair.rank_command("gate", "--transport", transport, "--bytes", str(nbytes),
                                   "--iters", str(iters))
    if rdma_device:
        base += ["--rdma-device", rdma_device]
    return _localpair.pair_records(base, timeout)


def spawn_ring(nbytes: int, iters: int, timeout: float = 600.0) -> List[Dict]:
    """Both ranks of the mx.distributed ring baseline on 127.0.0.1; rank 0's records."""
    cmd = _localpair.rank_command("ring-gate", "--bytes", str(nbytes), "--iters", str(iters))
    return _localpair.ring_records(cmd, timeout)
