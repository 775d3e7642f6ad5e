"""One rank of a two-process pair over the real ibverbs provider and the fake
libibverbs (or over ucsim), for the tests and for gate_latency.py.

    python tests/fake_ibverbs/pair_rank.py ROLE PORT LIBRARY DEVICE MODE

ROLE leader|worker; LIBRARY the verbs library for the provider ("" = the
system one), given to the library as DS4_TP_VERBS_LIBRARY; DEVICE an ibverbs
device name, "ucsim", or "" (auto); MODE "sums" (16 KiB and 24000-byte gates, 1 MiB bulk all_sums, each checked
exactly), "lossy:ITERS" (16 KiB all_sums until the first error, each checked)
or "bench:ITERS" (ITERS 16 KiB gates timed one by one after 500
untimed, p50/p99 in microseconds). Prints one JSON object on its last stdout
line.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mlx_ds4tp as tp  # noqa: E402
from mlx_ds4tp._verbs import ffi, lib  # noqa: E402

SIZES = [(4096, 20), (6000, 20), (1 << 18, 3)]  # float32: 16 KiB, 24000 B, 1 MiB


def sums(role: str, port: int, device: str) -> dict:
    """all_sum every size in SIZES, checking each result bit for bit."""
    kw = dict(transport="rdma", timeout=20.0, rdma_device=device or None)
    g = (tp.init(role="leader", listen=("127.0.0.1", port), **kw) if role == "leader"
         else tp.init(role="worker", coordinator=("127.0.0.1", port), **kw))
    with g:
        rank, wrong = g.rank(), []
        for n, times in SIZES:
            for k in range(times):
                y = tp.all_sum(mx.arange(n, dtype=mx.float32) * (rank + 1) + k, group=g)
                mx.eval(y)  # the collective runs (and fails) inside MLX's evaluation
                if not np.array_equal(np.array(y), np.arange(n, dtype=np.float32) * 3 + 2 * k):
                    wrong.append((n, k))
        rdma = g.link_to(1 - g.rank()).rdma
        st = rdma.stats()
        return {"transport": g.transport, "device": ffi.string(lib.tp_device_name(rdma.dev)).decode(),
                "wrong": wrong, "recv_cap": st.recv_cap, "bulk_slots": st.bulk_slots,
                "window": st.window}


def lossy(role: str, port: int, device: str, iters: int) -> dict:
    """16 KiB all_sums until one fails: how many passed, the wrong ones, the error."""
    kw = dict(transport="rdma", timeout=20.0, rdma_device=device or None)
    g = (tp.init(role="leader", listen=("127.0.0.1", port), **kw) if role == "leader"
         else tp.init(role="worker", coordinator=("127.0.0.1", port), **kw))
    base = mx.arange(4096, dtype=mx.float32) * (g.rank() + 1)
    wrong = []
    try:
        for k in range(iters):
            y = tp.all_sum(base + k, group=g)
            mx.eval(y)  # the collective runs (and fails) inside MLX's evaluation
            if not np.array_equal(np.array(y), np.arange(4096, dtype=np.float32) * 3 + 2 * k):
                wrong.append(k)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"done": k, "wrong": wrong, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        g.close()
    return {"done": iters, "wrong": wrong, "error": ""}


def gate_times(role: str, port: int, device: str, iters: int) -> dict:
    """p50/p99 of the 16 KiB exchange the backend calls, from numpy buffers (as `ds4tp bench`)."""
    import time

    from mlx_ds4tp.link.exchange import Exchange

    kw = dict(transport="rdma", timeout=60.0, rdma_device=device or None)
    g = (tp.init(role="leader", listen=("127.0.0.1", port), **kw) if role == "leader"
         else tp.init(role="worker", coordinator=("127.0.0.1", port), **kw))
    with g:
        send = np.full(4096, 1.0 + g.rank(), dtype=np.float32)
        recv = np.empty_like(send)
        exchange = Exchange(g.c_link(1 - g.rank()), send)
        for _ in range(500):
            exchange(send, recv)
        ns = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            exchange(send, recv)
            ns.append(time.perf_counter_ns() - t0)
        if not np.all(recv == 2.0 - g.rank()):
            raise SystemExit(f"the peer's partial arrived wrong: {recv[:4]}")
        us = np.asarray(ns, dtype=np.float64) / 1000.0
        return {"p50_us": round(float(np.percentile(us, 50)), 2),
                "p99_us": round(float(np.percentile(us, 99)), 2), "iters": iters,
                "device": ffi.string(lib.tp_device_name(g.link_to(1 - g.rank()).rdma.dev)).decode()}


def main() -> None:
    role, port, library, device, mode = sys.argv[1:6]
    os.environ["DS4_TP_VERBS_LIBRARY"] = library  # read by tp.init's LinkSettings
    if mode == "sums":
        out = sums(role, int(port), device)
    elif mode.startswith("lossy:"):
        out = lossy(role, int(port), device, int(mode.split(":")[1]))
    elif mode.startswith("bench:"):
        out = gate_times(role, int(port), device, int(mode.split(":")[1]))
    else:
        raise SystemExit(f"pair_rank.py: unknown mode {mode!r} (sums, bench:ITERS)")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
