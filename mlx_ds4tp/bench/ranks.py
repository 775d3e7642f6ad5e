"""`ds4tp bench --ranks N[,N...]`: all_sum over a group of N ranks, all on this machine, at a
decode gate's size (16 KiB) and a prefill chunk's (1 MiB): ours over tcp and over the
emulated RDMA device (ucsim), and MLX's own ring backend (mx.distributed, N local processes
from a hostfile on 127.0.0.1) at the same N, in the same run.

Each record: name ("tcp", "rdma-ucsim" or "mlx-ring"), ranks, bytes, iters, p50_us, p99_us:
rank 0's time for ``mx.eval(all_sum(x))``, one collective per evaluation, after a warm-up;
every rank checks the sum it got. N = 2 is a pair (today's two-rank group); N > 2 a mesh, and
with ring=True (`--ring`) the same mesh again running over its ring's links alone ("tcp-ring",
"rdma-ucsim-ring": topology ring, collectives/topology.py), so both are timed in one run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

from .. import gate_ops
from ..collectives.topology import MIN_RING_SIZE
from ..link.config import TOPOLOGY_ENV
from ..onehost import localpair
from .gates import percentiles

SIZES = (16384, 1 << 20)
WARMUP_ITERS = 20
# A 1 MiB all_sum takes some 50x a 16 KiB one: it runs this many times fewer.
LARGE_FEWER = 10


def _time_all_sum(all_sum: Callable, rank: int, size: int, iters: int, name: str) -> List[Dict]:
    """rank's timings of mx.eval(all_sum(x)) at each of SIZES; the sum checked."""
    import mlx.core as mx

    records = []
    want = float(sum(range(1, size + 1)))
    for nbytes in SIZES:
        count = iters if nbytes <= 65536 else max(WARMUP_ITERS, iters // LARGE_FEWER)
        x = mx.full((nbytes // 4,), 1.0 + rank, dtype=mx.float32)
        mx.eval(x)
        for _ in range(WARMUP_ITERS):
            mx.eval(all_sum(x))
        samples = []
        for _ in range(count):
            t0 = time.perf_counter_ns()
            y = all_sum(x)
            mx.eval(y)
            samples.append(time.perf_counter_ns() - t0)
        got = float(y[-1].item())
        if got != want:
            raise RuntimeError(f"{name} at {size} ranks: all_sum gave {got}, want {want}")
        records.append({"name": name, "ranks": size, "bytes": nbytes, "iters": count,
                        **percentiles(samples)})
    return records


def mesh_rank(rank: int, size: int, port: int, transport: str, rdma_device: Optional[str],
              iters: int) -> List[Dict]:
    """One rank of our group of `size` on 127.0.0.1:port (rank 0's records, the others none)."""
    where = ({"role": "leader", "listen": ("127.0.0.1", port)} if rank == 0
             else {"role": "worker", "coordinator": ("127.0.0.1", port),
                   "rank": rank})
    group = gate_ops.init(transport=transport, rdma_device=rdma_device, size=size, **where)
    with group:
        if group.transport != transport:
            raise RuntimeError(f"asked for {transport}, the group runs {group.transport}")
        name = "tcp" if transport == "tcp" else f"rdma-{rdma_device or 'ibverbs'}"
        name += "-ring" if group.ring else ""
        records = _time_all_sum(lambda x: gate_ops.all_sum(x, group=group), group.rank(), size, iters, name)
    return records if rank == 0 else []


def ring_rank(iters: int) -> List[Dict]:
    """One rank of MLX's ring at the hostfile's size (MLX_HOSTFILE, MLX_RANK set)."""
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    records = _time_all_sum(lambda x: mx.distributed.all_sum(x, group=group), group.rank(),
                            group.size(), iters, "mlx-ring")
    return records if group.rank() == 0 else []


def spawn_mesh(size: int, transport: str, rdma_device: Optional[str], iters: int,
               timeout: float = 900.0, topology: str = "auto") -> List[Dict]:
    """Our group of `size` ranks here, over the links `topology` says; rank 0's records."""
    port = str(localpair.free_port())
    device = ["--rdma-device", rdma_device] if rdma_device else []
    cmds = [localpair.rank_command("mesh-gate", "--rank", str(r), "--size", str(size), "--port", port,
                                   "--transport", transport, "--iters", str(iters), *device)
            for r in range(size)]
    envs = [localpair.child_env({TOPOLOGY_ENV: topology})] * size
    return localpair.json_records(localpair.run_ranks(cmds, envs, timeout=timeout)[0])


def spawn_ring(size: int, iters: int, timeout: float = 900.0) -> List[Dict]:
    """MLX's ring of `size` ranks here (a hostfile of one free port per rank); rank 0's records."""
    ports = [localpair.free_port() for _ in range(size)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], f)
    try:
        cmd = localpair.rank_command("ring-ranks", "--iters", str(iters))
        envs = [localpair.child_env({"MLX_HOSTFILE": f.name, "MLX_RANK": str(r)}) for r in range(size)]
        return localpair.json_records(localpair.run_ranks([cmd] * size, envs, timeout=timeout)[0])
    finally:
        os.unlink(f.name)


def ranks_bench(sizes: Sequence[int], transports: Sequence[str], rdma_device: Optional[str],
                iters: int, ring: bool = False) -> List[Dict]:
    """Every record of the bench: for each N, ours on each transport (with `ring`, over the
    full mesh and then over its ring alone, from N = 3), then MLX's ring."""
    records: List[Dict] = []
    for size in sizes:
        for transport in transports:
            device = (rdma_device or "ucsim") if transport == "rdma" else None
            records += spawn_mesh(size, transport, device, iters, topology="mesh")
            if ring and size >= MIN_RING_SIZE:
                records += spawn_mesh(size, transport, device, iters, topology="ring")
        records += spawn_ring(size, iters)
    return records


def ratios(records: List[Dict]) -> List[str]:
    """One line per (N, size, ours): MLX's ring p50 over ours (> 1: ours is faster)."""
    ring = {(r["ranks"], r["bytes"]): r for r in records if r["name"] == "mlx-ring"}
    lines = []
    for rec in records:
        base = ring.get((rec["ranks"], rec["bytes"]))
        if rec["name"] == "mlx-ring" or base is None:
            continue
        lines.append(f"N={rec['ranks']} {_size(rec['bytes']):>7} {rec['name']:>11}: p50 "
                     f"{rec['p50_us']:9.1f} us vs mlx-ring {base['p50_us']:9.1f} us: "
                     f"{base['p50_us'] / max(rec['p50_us'], 1e-9):6.2f}x faster")
    return lines


def ring_ratios(records: List[Dict]) -> List[str]:
    """One line per (N, size, transport) timed both ways: the full mesh's p50 over the ring's."""
    mesh = {(r["ranks"], r["bytes"], r["name"]): r for r in records}
    lines = []
    for rec in records:
        base = mesh.get((rec["ranks"], rec["bytes"], rec["name"][:-len("-ring")]))
        if not rec["name"].endswith("-ring") or base is None:
            continue
        lines.append(f"N={rec['ranks']} {_size(rec['bytes']):>7} {rec['name']:>16}: p50 "
                     f"{rec['p50_us']:9.1f} us vs the full mesh {base['p50_us']:9.1f} us: "
                     f"{base['p50_us'] / max(rec['p50_us'], 1e-9):6.2f}x")
    return lines


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def ranks_report(sizes: Sequence[int], transports: Sequence[str], rdma_device: Optional[str],
                 iters: int, as_json: bool, ring: bool = False) -> int:
    """Run the bench and print its records (a table, or JSON lines) and the ratios."""
    records = ranks_bench(sizes, transports, rdma_device, iters, ring)
    for rec in records:
        if as_json:
            print(json.dumps(rec), flush=True)
        else:
            print(f"N={rec['ranks']}  {rec['name']:>16}  {_size(rec['bytes']):>7}  p50 "
                  f"{rec['p50_us']:9.1f} us  p99 {rec['p99_us']:9.1f} us  ({rec['iters']} iters)",
                  flush=True)
    if not as_json:
        for line in ratios(records) + ring_ratios(records):
            print(line, flush=True)
    return 0


def check_sizes(text: str) -> List[int]:
    """--ranks "2,3,4" as [2, 3, 4]; a ValueError naming the value and the range otherwise."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(not 2 <= n <= 8 for n in sizes):
        raise ValueError(f"--ranks {text!r}: give group sizes 2 to 8, comma separated, e.g. 2,3,4")
    return sizes

