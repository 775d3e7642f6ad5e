"""The group of 2 to 8 ranks as an ``mlx.core.distributed.Group``: the compiled backend's Group
(csrc/mlx/group.cpp) over the C mesh (tp_mesh, csrc/exchange.c), whose links are the mesh's
pairs (link/mesh.py; two ranks form as N do, a mesh of one link).
``mx.distributed``'s collectives, ``mlx.nn``'s sharded layers and mlx-lm's ``shard()`` take it
for any N; ``split(color, key)`` makes subgroups over the same links. Over a ring (cabled as one, or
topology "ring") every collective runs over the ring's links alone (collectives/topology.py)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import TransportError
from ..link.config import TOPOLOGY_ENV, default_topology
from ..link.native import load_verbs
from .backend import _address, _pairgroup
from .topology import agree, ring_order

# How many recent decode gates each link's latency ring keeps.
LATENCY_WINDOW = 8192


class LatencyRing:
    """One link's recent decode gates' round trips, their count and total, written by the C
    exchange (csrc/exchange.c's record()) into this memory: kept across reattach()."""

    def __init__(self):
        self.ns = np.zeros(LATENCY_WINDOW, dtype=np.int64)
        self.count = np.zeros(2, dtype=np.uint64)  # [0]: gates recorded, [1]: their total ns

    def recent(self) -> np.ndarray:
        return self.ns[:min(int(self.count[0]), LATENCY_WINDOW)]


def _c_mesh(ffi, mesh, rings: Dict[int, LatencyRing]):
    """The C mesh (tp_mesh) over `mesh`'s pairs, and its links: C memory the caller keeps."""
    cmesh = ffi.new("tp_mesh *")
    cmesh.rank = mesh.rank
    cmesh.size = mesh.size
    links = {}
    for peer, pair in mesh.pairs.items():
        ring = rings[peer]
        link = ffi.new("tp_link *")
        link.pair = pair.state
        link.dev = pair.rdma.dev if pair.rdma is not None else ffi.NULL
        link.fd = pair.data.fileno()
        link.rank = pair.rank
        link.spin_ns = pair.spin_ns
        link.timeout_s = pair.timeout
        link.latency_ns = ffi.cast("int64_t *", ffi.from_buffer(ring.ns))
        link.latency_len = LATENCY_WINDOW
        link.latency_count = ffi.cast("uint64_t *", ffi.from_buffer(ring.count))
        cmesh.links[peer] = link
        links[peer] = link
    return cmesh, links


def collective_links(mesh, links: Dict[int, object]) -> Dict[int, object]:
    """The links the collectives may run over: every link, but over a ring of cables with
    --transport rdma (mesh.cabled_ring) the ring's alone; the TCP links between ranks without
    a cable carry the leader's commands, never a gate."""
    ring = getattr(mesh, "cabled_ring", None)
    if not ring:
        return links
    k = ring.index(mesh.rank)
    return {p: links[p] for p in (ring[k - 1], ring[(k + 1) % len(ring)])}


def _refuse_mesh_over_a_ring(mesh, topology: Optional[str]) -> None:
    ring = getattr(mesh, "cabled_ring", None)
    if ring and (default_topology() if topology is None else topology) == "mesh":
        raise TransportError(f"topology mesh: --transport rdma runs over the cables, and they form the "
                             f"ring {'-'.join(map(str, ring))}, no full mesh; leave {TOPOLOGY_ENV} "
                             "unset (or auto, ring), or run --transport auto to use the links "
                             "between ranks without a cable (tcp) too")


class Group(_pairgroup.Group):
    """The N ranks of a mesh (2 to 8, rank 0 the leader) as an ``mx.distributed.Group``.

    Beside MLX's surface (``rank()``, ``size()``, every ``mx.distributed`` collective,
    ``split(color, key)``): ``transport`` ("tcp", "rdma", or "mixed" when the links differ),
    ``links()`` (each link's transport and RDMA queue pair builds), ``link_to(peer)`` (the
    pair to a peer rank: its control channel and hellos, for the lockstep above),
    ``close()`` (also a context manager), ``reattach(mesh)``, and the exchange statistics
    over every link (``gate_latency_us()``, ``exchange_seconds()``, ``gates()``).

    topology ("auto", "mesh" or "ring"; None: DS4_TP_TOPOLOGY, else auto): which links the
    collectives run over (collectives/topology.py); ``ring`` is then the ring's ranks in cycle
    order ([] over the full mesh). Over a ring a subgroup holds every rank or two neighbours,
    and send/recv go between neighbours (anything else is refused, naming the ring)."""

    def __init__(self, mesh, topology: Optional[str] = None):
        ffi, lib = load_verbs()
        self._rings = {peer: LatencyRing() for peer in mesh.pairs}
        cmesh, links = _c_mesh(ffi, mesh, self._rings)
        _refuse_mesh_over_a_ring(mesh, topology)
        self.ring: List[int] = ring_order(mesh.rank, mesh.size, collective_links(mesh, links), topology)
        agree(mesh.rank, mesh.size, collective_links(mesh, links), self.ring)
        super().__init__(mesh.rank, mesh.size, _address(ffi, cmesh),
                         _address(ffi, lib.tp_mesh_exchange_address()),
                         _address(ffi, lib.tp_sum2_address()),
                         _address(ffi, lib.tp_mesh_close_address()), self.ring)
        self._take(cmesh, links, mesh)

    def _take(self, cmesh, links, mesh) -> None:
        self._cmesh, self._links = cmesh, links  # C memory the backend reads: kept with the group
        self._mesh = mesh
        kinds = set(t for peer, t in mesh.transports().items() if peer in collective_links(mesh, links))
        self.transport = kinds.pop() if len(kinds) == 1 else "mixed"

    def reattach(self, mesh) -> None:
        """Run this closed group over a new mesh of the same ranks, this rank at its place
        (`ds4tp serve` taking a restarted rank back, any N): a
        model split over this group, whose layers hold it, works on unchanged; nothing of the
        old mesh is carried over but the statistics and the ring (its links must be there). The
        new links' sequence numbers start again at zero on every rank."""
        if self._mesh is not None:
            raise TransportError("this group is still open; close() it before reattach()")
        if (mesh.rank, mesh.size) != (self.rank(), self.size()):
            raise ValueError(f"the new mesh makes this process rank {mesh.rank} of {mesh.size}; the group "
                             f"is rank {self.rank()} of {self.size()}: a group keeps its rank and size")
        ffi, _ = load_verbs()
        cmesh, links = _c_mesh(ffi, mesh, self._rings)
        # A restarted rank joins with a new Group, whose __init__ agrees with its neighbours.
        agree(mesh.rank, mesh.size, collective_links(mesh, links), self.ring)
        self._attach_backend(_address(ffi, cmesh))
        self._take(cmesh, links, mesh)

    @property
    def mesh(self):
        """The mesh this group runs over (its pairs by peer rank)."""
        if self._mesh is None:
            raise TransportError("this group is closed; create a new one with mlx_ds4tp.init(...)")
        return self._mesh

    def link_to(self, peer: int):
        """The pair (link.connection.Pair) to rank `peer`: its control channel, its hellos."""
        pairs = self.mesh.pairs
        if peer not in pairs:
            raise ValueError(f"peer={peer!r}: rank {self.rank()} has links to ranks "
                             f"{sorted(pairs)}; give one of them")
        return pairs[peer]

    def c_link(self, peer: int):
        """The C link (``tp_link *``) to rank `peer` the backend's exchanges run on:
        link/exchange.py's Exchange calls the same entry point on it from Python (bench,
        doctor, tests)."""
        self.link_to(peer)
        return self._links[peer]

    def cable_fault(self) -> Optional[str]:
        """Which of this rank's cables is out now (link/cable_watch.py: the two ranks, both
        ends), or None: what a failed collective is explained by."""
        return None if self._mesh is None else self._mesh.cable_fault()

    @property
    def watches_cables(self) -> bool:
        """Whether this rank's cables are watched (a group of 3 or more on named cables)."""
        return self._mesh is not None and getattr(self._mesh, "watch", None) is not None

    def links(self) -> Dict[int, dict]:
        """{peer rank: {"transport", "builds"}}: each link's transport and, over RDMA, how many
        times its queue pair was built (1: the first warm-up passed)."""
        out = {}
        for peer, pair in sorted(self.mesh.pairs.items()):
            builds = pair.rdma.setup_attempt + 1 if pair.rdma is not None else 0
            out[peer] = {"transport": pair.transport, "builds": builds}
        return out

    def close(self) -> None:
        """Stop the collectives of this group and its subgroups (one in flight is woken and
        fails; later ones fail saying the group is closed), then close every link."""
        if self._mesh is None:
            return
        self._close_backend()
        mesh, self._mesh = self._mesh, None
        mesh.close()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # MLX's graph may hold the implementation longer than Python holds this object:
        # it must never reach the links' memory once that is freed.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
            pass

    def __repr__(self) -> str:
        ring = f" ring={'-'.join(map(str, self.ring))}" if self.ring else ""
        return f"<mlx_ds4tp Group rank={self.rank()} size={self.size()} transport={self.transport}{ring}>"

    # -- statistics, over every link --------------------------------------------
    def gate_latency_us(self) -> Tuple[float, float]:
        """(p50, p99) of the recent decode gates' round trips on every link, in microseconds
        (over a mesh, each link's wait for its peer's block within a gate)."""
        recent = np.concatenate([ring.recent() for ring in self._rings.values()])
        if recent.size == 0:
            return 0.0, 0.0
        p50, p99 = np.percentile(recent, [50, 99]) / 1000.0
        return float(p50), float(p99)

    def exchange_seconds(self) -> float:
        """Seconds this rank has spent in exchanges since init (decode gates, bulk
        exchanges and signature swaps, on every link), waiting for the peers included. In
        lockstep decode that is mostly waiting: a rank that finishes its part of a layer
        first waits at the gate for the others'."""
        gates = sum(int(ring.count[1]) for ring in self._rings.values())
        other = sum(int(link.other_ns) for link in self._links.values())
        return (gates + other) / 1e9

    def latency_ring(self, peer: int) -> LatencyRing:
        """The link to rank `peer`'s recent decode gates (the cluster page's per-link figures)."""
        return self._rings[peer]

    def gates(self) -> int:
        """Decode gates run since init: the most any link ran (a gate of the whole group
        runs once on every link)."""
        return max(int(ring.count[0]) for ring in self._rings.values())
