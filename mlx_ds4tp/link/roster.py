"""The ROSTER frame (link/mesh.py's membership): what the leader tells each worker once every
rank joined: every rank's address (the one the leader saw it at; "" for the leader, which the
worker dialed) and door port, the receiving worker's rank, and every rank's cable addresses
(link/cables.py), so every rank computes the same wiring."""

from __future__ import annotations

from typing import List, Tuple

from ..errors import FrameError
from .cables import CableAddress, pack_cables, unpack_cables
from .wire import MAX_MESH_SIZE, ROSTER_ENTRY, ROSTER_HEADER


def pack_roster(roster: List[Tuple[str, int]], rank: int, cables: List[List[CableAddress]]) -> bytes:
    out = ROSTER_HEADER.pack(len(roster), rank)
    for (host, port), theirs in zip(roster, cables):
        name = host.encode("utf-8")
        out += ROSTER_ENTRY.pack(port, len(name)) + name + pack_cables(theirs)
    return out


def unpack_roster(payload: bytes) -> Tuple[List[Tuple[str, int]], int, List[List[CableAddress]]]:
    """(every rank's (host, port), the receiving rank, every rank's cable addresses); host "" is
    the address the receiver dialed the leader at."""
    if len(payload) < ROSTER_HEADER.size:
        raise FrameError(f"ROSTER payload is {len(payload)} bytes, need {ROSTER_HEADER.size}")
    size, rank = ROSTER_HEADER.unpack_from(payload)
    if not 2 <= size <= MAX_MESH_SIZE:
        raise FrameError(f"ROSTER names {size} ranks; a group has 2 to {MAX_MESH_SIZE}")
    at, roster, cables = ROSTER_HEADER.size, [], []
    for _ in range(size):
        if at + ROSTER_ENTRY.size > len(payload):
            raise FrameError("ROSTER payload ends inside an entry")
        port, n = ROSTER_ENTRY.unpack_from(payload, at)
        at += ROSTER_ENTRY.size
        roster.append((payload[at:at + n].decode("utf-8"), port))
        theirs, at = unpack_cables(payload, at + n)
        cables.append(theirs)
    if not 0 < rank < size:
        raise FrameError(f"ROSTER gives this worker rank {rank} of {size}")
    return roster, rank, cables
