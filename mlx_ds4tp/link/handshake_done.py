"""What the handshake leaves behind: both connections open, the hellos
swapped, the transport agreed, and no exchange yet.

Only connect() (handshake.py) and the RDMA bring-up (rdma_bringup.py) ever see
one: connect() turns it into a complete Pair, with its queue pair proven or
TCP chosen, so no caller can run an exchange on a pair that is still half built.
"""

from __future__ import annotations

import dataclasses
import socket

from .config import LinkSettings
from .control import ControlChannel
from .hello import Hello
from .rdma import RdmaDevice, RdmaOpening


@dataclasses.dataclass(frozen=True)
class HandshakeDone:
    """The two ranks after hello, authentication and the transport choice.
    transport: the agreed one, "tcp" or "rdma" (the bring-up may still fall
    back from "rdma" to TCP under transport=auto)."""

    config: LinkSettings
    control: ControlChannel
    data: socket.socket
    mine: Hello
    theirs: Hello
    transport: str

    @property
    def rank(self) -> int:
        """0 for the leader, 1 for the worker."""
        return self.config.rank

    def open_rdma(self) -> RdmaDevice:
        """Open this side's RDMA device for the pair (its queue pair not yet
        built, connected or warmed up: that is rdma_bringup.bring_up_rdma's work)."""
        cfg = self.config
        return RdmaDevice(RdmaOpening(
            device=cfg.rdma_device,
            gid_index=cfg.gid_index,
            rank=self.rank,
            bind_ip=self.control.sock.getsockname()[0],
            control_fd=self.control.fileno(),
            data_fd=self.data.fileno(),
            timeout=float(cfg.timeout),
            verbs_library=cfg.verbs_library,
            faults=cfg.ucsim_faults,
            no_imm=cfg.rdma_no_imm,
        ))

    def close(self) -> None:
        """Close both connections (a bring-up that failed hard, or Pair.close)."""
        for sock in (self.data, self.control.sock):
            try:
                sock.close()
            except OSError:
                pass
