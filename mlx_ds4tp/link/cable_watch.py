"""A formed group's cables watched while it runs: a Thunderbolt cable pulled out makes its two
ends go quiet, no FIN, no RST, so the gates on it would wait out the whole timeout
(DS4_TP_TIMEOUT_SEC, 300 s by default) and then say only "timed out". Instead each rank looks at
the interfaces its links run on a few times a second; one that is gone, down, without carrier
or without its address is the cable out: the rank fails its group at once (every link's data
socket shut down, as the first failed exchange does, so the other ranks fail within moments)
and says which two ranks have no cable now, and on which interfaces.

The check is also asked when a collective fails (cable_fault), so the failure is named even
when the exchange noticed first (a send on an interface that went down fails at once).
"""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
import sys
import threading
from typing import Callable, Dict, List, Optional

from ..base.log import log
from .cables import Cable, local_cables

# How often a rank looks at its cables: a pulled cable is named within this (and the
# other ranks' failure after it within moments), far inside any gate timeout.
WATCH_PERIOD_SEC = 0.25
_IFF_UP = 0x1
_IFF_RUNNING = 0x40  # Linux: the link has carrier (operstate up); the same bit on macOS
_SIOCGIFFLAGS = 0xC0206911 if sys.platform == "darwin" else 0x8913


def interface_trouble(interface: str, ip: str) -> Optional[str]:
    """Why the cable on `interface` (this end's address `ip`) carries nothing now, or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        request = struct.pack("16sH14x", interface.encode("utf-8")[:15], 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request))[1]
    except OSError as exc:
        if exc.errno in (errno.ENODEV, errno.ENXIO):
            return f"interface {interface} is gone"
        return None  # the check itself is unavailable: say nothing rather than guess
    finally:
        probe.close()
    if not flags & _IFF_UP:
        return f"interface {interface} is down"
    if not flags & _IFF_RUNNING:
        return f"interface {interface} has no carrier (the cable is out, or its other end is down)"
    if ip not in {c.ip for c in local_cables([interface])}:
        return f"interface {interface} lost its address {ip}"
    return None


def fault_text(rank: int, peer: int, cable: Cable, why: str) -> str:
    """The failure a pulled cable is reported as: the two ranks, both ends, and the fix."""
    low, high = min(rank, peer), max(rank, peer)
    return (f"rank {low} and rank {high} have no cable now: the cable between rank {rank} "
            f"({cable.mine.interface} {cable.mine.ip}) and rank {peer} ({cable.theirs.interface} "
            f"{cable.theirs.ip}) stopped: {why}; plug the cable back in (check it with `ds4tp doctor`) "
            "and start the group again")


class CableWatch:
    """This rank's cables ({peer rank: Cable}), watched by a daemon thread from start() until
    close(); on the first one out, `on_fault(text)` runs once (the group fails) and `fault`
    keeps the text."""

    def __init__(self, rank: int, cables: Dict[int, Cable], on_fault: Callable[[str], None],
                 period: float = WATCH_PERIOD_SEC) -> None:
        self.rank = rank
        self.cables = dict(sorted(cables.items()))
        self.on_fault = on_fault
        self.period = period
        self.fault: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ds4tp-cable-watch", daemon=True)

    def check(self) -> Optional[str]:
        """The first cable out now, as fault_text says it; None while every cable carries."""
        for peer, cable in self.cables.items():
            why = interface_trouble(cable.mine.interface, cable.mine.ip)
            if why:
                return fault_text(self.rank, peer, cable, why)
        return None

    def explain(self) -> Optional[str]:
        """The cable out, if one is: the one the thread saw, else the check now."""
        return self.fault or self.check()

    def start(self) -> None:
        if self.cables:
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period + 1.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            text = self.check()
            if text is not None:
                self.fault = text
                log(f"mesh: {text}")
                self.on_fault(text)
                return


def watch_cables(rank: int, size: int, cables: Dict[int, Optional[Cable]],
                 data: List[socket.socket]) -> Optional[CableWatch]:
    """A group of 3 or more whose links run on cables: its cables watched from now on, a pulled
    one failing every link at once (each data socket shut down, as the first failed exchange
    does in C). None for a pair (its cable pulled is its gate timeout, as always) or no cables."""
    cabled = {peer: cable for peer, cable in cables.items() if cable is not None}
    if size <= 2 or not cabled:
        return None

    def fail_links(_why: str) -> None:
        for sock in data:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watch = CableWatch(rank, cabled, fail_links)
    watch.start()
    return watch
