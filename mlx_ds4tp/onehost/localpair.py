"""Every rank on this machine: a free port, the child environment, the rank
processes (two, or N) started and waited for together (a pair, a mesh, or
MLX's ring with its hostfile). The bench, the demo, doctor and the tests
share these.

Only the standard library: this sits beside the tools, below nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from ..base.log import log

# The module a spawned rank runs (`python -m mlx_ds4tp.cli.rank ...`).
RANK_MODULE = "mlx_ds4tp.cli.rank"
# Where this package is imported from: a child must import the same copy, even
# when it is a checkout nobody installed.
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
# How long a killed rank gets to be reaped before we stop waiting for it.
_REAP_SEC = 10.0

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
    """A port to listen on a moment later.

    Chosen below the kernel's ephemeral range: a port from inside it can be
    taken, between now and the listen, as the local port of an outgoing
    connection (ranks starting side by side dial constantly), and the leader
    would then fail with EADDRINUSE. A port is handed out once per process.
    """
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


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment for a rank: unbuffered output (a rank's lines
    arrive as they are written), this package first on PYTHONPATH, then `extra`."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    path = env.get("PYTHONPATH", "")
    if _PACKAGE_PARENT not in path.split(os.pathsep):
        env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + path if path else "")
    if extra:
        env.update(extra)
    return env


def rank_command(*args: str) -> List[str]:
    """The command line of a spawned rank: the internal entry point, not the public CLI."""
    return [sys.executable, "-m", RANK_MODULE, *args]


def pair_commands(base: Sequence[str], port: int, ranks: Optional[int] = None) -> List[List[str]]:
    """`base` for the leader (listening on 127.0.0.1:port) and for each of its workers (dialing
    it): one, or with `ranks` ranks-1 and --ranks N on the leader's (the workers learn N from
    it, as a user's do)."""
    sized = list(base) + (["--ranks", str(ranks)] if ranks else [])
    return [sized + ["--role", "leader", "--listen", "127.0.0.1", str(port)]] + \
        [list(base) + ["--role", "worker", "--coordinator", "127.0.0.1", str(port)]
         for _ in range((ranks or 2) - 1)]


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: the CPUs it may use (None: any) and what its environment adds."""

    cpus: Tuple[Optional[FrozenSet[int]], ...] = (None, None)
    env: Tuple[Tuple[str, str], ...] = ()


ANYWHERE = Placement()
# Two different Macs stood in for on one Linux machine of two cores or more: each rank alone on
# a core, the worker's shared with a process that never sleeps, so the worker computes at about
# half the leader's speed.
SLOW_WORKER = Placement(cpus=(frozenset({0}), frozenset({1})))


@contextlib.contextmanager
def busy_core(cpu: int) -> Iterator[None]:
    """A process that keeps `cpu` busy (a slower Mac's stand-in) while the block runs."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not hasattr(os, "sched_setaffinity") or cpu not in allowed:
        raise RuntimeError(f"cannot pin a process to CPU {cpu} here (this process may use "
                           f"{allowed or 'no pinning'}); the slow-worker placement needs Linux and "
                           f"CPUs 0 and 1")
    # It spins only while its parent lives: a bench killed by a signal (no finally runs) must
    # not leave a core busy for good behind it. The parent's pid is given, not read at start: a
    # parent killed before the child's interpreter is up would otherwise be taken for pid 1.
    spin = f"import os\nwhile os.getppid() == {os.getpid()}: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        yield
    finally:
        reap(busy)


def _pinner(cpus: Optional[FrozenSet[int]]) -> Optional[Callable[[], None]]:
    """A child's preexec_fn that pins it to `cpus` (None when it runs anywhere)."""
    if not cpus:
        return None
    if not hasattr(os, "sched_setaffinity"):  # macOS: no CPU pinning to ask for
        raise ValueError(f"cpus={sorted(cpus)}: pinning a rank to CPUs needs Linux "
                         "(os.sched_setaffinity); run it with Placement() (ANYWHERE) here")
    return lambda: os.sched_setaffinity(0, cpus)


def run_ranks(cmds: Sequence[Sequence[str]], envs: Optional[Sequence[Dict[str, str]]] = None,
              timeout: float = 600.0, stdout: str = "capture",
              cpus: Sequence[Optional[FrozenSet[int]]] = ()) -> List[str]:
    """Start every rank, wait for all of them, and return their stdout texts.

    stdout: "capture" (returned), "inherit" (this process's stdout; returned as
    "") or "discard". Stderr always goes to this process's stderr, so a rank's
    error is seen as it happens. The first rank to fail gets the others killed
    at once (a lone survivor would only wait for its peer); so does the timeout.
    cpus: each rank's CPUs (Placement.cpus); none given: any.
    Raises RuntimeError naming the rank, its exit status and its command.
    """
    if stdout not in ("capture", "inherit", "discard"):
        raise ValueError(f"stdout={stdout!r}: use 'capture', 'inherit' or 'discard'")
    envs = list(envs) if envs is not None else [child_env() for _ in cmds]
    if len(envs) != len(cmds):
        raise ValueError(f"{len(cmds)} commands but {len(envs)} environments")
    target = {"capture": subprocess.PIPE, "inherit": None, "discard": subprocess.DEVNULL}[stdout]
    procs: List[subprocess.Popen] = []
    texts: List[List[str]] = [[] for _ in cmds]
    readers: List[threading.Thread] = []
    # Before any rank starts: a placement this OS cannot pin is refused with none left running.
    pinners = [_pinner(cpus[i] if i < len(cpus) else None) for i in range(len(cmds))]
    try:
        for i, (cmd, env) in enumerate(zip(cmds, envs)):
            p = subprocess.Popen(list(cmd), env=env, stdout=target, stderr=None, text=True,
                                 preexec_fn=pinners[i])
            procs.append(p)
            if target is subprocess.PIPE:
                # One reader per rank: a rank blocked on a full pipe would
                # never exit, and its peer would wait on it.
                t = threading.Thread(target=lambda p=p, out=texts[i]: out.append(p.stdout.read()),
                                     daemon=True)
                t.start()
                readers.append(t)
        _wait_all(procs, timeout)
    finally:
        for p in procs:
            reap(p)
        for t in readers:
            t.join(_REAP_SEC)
    return ["".join(t) for t in texts]


def _wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                raise RuntimeError(f"rank {i} exited with {code}: {' '.join(procs[i].args)}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            alive = [i for i, code in enumerate(codes) if code is None]
            raise RuntimeError(f"rank(s) {alive} still running after {timeout:.0f} s: killed "
                               f"({' '.join(procs[alive[0]].args)})")
        time.sleep(0.02)


def reap(p: subprocess.Popen) -> None:
    """The process killed (when still running) and waited for, up to _REAP_SEC."""
    if p.poll() is None:
        p.kill()
    try:
        p.wait(timeout=_REAP_SEC)
    except subprocess.TimeoutExpired:
        log(f"process {p.pid} did not exit {_REAP_SEC:.0f} s after SIGKILL")


def json_records(text: str) -> List[Dict]:
    """The JSON records (one object per line) a rank printed among its other output."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def pair_records(base: Sequence[str], timeout: float) -> List[Dict]:
    """Both ranks of `base` here (pair_commands on a free port); the leader's JSON records."""
    return json_records(run_ranks(pair_commands(base, free_port()), timeout=timeout)[0])


def ring_records(cmd: Sequence[str], timeout: float, ranks: int = 2) -> List[Dict]:
    """Every rank (two, or `ranks`) of `cmd` on mx.distributed's ring backend here (a hostfile of
    one free port per rank, removed after; MLX_HOSTFILE and MLX_RANK set); rank 0's JSON records."""
    ports = [free_port() for _ in range(ranks)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], f)
    try:
        envs = [child_env({"MLX_HOSTFILE": f.name, "MLX_RANK": str(rank)}) for rank in range(ranks)]
        return json_records(run_ranks([cmd] * ranks, envs, timeout=timeout)[0])
    finally:
        os.unlink(f.name)
