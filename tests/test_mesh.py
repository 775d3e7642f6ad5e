"""A group of N ranks over our transport (issue 49): at N = 3 and 4 on 127.0.0.1, over tcp and
over the emulated RDMA device (ucsim), every collective is exact and identical on every rank
(float32, float16, bfloat16, 1 element to 4 MiB); MLX's collective test matrix passes;
split() subgroups are exact; mlx-lm's shard() of a llama over 4 ranks gives the unsplit
model's tokens and logits; a rank killed in a stream of collectives makes every other rank
raise within a second; a one-direction drop on one link re-creates that link's queue pair only.

Each rank is its own process (tests/mesh_child.py), killed if the test fails.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

import pytest

from pairutil import Procs, free_port

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_child.py")


def run_mesh(size: int, transport: str, case: str, *extra: str, env: Optional[Dict[str, str]] = None,
             cwd: Optional[str] = None, timeout: float = 240.0, ok: Optional[List[int]] = None):
    """Every rank's report (rank order) and stderr; ranks in `ok` (default all) must exit 0."""
    procs = Procs()
    port = str(free_port())
    try:
        ranks = [procs.spawn([CHILD, str(r), port, transport, str(size), case, *extra], env=env, cwd=cwd)
                 for r in range(size)]
        reports, errs = [], []
        for r, p in enumerate(ranks):
            out, err = p.communicate(timeout=timeout)
            errs.append(err)
            if ok is None or r in ok:
                assert p.returncode == 0, err
                reports.append(json.loads(out.strip().splitlines()[-1]))
            else:
                reports.append(None)
        return reports, errs
    finally:
        procs.kill_all()


MESHES = [(3, "tcp"), (4, "tcp"), (3, "rdma"), (4, "rdma")]
# The same Group for a pair (a mesh of two, its gates on the two-member fast path) and for N.
GROUPS = [(2, "tcp"), (2, "rdma")] + MESHES


@pytest.mark.parametrize("size,transport", GROUPS)
def test_every_collective_is_exact_and_identical_on_every_rank(size, transport):
    reports, _ = run_mesh(size, transport, "exact")
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["failed"] == [], report["failed"]
        assert report["cases"] == 3 * 7 * 3 + 20


@pytest.mark.parametrize("size,transport", GROUPS)
def test_the_mlx_collective_matrix_and_split_subgroups_pass(size, transport):
    reports, _ = run_mesh(size, transport, "matrix")
    for report in reports:
        assert report["failed"] == [], report["failed"]
        assert report["cases"] > 7 * 5 * 6


@pytest.mark.parametrize("size", [2, 3])
def test_gate_stats_cover_every_link_a_split_reorders_any_group_and_a_closed_one_refuses(size):
    reports, _ = run_mesh(size, "tcp", "stats")
    for report in reports:
        assert report["failed"] == [] and report["cases"] == 2 + 3 * 6, report
        # 30 gates, each once on every link: counted once, timed on every link.
        assert report["gates"] == 30, report
        assert 0 < report["p50"] <= report["p99"], report
        assert report["seconds"] > 0, report
        assert report["refused"] and "this group is closed" in report["refused"], report


def test_mlx_lm_shard_over_four_ranks_gives_the_unsplit_tokens_and_logits():
    reports, _ = run_mesh(4, "tcp", "shard")
    for report in reports:
        assert report["max_rel"] < 1e-4, report
        assert report["identical_on_all"] and report["tokens_equal"], report


@pytest.mark.parametrize("size,victim,transport", [(3, 0, "tcp"), (3, 2, "tcp"), (4, 1, "tcp"), (4, 3, "tcp"),
                                                   (3, 1, "rdma"), (4, 0, "rdma")])
def test_a_killed_rank_makes_every_other_rank_raise_within_a_second(tmp_path, size, victim, transport):
    survivors = [r for r in range(size) if r != victim]
    reports, _ = run_mesh(size, transport, "die", str(victim), cwd=str(tmp_path), ok=survivors, timeout=60)
    died = float((tmp_path / "died.txt").read_text())
    for r in survivors:
        report = reports[r]
        assert report["error"], report
        assert report["alive"] == 3.0
        assert report["raised_at"] - died < 1.0, (r, report["raised_at"] - died, report["error"])


def test_a_one_direction_drop_on_one_link_recreates_only_that_link():
    env = {"DS4_TP_UCSIM_FAULTS": "drop=l2w:1", "DS4_TP_UCSIM_FAULT_LINKS": "1-2"}
    reports, errs = run_mesh(3, "rdma", "links", env=env)
    builds = {(r, int(peer)): link["builds"] for r, report in enumerate(reports)
              for peer, link in report["links"].items()}
    assert builds[(1, 2)] >= 2 and builds[(2, 1)] == builds[(1, 2)], builds
    assert all(b == 1 for (r, p), b in builds.items() if {r, p} != {1, 2}), builds
    # Only ranks 1 and 2 rebuilt a queue pair.
    assert not re.search(r"recreating the queue pair", errs[0]), errs[0]
    assert all(re.search(r"recreating the queue pair \(setup attempt 1\)", errs[r]) for r in (1, 2))


def test_split_releases_the_interpreter_so_ranks_in_threads_split_together():
    import threading

    import mlx.core as mx

    import mlx_ds4tp as tp

    port, size, out = free_port(), 3, {}

    def rank(r: int) -> None:
        where = ({"role": "leader", "listen": ("127.0.0.1", port)} if r == 0
                 else {"role": "worker", "coordinator": ("127.0.0.1", port), "rank": r})
        try:
            with tp.init(transport="tcp", timeout=20.0, size=size, **where) as g:
                sub = g.split(0 if r < 2 else 1)
                y = tp.all_sum(mx.full((5,), float(r + 1)), group=sub) if sub.size() > 1 else None
                out[r] = (sub.rank(), sub.size(), None if y is None else float(y[0].item()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung in split"
    assert out == {0: (0, 2, 3.0), 1: (1, 2, 3.0), 2: (0, 1, None)}, out
