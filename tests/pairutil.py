"""Helpers for tests that need both ranks: in-process (two threads) or as two
real processes (killed on failure)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A listen port outside the ephemeral range (see mlx_ds4tp.onehost.localpair.free_port)."""
    from mlx_ds4tp.onehost.localpair import free_port as pick

    return pick("127.0.0.1")


def dial_when_listening(port: int, within: float = 20.0, host: str = "127.0.0.1"):
    """A hand-made client for a leader started in another thread, which may not
    be listening yet: a refused connection means "not yet", so dial again until
    `within` runs out (a fixed sleep loses that race on a loaded machine)."""
    import socket

    deadline = time.monotonic() + within
    while True:
        try:
            return socket.create_connection((host, port), timeout=30)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _evaluate(value) -> None:
    """Evaluate the MLX arrays in a rank's result in that rank's own thread: collectives
    are lazy and run when evaluated, each rank's must run in its own thread (and MLX's
    streams belong to the thread that made them)."""
    import mlx.core as mx

    if isinstance(value, mx.array):
        mx.eval(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _evaluate(v)
    elif isinstance(value, dict):
        for v in value.values():
            _evaluate(v)


def run_both(leader_fn: Callable, worker_fn: Callable, timeout: float = 60.0) -> Tuple:
    """Run the two ranks' functions concurrently; return (leader, worker)
    results as (value, exception) pairs, MLX arrays in them evaluated. Never
    hangs past timeout."""
    results: List = [(None, None), (None, None)]

    def wrap(i: int, fn: Callable) -> None:
        try:
            value = fn()
            _evaluate(value)
            results[i] = (value, None)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[i] = (None, exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True)
               for i, fn in enumerate((leader_fn, worker_fn))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise AssertionError(f"a rank did not finish within {timeout} s (hang)")
    return tuple(results)


def both_ok(leader_fn: Callable, worker_fn: Callable, timeout: float = 60.0) -> Tuple:
    (lv, le), (wv, we) = run_both(leader_fn, worker_fn, timeout)
    if le is not None:
        raise le
    if we is not None:
        raise we
    return lv, wv


def make_groups(transport: str = "tcp", timeout: float = 20.0, **kw):
    """(leader Group, worker Group) connected on 127.0.0.1 inside this process."""
    import mlx_ds4tp as tp

    port = free_port()
    if transport == "rdma":
        kw.setdefault("rdma_device", "ucsim")
    return both_ok(
        lambda: tp.init(role="leader", listen=("127.0.0.1", port), transport=transport,
                        timeout=timeout, **kw),
        lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), transport=transport,
                        timeout=timeout, **kw),
    )


def exchange(group, send):
    """One exchange of `send` (a numpy array) on the group's link, through the C entry point
    the MLX backend calls: the peer's array back."""
    import numpy as np

    from mlx_ds4tp.link.exchange import Exchange

    recv = np.empty_like(send)
    Exchange(group.c_link(1 - group.rank()), send)(send, recv)
    return recv


def swap(lg, wg, lsend, wsend, timeout: float = 30.0) -> Tuple:
    """Both ranks exchange at once: (what the leader received, what the worker received)."""
    return both_ok(lambda: exchange(lg, lsend), lambda: exchange(wg, wsend), timeout)


def groups_of(*pairs) -> List:
    """Links made alone by transport.connect() (a test of the link step) as groups of two (each
    then owns and closes its link); a group forms through init / form_mesh."""
    from mlx_ds4tp.collectives.group import Group
    from mlx_ds4tp.link.mesh import Mesh

    return [Group(Mesh(p.rank, 2, {1 - p.rank: p}, b"", None, [])) for p in pairs]


class Procs:
    """Child processes that are always killed when the test ends."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []

    def spawn(self, args: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        p = subprocess.Popen([sys.executable, *args], env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, **kw)
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                except OSError:
                    pass
                p.kill()
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def run_mlx_ranks(procs: "Procs", tmp_path, script: str, timeout: float = 60.0) -> List[dict]:
    """Both ranks of `python -c script` under MLX's ring backend on 127.0.0.1 (a hostfile in
    tmp_path); each rank's last stdout line parsed as JSON, in rank order."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    ranks = [procs.spawn(["-c", script], env={"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)})
             for r in (0, 1)]
    outs = []
    for p in ranks:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def reference_text(model_dir, prompt: str, max_tokens: int) -> Tuple[str, List[int]]:
    """(text, tokens) of the unsplit model's greedy generation in this process:
    what a pair run of the same model must print."""
    from mlx_lm.utils import load

    from mlx_ds4tp.cli.demo import single_process_tokens

    _, tokenizer = load(str(model_dir))
    tokens = single_process_tokens(model_dir, list(tokenizer.encode(prompt)), max_tokens)
    detok = tokenizer.detokenizer
    detok.reset()
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text, tokens


def no_rdma_reason() -> str:
    """What the ibverbs provider reports on a machine without RDMA, for the build
    these tests run on: no device (built against infiniband/verbs.h), or no
    provider at all (built without it: no libibverbs-dev, or MLX_DS4TP_NO_IBVERBS=1)."""
    from mlx_ds4tp._verbs import lib

    return "no verbs devices" if lib.tp_built_with_ibverbs() else "built without infiniband/verbs.h"


_FAKE_LIBRARY: List[str] = []


def fake_verbs_library() -> str:
    """The tests' fake libibverbs (tests/fake_ibverbs/), built once per test
    process by the script a user runs, into a temporary directory removed at
    exit; its path, for DS4_TP_VERBS_LIBRARY. Skips the test when the C module
    was built without infiniband/verbs.h (package libibverbs-dev): then there is
    no ibverbs provider to point at it."""
    import atexit
    import shutil
    import tempfile

    import pytest

    from mlx_ds4tp._verbs import lib

    if not lib.tp_built_with_ibverbs():
        pytest.skip("mlx_ds4tp._verbs was built without infiniband/verbs.h (package "
                    "libibverbs-dev): no ibverbs provider to test")
    if not _FAKE_LIBRARY:
        out = tempfile.mkdtemp(prefix="fake_ibverbs-")
        atexit.register(shutil.rmtree, out, True)
        res = subprocess.run([sys.executable, os.path.join(REPO, "tests", "fake_ibverbs", "build.py"), out],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building the fake libibverbs failed:\n{res.stdout}{res.stderr}")
        _FAKE_LIBRARY.append(res.stdout.strip().splitlines()[-1])
    return _FAKE_LIBRARY[0]


def reset_verbs_library() -> None:
    """Point this process's ibverbs provider back at the system library (a pair
    made with DS4_TP_VERBS_LIBRARY set leaves the fake in place for the bare C
    API calls of later tests)."""
    from mlx_ds4tp._verbs import ffi, lib

    lib.tp_set_verbs_library(ffi.NULL, ffi.new("char[]", 512), 512)
