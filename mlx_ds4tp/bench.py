"""Gate latency benchmark: our transports against the baselines, in one run.

Each record is one JSON object: name, bytes, iters, p50_us, p99_us. The
baselines are measured in the same run: ``raw-floor`` (a bare write-then-read
of the same bytes on the same kind of socket, no header, no checks) and
``mlx-ring`` (``mx.distributed.all_sum`` on MLX's ring backend, two local
ranks). ``*-all_sum`` records time our ``all_sum`` on an ``mx.array``, the
like-for-like comparison with ``mlx-ring``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import gate_ops
from . import transport as tr

WARMUP_ITERS = 500


def percentiles(samples_ns: Sequence[int]) -> Dict[str, float]:
    arr = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {"p50_us": round(float(np.percentile(arr, 50)), 2), "p99_us": round(float(np.percentile(arr, 99)), 2)}


def record(name: str, nbytes: int, samples_ns: Sequence[int]) -> Dict:
    return {"name": name, "bytes": nbytes, "iters": len(samples_ns), **percentiles(samples_ns)}


def _time_loop(fn, iters: int) -> List[int]:
    for _ in range(WARMUP_ITERS):
        fn()
    out = [0] * iters
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        fn()
        out[i] = clock() - t0
    return out


def bench_group(group: gate_ops.Group, name: str, nbytes: int, iters: int) -> List[Dict]:
    """Time the bare gate, our all_sum on an mx.array and, on TCP, the floor.
    Both ranks run this same sequence, so every exchange has its partner."""
    import mlx.core as mx

    pair = group.pair
    send = np.full(nbytes // 4, 1.0 + group.rank(), dtype=np.float32)
    recv = np.empty_like(send)
    seq = [10_000_000]

    def gate() -> None:
        seq[0] += 1
        pair.gate(send, recv, seq[0])

    records = [record(name, nbytes, _time_loop(gate, iters))]
    if not np.all(recv == 2.0 - group.rank()):
        raise RuntimeError(f"{name}: the peer's partial arrived wrong: {recv[:4]}")
    x = mx.array(send)

    def all_sum() -> None:
        gate_ops.all_sum(x, group=group)

    records.append(record(f"{name}-all_sum", nbytes, _time_loop(all_sum, iters)))
    if pair.transport == "tcp":

        def raw() -> None:
            tr.raw_exchange(pair.data, send, recv)

        records.append(record("raw-floor", nbytes, _time_loop(raw, iters)))
    return records


def run_rank(role: str, host: str, port: int, transport: str, rdma_device: Optional[str],
             nbytes: int, iters: int) -> List[Dict]:
    """One rank of the transport bench (the leader returns the records)."""
    kwargs = dict(transport=transport, rdma_device=rdma_device)
    if role == "leader":
        group = gate_ops.init(role="leader", listen=(host, port), **kwargs)
    else:
        group = gate_ops.init(role="worker", coordinator=(host, port), **kwargs)
    with group:
        if transport == "rdma" and group.transport != "rdma":
            raise RuntimeError("rdma bench asked for but the group fell back to tcp")
        name = "tcp" if group.transport == "tcp" else f"rdma-{rdma_device or 'ibverbs'}"
        return bench_group(group, name, nbytes, iters)


def ring_rank(nbytes: int, iters: int) -> List[Dict]:
    """One rank of the mx.distributed ring baseline (env set by spawn_ring)."""
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    x = mx.full((nbytes // 4,), 1.0 + group.rank(), dtype=mx.float32)

    def all_sum() -> None:
        mx.eval(mx.distributed.all_sum(x, group=group))

    return [record("mlx-ring", nbytes, _time_loop(all_sum, iters))]


# ============================================================================
# Spawning both ranks on this machine
# ============================================================================


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_pair(cmds: Sequence[Sequence[str]], envs: Sequence[Dict[str, str]], timeout: float) -> List[Dict]:
    """Start both ranks, wait, kill both on any failure; rank 0 prints records."""
    procs = [subprocess.Popen(list(c), env=e, stdout=subprocess.PIPE, stderr=None, text=True)
             for c, e in zip(cmds, envs)]
    try:
        outs = []
        deadline = time.monotonic() + timeout
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
        for p in procs:
            if p.returncode != 0:
                raise RuntimeError(f"bench rank exited with {p.returncode}: {' '.join(p.args)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]


def spawn_transport(transport: str, rdma_device: Optional[str], nbytes: int, iters: int,
                    timeout: float = 600.0) -> List[Dict]:
    port = free_port()
    base = [sys.executable, "-m", "mlx_ds4tp", "bench", "--transport", transport,
            "--bytes", str(nbytes), "--iters", str(iters), "--json"]
    if rdma_device:
        base += ["--rdma-device", rdma_device]
    cmds = [base + ["--role", "leader", "--listen", "127.0.0.1", str(port)],
            base + ["--role", "worker", "--coordinator", "127.0.0.1", str(port)]]
    return _run_pair(cmds, [_child_env(), _child_env()], timeout)


def spawn_ring(nbytes: int, iters: int, timeout: float = 600.0) -> List[Dict]:
    ports = [free_port(), free_port()]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{ports[0]}"], [f"127.0.0.1:{ports[1]}"]], f)
        hostfile = f.name
    try:
        cmd = [sys.executable, "-m", "mlx_ds4tp", "bench", "--ring-rank",
               "--bytes", str(nbytes), "--iters", str(iters), "--json"]
        envs = []
        for rank in (0, 1):
            env = _child_env()
            env.update(MLX_HOSTFILE=hostfile, MLX_RANK=str(rank))
            envs.append(env)
        return _run_pair([cmd, cmd], envs, timeout)
    finally:
        os.unlink(hostfile)
