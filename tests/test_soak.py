"""Soak: 100k all_sum gates over each transport (tcp, ucsim rdma, and the real
ibverbs provider over the tests' fake libibverbs) between two ranks in this
process, every sum checked bit for bit against numpy, with a 1 MiB bulk all_sum
every 1000 gates (so the decode window is drained and
re-armed 100 times), and the process's resident memory sampled every 10k
gates: from the first sample (after warm-up) to the last it may grow by less
than 5 %. Marked slow (about 15 s for tcp and 25 s for rdma on 2 cores).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

import mlx_ds4tp as tp
from pairutil import both_ok, fake_verbs_library, make_groups, reset_verbs_library

GATES = 100_000
SAMPLE_EVERY = 10_000
BULK_EVERY = 1_000
MAX_GROWTH = 0.05
HIDDEN = 4096  # one 16 KiB float32 hidden vector per decode gate
BULK_SHAPE = (64, HIDDEN)  # 1 MiB: rides the bulk path
VARIANTS = 16  # distinct partials per rank, cycled


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def partials(rank: int, shape) -> list:
    rng = np.random.default_rng(1000 * rank + len(shape))
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(VARIANTS)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "rdma", "rdma-fake"])
def test_soak_100k_gates_exact_sums_flat_memory(transport, monkeypatch):
    if transport == "rdma-fake":
        # The real provider, no device named: it picks the fake's rdma_en1.
        monkeypatch.setenv("DS4_TP_VERBS_LIBRARY", fake_verbs_library())
        for var in ("DS4_TP_FAKE_IBV_DEVICES", "DS4_TP_FAKE_IBV_REFUSE", "DS4_TP_UCSIM_FAULTS"):
            monkeypatch.delenv(var, raising=False)
        lg, wg = make_groups("rdma", timeout=30.0, rdma_device=None)
    else:
        lg, wg = make_groups(transport, timeout=30.0)
    assert lg.transport == wg.transport == transport.split("-")[0]
    host = [partials(0, (HIDDEN,)), partials(1, (HIDDEN,))]
    bulk_host = [partials(0, BULK_SHAPE)[:2], partials(1, BULK_SHAPE)[:2]]
    # The expected sums, rank 0's partial first as both ranks compute them.
    expect = [np.add(host[0][k], host[1][k]).view(np.uint32) for k in range(VARIANTS)]
    bulk_expect = [np.add(bulk_host[0][k], bulk_host[1][k]).view(np.uint32) for k in range(2)]
    samples = []

    def rank_loop(group, rank: int):
        xs = [mx.array(a) for a in host[rank]]
        bulks = [mx.array(a) for a in bulk_host[rank]]
        exact = bulk_count = 0
        for i in range(1, GATES + 1):
            k = i % VARIANTS
            y = tp.all_sum(xs[k], group=group)
            mx.eval(y)  # the collective runs (and fails) inside MLX's evaluation
            if not np.array_equal(np.array(y).view(np.uint32), expect[k]):
                raise AssertionError(f"rank {rank}: gate {i} sum differs from numpy's")
            exact += 1
            if i % BULK_EVERY == 0:
                b = i // BULK_EVERY % 2
                z = tp.all_sum(bulks[b], group=group)
                if not np.array_equal(np.array(z).view(np.uint32), bulk_expect[b]):
                    raise AssertionError(f"rank {rank}: bulk exchange after gate {i} differs from numpy's")
                bulk_count += 1
            if rank == 0 and i % SAMPLE_EVERY == 0:
                samples.append((i, rss_kib()))
        return exact, bulk_count

    t0 = time.monotonic()
    try:
        (lexact, lbulk), (wexact, wbulk) = both_ok(lambda: rank_loop(lg, 0), lambda: rank_loop(wg, 1),
                                                   timeout=600)
    finally:
        lg.close()
        wg.close()
        reset_verbs_library()
    elapsed = time.monotonic() - t0
    base, last = samples[0][1], samples[-1][1]
    growth = (last - base) / base
    print(f"soak {transport}: {lexact} + {wexact} exact gate sums, {lbulk} + {wbulk} exact bulk sums in "
          f"{elapsed:.1f} s; VmRSS KiB {[kib for _, kib in samples]}; growth {100 * growth:+.2f} %")
    assert lexact == wexact == GATES and lbulk == wbulk == GATES // BULK_EVERY
    assert len(samples) == GATES // SAMPLE_EVERY
    assert growth < MAX_GROWTH, (f"VmRSS grew {100 * growth:.1f} % from gate {samples[0][0]} to "
                                 f"{samples[-1][0]}: {samples}")
