"""`ds4tp doctor --interface NAME ...`: each cable named, diagnosed at its port, by name and with
its fix: an interface that is gone, down or without carrier (a missing cable), an interface up
without an IPv4 address, a cable whose two ends are on different subnets (a swapped cable: the
cable in another port than its addresses say), a cable that carries one direction only.

While the doctors of the Macs form their group (they run at once, on every Mac), each one
broadcasts a small hello out of every cable interface and listens on each: what arrives on an
interface came over that cable from its other end, whatever the addresses say. A hello carries
the sender's interface, address and what it has heard itself, so each end learns its neighbour
and whether its own hellos arrive there. The hello is larger than the smallest MTU, so a cable
that passes only small frames one way is caught too.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import socket
import sys
import threading
import time
from typing import Dict, List, Sequence

from ..link.cable_watch import interface_trouble
from ..link.cables import CableAddress, local_cables
from .doctor_lines import FAIL, OK, WARN, Check, line

PROBE_PORT = 9917
PROBE_EVERY_SEC = 0.2
# How long an end listens before it judges a cable: hellos from a Mac whose doctor started
# later, and that Mac hearing ours, take a moment.
PROBE_WINDOW_SEC = 3.0
HELLO_BYTES = 600  # over a small MTU: a cable passing only small frames one way shows as one way
_MAGIC = "ds4tp-cable"
_SO_BINDTODEVICE = 25  # Linux
_IP_BOUND_IF = 25  # macOS
_IP_MTU_DISCOVER, _IP_PMTUDISC_DONT = 10, 0  # Linux: let a hello fragment where the MTU is small


@dataclasses.dataclass
class Heard:
    """The other end of one cable, as its hellos said: its interface, address, and whether it
    heard this end (our token in its list)."""

    interface: str
    address: CableAddress
    hears_us: bool
    first: float


class CableProbe:
    """The hellos on this Mac's cable interfaces `names`, from start() until close()."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.token = secrets.token_hex(8)
        self.started = time.monotonic()
        self.heard: Dict[str, Dict[str, Heard]] = {n: {} for n in self.names}
        self.unprobed: Dict[str, str] = {}  # interface -> why it could not be probed
        self._socks: Dict[str, socket.socket] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []

    def start(self) -> None:
        for name in self.names:
            mine = local_cables([name])
            if not mine:
                continue  # no address: diagnosed as such, nothing to say hello from
            try:
                self._socks[name] = _bound_socket(name)
            except OSError as exc:
                self.unprobed[name] = f"cannot listen on {name} alone ({exc})"
                continue
            for target in (self._send, self._listen):
                t = threading.Thread(target=target, args=(name, mine[0]), daemon=True,
                                     name=f"ds4tp-cable-probe-{name}")
                t.start()
                self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
        for sock in self._socks.values():
            sock.close()

    def settle(self) -> None:
        """Wait (at most PROBE_WINDOW_SEC from the start, or from first hearing a neighbour)
        until every probed cable's far end heard this end too."""
        while True:
            now = time.monotonic()
            with self._lock:
                pending = [h for n in self._socks for h in self.heard[n].values() if not h.hears_us]
                silent = [n for n in self._socks if not self.heard[n]]
            waits = [h.first + PROBE_WINDOW_SEC for h in pending]
            if silent:
                waits.append(self.started + PROBE_WINDOW_SEC)
            until = max(waits, default=now)
            if until <= now:
                return
            time.sleep(min(0.1, until - now))

    def _hello(self, name: str, mine: CableAddress) -> bytes:
        with self._lock:
            heard = sorted(self.heard[name])
        body = json.dumps({"m": _MAGIC, "t": self.token, "if": name, "ip": mine.ip, "p": mine.prefix,
                           "heard": heard}).encode()
        return body + b" " * max(0, HELLO_BYTES - len(body))

    def _send(self, name: str, mine: CableAddress) -> None:
        sock = self._socks[name]
        while not self._stop.is_set():
            try:
                sock.sendto(self._hello(name, mine), ("255.255.255.255", PROBE_PORT))
            except OSError:
                pass  # a cable out: nothing is heard, and that is the diagnosis
            self._stop.wait(PROBE_EVERY_SEC)

    def _listen(self, name: str, _mine: CableAddress) -> None:
        sock = self._socks[name]
        sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = sock.recv(4096)
                hello = json.loads(data.decode("utf-8", "replace").rstrip())
                if hello.get("m") != _MAGIC or hello.get("t") == self.token:
                    continue
                address = CableAddress(str(hello["if"]), str(hello["ip"]), int(hello["p"]))
                hears_us = self.token in hello.get("heard", [])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            with self._lock:
                before = self.heard[name].get(hello["t"])
                first = before.first if before is not None else time.monotonic()
                self.heard[name][hello["t"]] = Heard(address.interface, address,
                                                     hears_us or (before is not None and before.hears_us), first)


def _bound_socket(name: str) -> socket.socket:
    """A UDP socket that sends and hears on interface `name` alone, broadcast allowed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        if sys.platform == "darwin":
            sock.setsockopt(socket.IPPROTO_IP, _IP_BOUND_IF, socket.if_nametoindex(name))
        else:
            sock.setsockopt(socket.SOL_SOCKET, _SO_BINDTODEVICE, name.encode() + b"\0")
            sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DONT)
        sock.bind(("", PROBE_PORT))
    except OSError:
        sock.close()
        raise
    return sock


ADDRESS_FIX = ("give both ends of the cable an IPv4 address on a subnet of their own, e.g. 10.0.K.1/30 "
               "here and 10.0.K.2/30 at the other end (macOS: System Settings > Network > the "
               "Thunderbolt port > Details > TCP/IP > Manually; Linux: ip addr add 10.0.K.1/30 dev {name})")


def cable_checks(probe: CableProbe) -> List[Check]:
    """One line per cable interface: its diagnosis and fix, or ok with both ends."""
    probe.settle()
    out = []
    for name in probe.names:
        mine = local_cables([name])
        what = f"cable {name}"
        if not mine:
            trouble = interface_trouble(name, "")
            if trouble and "lost its address" not in trouble:
                out.append(line(FAIL, what, f"missing cable: {trouble}; plug the cable in (one per two Macs) "
                                "and bring the interface up, or name another with --interface"))
            else:
                out.append(line(FAIL, what, f"an interface without an address: {name} is up but has no IPv4 "
                                "address, so no link can find the Mac at its other end; "
                                + ADDRESS_FIX.format(name=name)))
            continue
        out.append(_diagnose(probe, name, mine[0]))
    return out


def _diagnose(probe: CableProbe, name: str, mine: CableAddress) -> Check:
    what = f"cable {name}"
    here = f"{name} {mine.ip}/{mine.prefix}"
    trouble = interface_trouble(name, mine.ip)
    if trouble:
        return line(FAIL, what, f"missing cable: {trouble}; plug the cable in firmly (one per two Macs), "
                    "or name another with --interface")
    if name in probe.unprobed:
        return line(WARN, what, f"{here}: up; {probe.unprobed[name]}, so its other end is not checked")
    ends = list(probe.heard[name].values())
    if not ends:
        return line(FAIL, what, f"missing cable: nothing answered on {here} in {PROBE_WINDOW_SEC:.0f} s: no cable "
                    "in this port, no `ds4tp doctor` running at its other end, or a cable that carries "
                    "nothing towards this Mac (the other end's doctor says so); plug the cable in and run "
                    "`ds4tp doctor` on every Mac at once")
    if len(ends) > 1:
        others = ", ".join(f"{e.interface} {e.address.ip}" for e in ends)
        return line(WARN, what, f"{here} reaches {len(ends)} others ({others}): a switch or a bridge, not "
                    "one cable between two Macs; cable each two Macs directly")
    end = ends[0]
    there = f"{end.interface} {end.address.ip}/{end.address.prefix}"
    if not mine.reaches(end.address):
        swapped = [c for c in local_cables(probe.names) if c.interface != name and c.reaches(end.address)]
        hint = (f" (this Mac's {swapped[0].interface} {swapped[0].ip}/{swapped[0].prefix} is on that subnet: the "
                f"cables in {name} and {swapped[0].interface} are swapped)" if swapped else "")
        return line(FAIL, what, f"a swapped cable: {here} reaches {there} at its other end, which is not on "
                    f"{name}'s subnet{hint}, so the link that addresses pick for this cable runs elsewhere; swap "
                    "the cables back, or give both ends of this cable addresses on one subnet")
    if not end.hears_us:
        return line(FAIL, what, f"a cable that carries one direction only: {here} hears {there}, but "
                    f"{end.interface} does not hear {name}; reseat or replace the cable (a damaged one), "
                    "and check that nothing on either Mac filters that interface")
    return line(OK, what, f"{here} <-> {there}, both ways")

