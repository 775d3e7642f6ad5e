"""RANK_STATS: the leader's question for the cluster page (`ds4tp serve`'s GET /cluster) and each
rank's answer about itself: its host name, chip, memory (the machine's total, what MLX's arrays
hold now) and, for each of its links, the transport, the device and the recent decode gates'
round trips. The leader reads its own figures directly (rank_figures); a worker answers the
query with the same figures, as JSON (a handful of fields, read by a page, not a hot path)."""

from __future__ import annotations

import functools
import json
import os
import socket
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np

from ....errors import FrameError
from .base import Command, F, command

STATS_BOUND = 16384


@functools.lru_cache(maxsize=1)
def _machine() -> Dict[str, Any]:
    """This machine's chip name and total memory in bytes, as MLX reports them (an Apple chip's
    name and its unified memory); elsewhere the CPU's name and the physical memory. Read once:
    neither changes while the rank runs."""
    try:
        info = dict(mx.device_info())
    except Exception:  # noqa: BLE001 - an MLX without device_info: the figures stay unknown
        info = {}
    total = int(info.get("memory_size") or 0)
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
    return {"chip": str(info.get("device_name") or ""), "memory_total_bytes": int(total)}


def _link_device(pair) -> str:
    """The RDMA device a link runs over, or for TCP the local address its gate socket uses."""
    if pair.rdma is not None:
        return pair.rdma.device or "rdma"
    try:
        return str(pair.data.getsockname()[0])
    except OSError:
        return ""


def link_figures(group) -> List[Dict[str, Any]]:
    """Each of this rank's links: the peer, transport, device, the recent decode gates' p50 and
    p99 round trips (microseconds; None before any gate, so no figure reads as a fast link) and
    the gates run on it since start."""
    out = []
    for peer, pair in sorted(group.mesh.pairs.items()):
        ring = group.latency_ring(peer)
        recent = ring.recent()
        p50 = p99 = None
        if recent.size:
            p50, p99 = (round(float(v), 1) for v in np.percentile(recent, [50, 99]) / 1000.0)
        out.append({"peer": int(peer), "transport": pair.transport, "device": _link_device(pair),
                    "gate_p50_us": p50, "gate_p99_us": p99,
                    "gates": int(ring.count[0])})
    return out


def rank_figures(group) -> Dict[str, Any]:
    """This rank's figures for the cluster page: host, chip, memory total and used (the bytes
    MLX's arrays hold now: the rank's part of the weights and its caches), its links."""
    return {"rank": group.rank(), "host": socket.gethostname(), **dict(_machine()),
            "memory_used_bytes": int(mx.get_active_memory()), "links": link_figures(group)}


@command
class RankStats(Command):
    """Asked with an empty object; answered with the worker's rank_figures, both as JSON."""

    frame = F.RANK_STATS
    bound = STATS_BOUND
    answers = True

    @classmethod
    def pack(cls, figures: Dict[str, Any]) -> bytes:
        payload = json.dumps(figures, separators=(",", ":")).encode()
        if len(payload) > STATS_BOUND:
            raise FrameError(f"RANK_STATS figures are {len(payload)} bytes; at most {STATS_BOUND}")
        return payload

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> tuple:
        try:
            figures = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise FrameError(f"RANK_STATS payload is not JSON: {exc}") from None
        if not isinstance(figures, dict):
            raise FrameError(f"RANK_STATS payload is {type(figures).__name__}, expected a JSON object")
        return (figures,)

    @classmethod
    def answer(cls, table, _asked: Dict[str, Any]) -> bytes:
        if table.group is None:
            raise FrameError("RANK_STATS asked of a rank that serves no group")
        return cls.pack(rank_figures(table.group))
