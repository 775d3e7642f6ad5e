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
import random
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import gate_ops
from . import transport as tr

WARMUP_ITERS = 500


def percentiles(samples_ns: Sequence[int]) -> Dict[str, float]:
    arr = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {"p50_us": round(float(np.percentile(arr, 50)), 2), "p99_us": round(float(np.percentile(arr, 99)), 2)}


# Set by `ds4tp bench --plot` in the ranks it spawns: the raw samples ride in
# the records (as "samples_us") and the parent drops them before printing.
EMIT_SAMPLES_ENV = "DS4_TP_BENCH_SAMPLES"


def record(name: str, nbytes: int, samples_ns: Sequence[int]) -> Dict:
    rec = {"name": name, "bytes": nbytes, "iters": len(samples_ns), **percentiles(samples_ns)}
    if os.environ.get(EMIT_SAMPLES_ENV):
        rec["samples_us"] = [round(x / 1000.0, 2) for x in samples_ns]
    return rec


def plot_histograms(records: List[Dict], path: str) -> None:
    """One latency histogram per transport, on shared log-spaced bins."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'mlx-ds4tp[plot]'") from None
    with_samples = [r for r in records if r.get("samples_us")]
    if not with_samples:
        raise RuntimeError("no latency samples to plot")
    hi = max(np.percentile(r["samples_us"], 99.9) for r in with_samples)
    lo = min(min(r["samples_us"]) for r in with_samples)
    bins = np.geomspace(max(lo, 0.1), max(hi, lo * 2), 80)
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in with_samples:
        ax.hist(r["samples_us"], bins=bins, histtype="step", linewidth=1.5,
                label=f"{r['name']} (p50 {r['p50_us']} us, p99 {r['p99_us']} us)")
    ax.set_xscale("log")
    ax.set_xlabel(f"round trip of one {with_samples[0]['bytes']}-byte exchange (us)")
    ax.set_ylabel("count")
    ax.set_title("ds4tp gate latency per transport")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ROUNDS = 10


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
    """Time the bare gate, our all_sum on an mx.array and the baseline of the
    transport (TCP: the raw floor; RDMA: sending from a registered buffer
    instead of copying into the slab). Both ranks run this same sequence, so
    every exchange has its partner."""
    import mlx.core as mx

    pair = group.pair
    send = np.full(nbytes // 4, 1.0 + group.rank(), dtype=np.float32)
    recv = np.empty_like(send)
    x = mx.array(send)
    contenders = {
        name: lambda: pair.gate(send, recv),
        f"{name}-all_sum": lambda: gate_ops.all_sum(x, group=group),
    }
    if pair.rdma is not None:
        # The alternative to copying the partial into the registered slab:
        # send straight from a registered buffer (an MLX array's own memory
        # would need a registration per new buffer).
        send_registered = send.copy()
        pair.rdma.register(send_registered)
        contenders[f"{name}-registered"] = lambda: pair.gate(send_registered, recv)
    else:
        contenders["raw-floor"] = lambda: tr.raw_exchange(pair.tcp, send, recv)
    samples = _time_interleaved(contenders, iters)
    pair.gate(send, recv)
    if not np.all(recv == 2.0 - group.rank()):
        raise RuntimeError(f"{name}: the peer's partial arrived wrong: {recv[:4]}")
    records = [record(label, nbytes, got) for label, got in samples.items()]
    if pair.rdma is not None and pair.rdma.warmup_ms is not None:
        records[0]["warmup_ms"] = round(pair.rdma.warmup_ms, 2)
    return records


def run_rank(role: str, host: str, port: int, transport: str, rdma_device: Optional[str],
             nbytes: int, iters: int, secret=None) -> List[Dict]:
    """One rank of the transport bench (the leader returns the records)."""
    kwargs = dict(transport=transport, rdma_device=rdma_device, secret=secret)
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

    return [record("mlx-ring", nbytes, _time_interleaved({"mlx-ring": all_sum}, iters)["mlx-ring"])]


# ============================================================================
# Spawning both ranks on this machine
# ============================================================================


_PORTS_HANDED_OUT: set = set()
_PORT_RNG = random.Random()


def _ephemeral_range() -> Tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535  # the IANA range macOS uses


def free_port(host: str = "127.0.0.1") -> int:
    """A port to listen on a moment later. Chosen below the kernel's ephemeral
    range: a port from inside it can be taken, between now and the listen, as
    the local port of an outgoing connection (ranks starting side by side
    dial constantly), and the leader would then fail with EADDRINUSE."""
    low, _ = _ephemeral_range()
    lo, hi = max(1024, low - 12000), low
    for _ in range(500):
        port = _PORT_RNG.randrange(lo, hi)
        if port in _PORTS_HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _PORTS_HANDED_OUT.add(port)
        return port
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


# ============================================================================
# Model decode throughput: single process, our pair, mlx-lm over MLX's ring
# ============================================================================

BENCH_PROMPT = "The quick brown fox jumps over the lazy dog because"


def _tok_record(name: str, tokens: List[int], seconds: float, reference: Optional[List[int]]) -> Dict:
    return {"name": name, "tok_s": round((len(tokens) - 1) / seconds, 2) if seconds else 0.0,
            "tokens_match": reference is None or tokens == reference, "tokens": len(tokens)}


def single_record(path: str, max_tokens: int) -> Dict:
    """No early stop at EOS: every contender decodes the same count."""
    from mlx_lm.utils import load

    from .lockstep import greedy_generate

    model, tokenizer = load(path)
    prompt = list(tokenizer.encode(BENCH_PROMPT))
    greedy_generate(model, prompt, 4)  # warm the kernels
    tokens, seconds = greedy_generate(model, prompt, max_tokens)
    rec = _tok_record("single", tokens, seconds, None)
    rec["token_ids"] = tokens
    return rec


def ring_model_rank(path: str, max_tokens: int) -> List[Dict]:
    """One rank of mlx-lm's own model.shard() over MLX's ring backend."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from .lockstep import greedy_generate

    group = mx.distributed.init(backend="ring", strict=True)
    model, tokenizer = load(path, lazy=True)
    model.shard(group)
    mx.eval(model.parameters())
    prompt = list(tokenizer.encode(BENCH_PROMPT))
    greedy_generate(model, prompt, 4)
    tokens, seconds = greedy_generate(model, prompt, max_tokens)
    rec = _tok_record("mlx-lm-ring", tokens, seconds, None)
    rec["token_ids"] = tokens
    return [rec] if group.rank() == 0 else []


def spawn_ring_model(path: str, max_tokens: int, timeout: float = 1200.0) -> Dict:
    ports = [free_port(), free_port()]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{ports[0]}"], [f"127.0.0.1:{ports[1]}"]], f)
        hostfile = f.name
    try:
        cmd = [sys.executable, "-m", "mlx_ds4tp", "bench", "--ring-rank", "--model", path,
               "--max-tokens", str(max_tokens), "--json"]
        envs = []
        for rank in (0, 1):
            env = _child_env()
            env.update(MLX_HOSTFILE=hostfile, MLX_RANK=str(rank))
            envs.append(env)
        return _run_pair([cmd, cmd], envs, timeout)[0]
    finally:
        os.unlink(hostfile)


CEILING = "tp2-compute-ceiling"


class GatelessGroup:
    """A two-rank group whose gates do nothing: all_sum hands the local partial back.

    For the compute ceiling only. Each rank still runs exactly its half of every matmul, so
    two of these side by side decode as fast as the pair could with a transport that takes zero
    time and ranks that never wait for each other. A real pair meets at every gate, so it also
    waits there whenever the other rank's half of a layer ran a little slower. Its tokens are
    meaningless (the halves are never summed).
    """

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2

    def all_sum(self, x):
        return x

    def all_gather(self, x):
        import mlx.core as mx

        return mx.concatenate([x, x], axis=0)


def ceiling_rank(role: str, port: int, path: str, max_tokens: int) -> List[Dict]:
    """One rank of the compute ceiling: its half of the model decoding with gateless gates,
    started together with the other rank so the two compete for the cores as a real pair does.
    A TCP pair is used only as the start line and to agree on the slower rank's time."""
    from .lockstep import greedy_generate
    from .model_split import load_split

    where = {"listen": ("127.0.0.1", port)} if role == "leader" else {"coordinator": ("127.0.0.1", port)}
    with gate_ops.init(role=role, transport="tcp", **where) as group:
        model, tokenizer = load_split(path, GatelessGroup(group.rank()))
        prompt = list(tokenizer.encode(BENCH_PROMPT))
        greedy_generate(model, prompt, 4)
        start_line = np.zeros(1, np.float64)
        group.pair.gate(start_line, np.empty_like(start_line))
        tokens, seconds = greedy_generate(model, prompt, max_tokens)
        mine, theirs = np.array([seconds]), np.empty(1)
        group.pair.gate(mine, theirs)
    rec = _tok_record(CEILING, tokens, max(seconds, float(theirs[0])), None)
    rec["tokens_match"] = None  # the halves are never summed: no tokens to compare
    rec["gates"] = "skipped: the pair's compute alone, ranks never waiting for each other"
    return [rec] if role == "leader" else []


def spawn_ceiling(path: str, max_tokens: int, timeout: float = 1200.0) -> Dict:
    port = free_port()
    base = [sys.executable, "-m", "mlx_ds4tp", "bench", "--ceiling-rank", "--model", path,
            "--max-tokens", str(max_tokens), "--json"]
    cmds = [base + ["--role", "leader", "--listen", "127.0.0.1", str(port)],
            base + ["--role", "worker", "--coordinator", "127.0.0.1", str(port)]]
    return _run_pair(cmds, [_child_env(), _child_env()], timeout)[0]


def spawn_tp2(path: str, transport: str, rdma_device: Optional[str], max_tokens: int,
              timeout: float = 1200.0) -> Dict:
    """Our pair through `ds4tp run`, both ranks on 127.0.0.1."""
    from .pair_run import run_local_pair

    result = run_local_pair(Path(path), BENCH_PROMPT, max_tokens, transport, rdma_device,
                            extra=["--bench-no-eos"], quiet=True, timeout=timeout)
    if result is None:
        raise RuntimeError(f"the tp2-{transport} pair failed (its errors are above)")
    name = "tp2-tcp" if transport == "tcp" else f"tp2-rdma-{rdma_device or 'ibverbs'}"
    return {"name": name, "tok_s": round(result["decode_tok_s"], 2), "tokens": len(result["tokens"]),
            "token_ids": result["tokens"], "gate_p50_us": round(result["gate_p50_us"], 1)}


def _model_contenders(path: str, transport: str, rdma_device: Optional[str],
                      max_tokens: int) -> Dict[str, Callable[[], Dict]]:
    contenders: Dict[str, Callable[[], Dict]] = {"single": lambda: single_record(path, max_tokens)}
    if transport in ("tcp", "all"):
        contenders["tp2-tcp"] = lambda: spawn_tp2(path, "tcp", None, max_tokens)
    if transport in ("rdma", "all"):
        device = rdma_device or "ucsim"
        contenders[f"tp2-rdma-{device}"] = lambda: spawn_tp2(path, "rdma", device, max_tokens)
    contenders["mlx-lm-ring"] = lambda: spawn_ring_model(path, max_tokens)
    # Not a contender (its tokens are meaningless): the bound every tp2 figure sits under.
    contenders[CEILING] = lambda: spawn_ceiling(path, max_tokens)
    return contenders


def model_bench(path: str, transport: str, rdma_device: Optional[str], max_tokens: int,
                rounds: int = 3) -> List[Dict]:
    """Decode tok/s of every contender, run `rounds` times in rotating order so a slow spell
    of the machine falls on all of them alike; each record gives the median and every round."""
    contenders = _model_contenders(path, transport, rdma_device, max_tokens)
    names = list(contenders)
    runs: Dict[str, List[Dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(contenders[name]())
    reference = runs["single"][0]["token_ids"]
    records = []
    for name in names:
        got = runs[name]
        rec = dict(got[0])
        rec["tok_s_rounds"] = [g["tok_s"] for g in got]
        rec["tok_s"] = round(statistics.median(rec["tok_s_rounds"]), 2)
        if "gate_p50_us" in rec:
            rec["gate_p50_us"] = round(statistics.median(g["gate_p50_us"] for g in got), 1)
        if name != CEILING:
            rec["tokens_match"] = all(g["token_ids"] == reference for g in got)
        rec.pop("token_ids", None)
        records.append(rec)
    return records
