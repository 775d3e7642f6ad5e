"""Which links a group of 3 or more runs its collectives over: every pair's (the full mesh), or
a ring's alone (csrc/mlx/ring.cpp). Mac minis have three Thunderbolt ports, so five to eight of
them can only be cabled as a ring: each Mac to two others, the cables closing one cycle.

The choice, ``topology`` (a Group's argument, else DS4_TP_TOPOLOGY, else "auto"):
  - "auto": the full mesh where this rank has a link to every peer; where it has two, the ring
    those links form (learned from the neighbours: each rank's two are passed round the ring);
  - "mesh": the full mesh, refused when a link is missing;
  - "ring": the ring's links alone; over a full mesh the ring 0-1-...-(N-1)-0, its other
    links left idle (how the ring runs, and is tested, where every pair is linked).
Both give the same bits: every item's partials combine in rank order either way. Every rank
must run the same: a rank over the ring and its neighbour over the mesh would wait on links the
other never uses, or pair one's steps with the other's collectives, so agree() checks it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..errors import TransportError
from ..link.config import TOPOLOGIES, TOPOLOGY_ENV, default_topology
from ..link.exchange import Exchange

# The fewest ranks a ring has: two ranks' one link is mesh and ring alike.
MIN_RING_SIZE = 3
# A table entry for a rank whose neighbours this rank has not heard of yet.
_UNKNOWN = 255
# agree()'s entry past the ring's ranks (every entry, over the full mesh).
_MESH = 254


def ring_order(rank: int, size: int, links: Dict[int, object], topology: Optional[str] = None) -> List[int]:
    """The ring the collectives run over (ranks in cycle order, starting at 0 towards its lower
    neighbour), or [] for the full mesh; `links`: {peer rank: C link (tp_link *)}. Over a
    partial mesh every rank must call this at once: it learns the ring over the links."""
    chosen = default_topology() if topology is None else topology
    if chosen not in TOPOLOGIES:
        raise ValueError(f"topology={chosen!r}: give one of {', '.join(TOPOLOGIES)} (or None for "
                         f"{TOPOLOGY_ENV}, else auto)")
    peers = sorted(links)
    missing = sorted(set(range(size)) - set(peers) - {rank})
    if size < MIN_RING_SIZE:
        return []
    if not missing:
        return list(range(size)) if chosen == "ring" else []
    if chosen == "mesh":
        raise TransportError(f"topology mesh: rank {rank} of {size} has no link to rank(s) {missing}; "
                             "link every pair of ranks, or run over the ring (topology ring or auto)")
    if len(peers) != 2:
        raise TransportError(f"rank {rank} of {size} has links to ranks {peers}: a group runs over a "
                             "link to every peer (a full mesh) or to exactly two (a ring); cable "
                             "each Mac to two others, the cables closing one cycle")
    return _cycle(_learn(rank, size, peers, lambda peer, table: _swap(links[peer], table)), size)


def agree(rank: int, size: int, links: Dict[int, object], ring: List[int]) -> None:
    """Refuse, naming both, a neighbour that runs its collectives over other links than this
    rank: each rank swaps what it runs over with rank - 1 and rank + 1 (links of every ring the
    ranks may run, the rank-order one of a full mesh or the learned one), so the whole group
    agrees when every two neighbours do. Every rank must call this at once."""
    if size <= 2:
        return
    plan = np.full(size, _MESH, dtype=np.uint8)
    plan[:len(ring)] = ring
    near = _neighbours(rank, ring or list(range(size)))
    for peer in sorted(near, key=lambda peer: (min(rank, peer), max(rank, peer))):
        theirs = _swap(links[peer], plan)
        if not np.array_equal(theirs, plan):
            raise TransportError(f"rank {rank} runs its collectives over {_plan_text(plan)}, its neighbour "
                                 f"rank {peer} over {_plan_text(theirs)}: give every rank the same "
                                 f"{TOPOLOGY_ENV} (or topology=), and cable or link them alike")


def _neighbours(rank: int, ring: List[int]) -> List[int]:
    k = ring.index(rank)
    return [ring[k - 1], ring[(k + 1) % len(ring)]]


def _plan_text(plan: np.ndarray) -> str:
    ranks = [int(r) for r in plan if r != _MESH]
    return f"the ring {'-'.join(map(str, ranks))}" if ranks else "the full mesh"


def _swap(link, table: np.ndarray) -> np.ndarray:
    got = np.empty_like(table)
    Exchange(link, table)(table, got)
    return got


def _learn(rank: int, size: int, peers: Sequence[int],
           swap: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """Every rank's two neighbours, (size, 2): each rank's own row passed on to its neighbours
    size // 2 times, so every row goes half-way round each way. Each step meets the two
    links in the order of their (lower rank, higher rank), the same on every rank, so no two
    neighbours wait on each other in a circle."""
    table = np.full((size, 2), _UNKNOWN, dtype=np.uint8)
    table[rank] = peers
    order = sorted(peers, key=lambda peer: (min(rank, peer), max(rank, peer)))
    for _ in range(size // 2):
        for peer in order:
            got = swap(peer, table)
            fresh = (table[:, 0] == _UNKNOWN) & (got[:, 0] != _UNKNOWN)
            table[fresh] = got[fresh]
    return table


def _cycle(table: np.ndarray, size: int) -> List[int]:
    """The ranks in cycle order from the neighbours' table; refused unless it is one cycle of
    every rank (the same table on every rank, so every rank decides alike)."""
    rows = {r: sorted(int(x) for x in table[r]) for r in range(size)}
    order, prev, here, closed = [0], None, 0, False
    for _ in range(size):
        options = rows[here][:1] if prev is None else [p for p in rows[here] if p != prev]
        if not options or options[0] not in rows or here not in rows[options[0]]:
            break
        if options[0] == 0:
            closed = True
            break
        if options[0] in order:
            break
        order.append(options[0])
        prev, here = here, options[0]
    if not closed or len(order) != size:
        links = ", ".join(f"{r}: {rows[r]}" for r in range(size))
        raise TransportError(f"the links of the {size} ranks form no single ring (each rank's links: "
                             f"{links}); cable each Mac to two others so the cables close one cycle "
                             "through every Mac, or link every pair")
    return order
