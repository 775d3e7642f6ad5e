"""`ds4tp doctor`'s wiring table over a formed group (doctor_mesh.group_checks calls it): one row
per link of this rank, ranks by ranks, with the interface, address and device at both ends (the
cable each link found, link/cables.py), its transport, a gate's round trip (16 KiB, p50 and p99)
and its bulk bandwidth (4 MiB exchanges), each timed on that link alone.

The links are timed one at a time in the order every rank walks them ((0, 1), (0, 2) .. (1, 2)
..), each rank taking part in its own: as when the links formed, the smallest link not yet timed
always has both its ranks at it, so the walk never deadlocks.
"""

from __future__ import annotations

import json
import time
from typing import Any, List, Optional, Tuple

from ..link.cables import Cable, cable_device, device_label
from .doctor_lines import OK, WARN, Check, line

GATE_TRIPS = 300
GATE_WARM = 50
GATE_ELEMENTS = 4096  # 16 KiB of float32: a decode step's gate
BULK_TRIPS = 8
BULK_ELEMENTS = 1 << 20  # 4 MiB of float32: a prefill's gate


def wiring_checks(group: Any) -> List[Check]:
    """The wiring table: this rank's links' rows, each timed on its own, then the rows of every
    other link as the lower rank of it measured them (gathered from every rank), so each rank
    prints the whole table."""
    size, rank = group.size(), group.rank()
    mine: List[Row] = []
    for low in range(size):
        for high in range(low + 1, size):
            if rank in (low, high):
                peer = high if rank == low else low
                mine.append(_row(group, rank, peer))
                line(*mine[-1][1:])
    out: List[Check] = [(status, what) for _, status, what, _ in mine]
    for by, rows in enumerate(_gathered(group, mine)):
        for (low, high), status, what, detail in rows:
            if by == low and rank not in (low, high):
                out.append(line(status, what, detail))
    return out


# One row of the table: ((lower rank, higher rank), status, what, detail).
Row = Tuple[Tuple[int, int], str, str, str]
ROWS_BYTES = 8192  # one rank's rows as JSON, padded: at most 7 rows of a few hundred bytes


def _gathered(group: Any, mine: List[Row]) -> List[List[Row]]:
    """Every rank's rows, by rank (one all_gather of each rank's rows as padded JSON)."""
    import mlx.core as mx
    import numpy as np

    from .. import gate_ops

    raw = json.dumps([[list(k), s, w, d] for k, s, w, d in mine]).encode()[:ROWS_BYTES]
    padded = np.frombuffer(raw + b" " * (ROWS_BYTES - len(raw)), dtype=np.uint8)
    every = np.array(gate_ops.all_gather(mx.array(padded), group=group)).tobytes()
    out = []
    for r in range(group.size()):
        try:
            rows = json.loads(every[r * ROWS_BYTES:(r + 1) * ROWS_BYTES].decode().rstrip())
            out.append([(tuple(k), s, w, d) for k, s, w, d in rows])
        except ValueError:  # a row list cut at ROWS_BYTES: that rank's rows it printed itself
            out.append([])
    return out


def _row(group: Any, rank: int, peer: int) -> Row:
    from ..bench.gates import percentiles

    pair = group.link_to(peer)
    cable: Optional[Cable] = group.mesh.cables.get(peer)
    gate = _timed(group, peer, GATE_ELEMENTS, GATE_TRIPS)[GATE_WARM:]
    bulk = _timed(group, peer, BULK_ELEMENTS, BULK_TRIPS)[1:]
    p = percentiles(gate)
    gbps = 2 * 4 * BULK_ELEMENTS * len(bulk) / max(1, sum(bulk))  # both directions, bytes per ns
    ends = _ends(pair, cable, rank, peer)
    status, missing = OK, ""
    if cable is None and any(group.mesh.cables.values()):
        # Cables named, none between these two: its own diagnosis (a ring of cables needs none
        # between ranks that are no neighbours: the collectives go round it).
        ring = getattr(group.mesh, "cabled_ring", [])
        if not ring:
            status = WARN
            missing = (f"; a missing cable: rank {rank} and rank {peer} share no cable, so this link runs "
                       "over the route, without RDMA; cable these two Macs (one subnet per cable), or cable "
                       "every Mac to two others closing one ring")
    detail = (f"{ends}; transport {pair.transport}; gate 16 KiB p50 {p['p50_us']} us p99 {p['p99_us']} us; "
              f"bulk 4 MiB {gbps:.2f} GB/s{missing}")
    return (min(rank, peer), max(rank, peer)), status, f"wiring rank {rank} <-> rank {peer}", detail


def _ends(pair: Any, cable: Optional[Cable], rank: int, peer: int) -> str:
    """Both ends of the link: the cable's interfaces, addresses and devices, or the route."""
    if cable is None:
        return f"no cable: over the route to rank {peer} at {pair.data.getpeername()[0]}"
    device = pair.rdma.device if pair.rdma is not None else None
    if device is None:
        return (f"rank {rank} {cable.mine.interface} {cable.mine.ip} <-> rank {peer} "
                f"{cable.theirs.interface} {cable.theirs.ip} (no RDMA device on this link)")
    theirs = cable_device(cable.theirs.interface, device if device == "ucsim" else None)
    return (f"rank {rank} {cable.mine.interface} {cable.mine.ip} {device_label(device, cable.mine.interface)} "
            f"<-> rank {peer} {cable.theirs.interface} {cable.theirs.ip} "
            f"{device_label(theirs or device, cable.theirs.interface)}")


def _timed(group: Any, peer: int, elements: int, trips: int) -> List[int]:
    """Nanoseconds of `trips` exchanges of `elements` float32 on the link to `peer` alone."""
    import numpy as np

    from ..link.exchange import Exchange

    send = np.full((elements,), 1.0, dtype=np.float32)
    recv = np.empty_like(send)
    exchange = Exchange(group.c_link(peer), send)
    out = []
    for _ in range(trips):
        t0 = time.perf_counter_ns()
        exchange(send, recv)
        out.append(time.perf_counter_ns() - t0)
    return out
