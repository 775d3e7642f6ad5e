"""A group over a ring's links alone (issue 57, neighbours only; csrc/mlx/ring.cpp,
collectives/topology.py): at 3, 4 and 5 ranks on 127.0.0.1, over tcp and the emulated RDMA
device (ucsim), every collective over the ring is exact, identical on every rank and the same
bytes as the full mesh over the same links; the links off the ring carry nothing (their
sequence numbers stay, and shut down they are not missed); a partial mesh cabled as a ring out
of rank order is found as one; send/recv and subgroups off the ring are refused by name.

Each rank is its own process (tests/ring_child.py), killed if the test fails.
"""

from __future__ import annotations

import json
import os
import queue
import threading

import numpy as np
import pytest

from mlx_ds4tp.collectives import topology
from mlx_ds4tp.errors import TransportError
from pairutil import Procs, free_port

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_child.py")
RINGS = [(3, "tcp"), (4, "tcp"), (5, "tcp"), (3, "rdma"), (4, "rdma"), (5, "rdma")]


def run_ring(size: int, transport: str, case: str, timeout: float = 300.0):
    """Every rank's report, in rank order; every rank must exit 0."""
    procs = Procs()
    port = str(free_port())
    try:
        ranks = [procs.spawn([CHILD, str(r), port, transport, str(size), case],
                             env={"DS4_TP_TOPOLOGY": "ring"}) for r in range(size)]
        reports = []
        for p in ranks:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports
    finally:
        procs.kill_all()


@pytest.mark.parametrize("size,transport", RINGS)
def test_the_ring_gives_the_meshs_bytes_and_leaves_the_other_links_idle(size, transport):
    for rank, report in enumerate(run_ring(size, transport, "same")):
        assert report["rank"] == rank
        assert report["failed"] == [], report["failed"]
        assert report["cases"] > 2 * 3 * 7 * 3, report["cases"]
        # Off the ring not one exchange; on it, every collective's steps.
        assert set(report["idle"].values()) <= {0}, report
        assert len(report["busy"]) == 2 and min(report["busy"].values()) > 0, report
        if size > 3:
            assert len(report["idle"]) == size - 3, report
        assert report["mesh_used_all"], report  # the twin did run as the full mesh


@pytest.mark.parametrize("size,transport", [(4, "tcp"), (5, "rdma")])
def test_the_ring_runs_with_the_other_links_shut_down(size, transport):
    for report in run_ring(size, transport, "cut"):
        assert len(report["cut"]) == size - 3
        assert report["failed"] == [] and report["cases"] == 3 * 7 * 3 + 20, report


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_the_mlx_collective_matrix_passes_over_a_ring_of_three(transport):
    for report in run_ring(3, transport, "matrix"):
        assert report["failed"] == [], report["failed"]
        assert report["cases"] > 7 * 5 * 6


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_ring_joined_again_runs_over_the_ring(transport):
    for report in run_ring(4, transport, "rejoin"):
        assert report["ring"] == [0, 1, 2, 3]
        assert report["failed"] == [] and report["cases"] == 3 * 7 * 3 + 20, report


@pytest.mark.parametrize("size,transport", [(4, "tcp"), (5, "tcp"), (4, "rdma")])
def test_a_partial_mesh_cabled_as_a_ring_is_found_and_exact(size, transport):
    cabled = list(range(0, size, 2)) + list(range(1, size, 2))
    for report in run_ring(size, transport, "partial"):
        assert report["ring"] == cabled
        assert report["failed"] == [] and report["cases"] == 3 * 7 * 3 + 20, report


@pytest.mark.parametrize("size,transport", [(4, "rdma"), (5, "rdma"), (4, "tcp")])
def test_a_ring_of_cables_runs_every_collective_round_it_and_never_on_the_other_links(size, transport):
    cabled = list(range(0, size, 2)) + list(range(1, size, 2))
    for report in run_ring(size, transport, "cabled"):
        assert report["ring"] == cabled, report
        assert report["failed"] == [] and report["cases"] == 3 * 7 * 3 + 20, report
        assert len(report["idle"]) == size - 3 and set(report["idle"].values()) == {0}, report
        assert report["transport"] == transport, report
        assert "topology mesh: --transport rdma runs over the cables, and they form the ring" in report["mesh_refused"]


def test_a_rank_on_the_full_mesh_beside_ranks_on_the_ring_stops_every_rank():
    procs = Procs()
    port = str(free_port())
    try:
        ranks = [procs.spawn([CHILD, str(r), port, "tcp", "4", "same"],
                             env={"DS4_TP_TOPOLOGY": "mesh" if r == 1 else "ring"}) for r in range(4)]
        errs = []
        for p in ranks:
            _, err = p.communicate(timeout=120)
            assert p.returncode != 0, err
            errs.append(err)
    finally:
        procs.kill_all()
    assert "rank 1 runs its collectives over the full mesh, its neighbour rank 0 over the ring 0-1-2-3" in errs[1]
    assert "rank 0 runs its collectives over the ring 0-1-2-3, its neighbour rank 1 over the full mesh" in errs[0]
    for err in errs[2:]:  # their neighbours' links closed under them
        assert "PeerClosedError" in err or "closed" in err, err


def _learn_all(links):
    """Every rank's topology._learn, each in a thread, over in-process queues as links."""
    size = len(links)
    boxes = {(a, b): queue.Queue() for a in range(size) for b in links[a]}
    tables = [None] * size

    def rank_main(rank):
        def swap(peer, table):
            boxes[(rank, peer)].put(table.copy())
            return boxes[(peer, rank)].get(timeout=10)

        tables[rank] = topology._learn(rank, size, links[rank], swap)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return tables


@pytest.mark.parametrize("cycle", [[0, 1, 2], [0, 2, 1, 3], [0, 3, 1, 4, 2], [0, 5, 2, 7, 1, 6, 3, 4]])
def test_every_rank_learns_the_same_ring_from_its_two_links(cycle):
    size = len(cycle)
    links = {r: sorted({cycle[cycle.index(r) - 1], cycle[(cycle.index(r) + 1) % size]}) for r in range(size)}
    tables = _learn_all(links)
    orders = [topology._cycle(t, size) for t in tables]
    start = cycle if cycle[1] < cycle[-1] else [0] + cycle[1:][::-1]
    assert orders == [start] * size


def test_links_that_are_no_single_ring_are_refused_by_name():
    two_triangles = np.array([[1, 2], [0, 2], [0, 1], [4, 5], [3, 5], [3, 4]], dtype=np.uint8)
    with pytest.raises(TransportError, match="form no single ring"):
        topology._cycle(two_triangles, 6)
    with pytest.raises(TransportError, match="exactly two"):
        topology.ring_order(0, 5, {1: None, 2: None, 3: None})
    with pytest.raises(TransportError, match="no link to rank"):
        topology.ring_order(0, 4, {1: None, 3: None}, "mesh")
    with pytest.raises(ValueError, match="give one of auto, mesh, ring"):
        topology.ring_order(0, 4, {1: None, 2: None, 3: None}, "star")


def test_neighbours_that_run_other_links_are_refused_naming_both():
    """agree() over in-process links: rank 1 runs the full mesh, the others the ring. Ranks 0
    and 1 meet first (link 0-1 comes first for both) and refuse naming each other; the others
    then wait on the ranks that stopped (a real group's links close: they fail too)."""
    plans = {0: [0, 1, 2, 3], 1: [], 2: [0, 1, 2, 3], 3: [0, 1, 2, 3]}
    boxes = {(a, b): queue.Queue() for a in range(4) for b in range(4) if a != b}
    errors = {}

    class Link:
        def __init__(self, rank, peer):
            self.rank, self.peer = rank, peer

    def swap(link, table):
        boxes[(link.rank, link.peer)].put(table.copy())
        return boxes[(link.peer, link.rank)].get(timeout=2)

    def rank_main(rank):
        try:
            topology.agree(rank, 4, {p: Link(rank, p) for p in range(4) if p != rank}, plans[rank])
        except (TransportError, queue.Empty) as exc:
            errors[rank] = str(exc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(topology, "_swap", swap)
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert sorted(errors) == [0, 1, 2, 3], errors
    assert "rank 1 runs its collectives over the full mesh, its neighbour rank 0 over the ring 0-1-2-3" in errors[1]
    assert "its neighbour rank 1 over the full mesh" in errors[0] and "DS4_TP_TOPOLOGY" in errors[0]


def test_the_topology_a_full_mesh_runs_over():
    full = {1: None, 2: None, 3: None}
    assert topology.ring_order(0, 4, full, "auto") == []
    assert topology.ring_order(0, 4, full, "mesh") == []
    assert topology.ring_order(0, 4, full, "ring") == [0, 1, 2, 3]
    assert topology.ring_order(0, 2, {1: None}, "ring") == []  # a pair: its one link


def test_ds4_tp_topology_is_checked_by_name():
    from mlx_ds4tp.link.config import default_topology

    assert default_topology({}) == "auto"
    assert default_topology({"DS4_TP_TOPOLOGY": "ring"}) == "ring"
    with pytest.raises(ValueError, match="DS4_TP_TOPOLOGY='star': set it to one of auto, mesh, ring"):
        default_topology({"DS4_TP_TOPOLOGY": "star"})
