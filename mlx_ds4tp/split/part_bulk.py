"""A part's bytes over the group's RDMA bulk path, where the worker's link is RDMA (its queue pair
proven at the bring-up: link.connection.Pair.transport is "rdma"): each chunk of a part file
travels as one exchange of that link (link/exchange.py: tp_link_exchange, the large exchanges'
bulk rounds the gates' prefills run), not inside a PART_DATA frame. The offer, the wants and
each file's end (its digest) stay on the control channel, and so does a short PART_DATA before
each chunk giving its length: the worker waits for it as long as for any frame (the leader may
be reading a large array from a cold disk) and enters the exchange only when the leader does,
so no exchange waits out the link's timeout.

An exchange moves the same bytes both ways: the worker's way carries zeros (that direction is
idle during the transfer). A short last chunk is padded to the exchange's size."""

from __future__ import annotations

import struct
from typing import Any, Optional

import numpy as np

from ..link.exchange import Exchange

CHUNK_LENGTH = struct.Struct("<Q")  # a PART_DATA's payload on the bulk path: the next chunk's bytes
RDMA_PATH, CONTROL_PATH = "rdma", "tcp"


class BulkPath:
    """The exchanges of `chunk` bytes on one RDMA link: send(piece) on the leader, receive_into(buffer)
    on the worker, one call each a chunk, in the same order on both."""

    def __init__(self, c_link: Any, chunk: int):
        self.chunk = chunk
        self.exchange = Exchange(c_link, np.empty(chunk, np.uint8))
        self.padded = np.zeros(chunk, np.uint8)  # a short last chunk, padded
        self.sink = np.empty(chunk, np.uint8)  # the worker's way, on the leader: not looked at
        self.quiet = np.zeros(chunk, np.uint8)  # what the worker sends its way

    def send(self, piece: memoryview) -> None:
        data = np.frombuffer(piece, np.uint8)
        if len(data) != self.chunk:
            if len(data) > self.chunk:
                raise ValueError(f"a chunk of {len(data)} bytes is over the bulk path's {self.chunk}")
            self.padded[: len(data)] = data
            data = self.padded
        self.exchange(data, self.sink)

    def receive_into(self, buffer: memoryview) -> None:
        """The next chunk into buffer (at least `chunk` bytes; the leader's PART_DATA said how
        many of them are the file's)."""
        self.exchange(self.quiet, np.frombuffer(buffer, np.uint8)[: self.chunk])


def bulk_path(group: Any, peer: int, chunk: int) -> Optional[BulkPath]:
    """The bulk path to rank `peer` when the group's link to it is RDMA; None otherwise (TCP: the
    control channel's PART_DATA frames carry the bytes, as fast as the link's socket)."""
    link_to, c_link = getattr(group, "link_to", None), getattr(group, "c_link", None)
    if not callable(link_to) or not callable(c_link) or getattr(link_to(peer), "transport", "") != RDMA_PATH:
        return None
    return BulkPath(c_link(peer), chunk)


__all__ = ["CHUNK_LENGTH", "CONTROL_PATH", "RDMA_PATH", "BulkPath", "bulk_path"]
