"""`ds4tp doctor`'s wiring table over a formed group (doctor_mesh.group_checks calls it): one row
per link of this rank, ranks by ranks, with the interface, address and device at both ends (the
cable each link found, link/cables.py), its transport, a gate's round trip (16 KiB, p50 and p99)
and its bulk bandwidth (4 MiB exchanges), each timed on that link alone.

The links are timed one at a time in the order every rank walks them ((0, 1), (0, 2) .. (1, 2)
..), each rank taking part in its own: as when the links formed, the smallest link not yet timed
always has both its ranks at it, so the walk never deadlocks.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional

from ..link.cables import Cable, cable_device, device_label
from .doctor_lines import OK, Check, line

GATE_TRIPS = 300
GATE_WARM = 50
GATE_ELEMENTS = 4096  # 16 KiB of float32: a decode step's gate
BULK_TRIPS = 8
BULK_ELEMENTS = 1 << 20  # 4 MiB of float32: a prefill's gate


def wiring_checks(group: Any) -> List[Check]:
    """The wiring table's rows for this rank's links, each timed on its own."""
    size, rank = group.size(), group.rank()
    rows = []
    for low in range(size):
        for high in range(low + 1, size):
            if rank in (low, high):
                peer = high if rank == low else low
                rows.append(_row(group, rank, peer))
    return rows


def _row(group: Any, rank: int, peer: int) -> Check:
    from ..bench.gates import percentiles

    pair = group.link_to(peer)
    cable: Optional[Cable] = group.mesh.cables.get(peer)
    gate = _timed(group, peer, GATE_ELEMENTS, GATE_TRIPS)[GATE_WARM:]
    bulk = _timed(group, peer, BULK_ELEMENTS, BULK_TRIPS)[1:]
    p = percentiles(gate)
    gbps = 2 * 4 * BULK_ELEMENTS * len(bulk) / max(1, sum(bulk))  # both directions, bytes per ns
    ends = _ends(pair, cable, rank, peer)
    return line(OK, f"wiring rank {rank} <-> rank {peer}",
                f"{ends}; transport {pair.transport}; gate 16 KiB p50 {p['p50_us']} us p99 {p['p99_us']} us; "
                f"bulk 4 MiB {gbps:.2f} GB/s")


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
