"""Which cable each link of a group runs on: a rank's cable interfaces (--interface NAME, the
Thunderbolt ports of a Mac) and their IPv4 addresses travel in its JOIN and the leader's
ROSTER, so every rank knows every rank's; a link between two ranks runs on the cable whose two
ends share a subnet (one subnet per cable, as Thunderbolt links are set up: the peer at the
other end of that interface is the only one on it), dialed at the peer's address there, and
opens the RDMA device of that interface (`rdma_enN` for interface enN on a Mac; with ucsim the
emulated device bound to that interface's address, named `ucsim:IFNAME`).

Every rank computes the same wiring from the same roster, so a group it cannot cable is refused
on every rank at once, before any link is tried.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import struct
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import FrameError, MissingCableError, RdmaUnavailableError

UCSIM = "ucsim"  # link/rdma.py's name for the emulated device (rdma.py imports the verbs module)
_CABLE_HEAD = struct.Struct("<B")  # how many cable addresses follow
_CABLE = struct.Struct("<4sBB")  # IPv4 address, prefix length, interface name length; then the name
MAX_CABLES = 16


@dataclasses.dataclass(frozen=True)
class CableAddress:
    """One IPv4 address of one of a rank's cable interfaces: interface name, address, prefix."""

    interface: str
    ip: str
    prefix: int

    def reaches(self, other: "CableAddress") -> bool:
        """Whether `other` is on this address's subnet (the other end of this cable)."""
        net = ipaddress.ip_network(f"{self.ip}/{self.prefix}", strict=False)
        return ipaddress.ip_address(other.ip) in net and self.prefix == other.prefix


@dataclasses.dataclass(frozen=True)
class Cable:
    """A link's cable: this rank's end and the peer's (each an interface and its address)."""

    mine: CableAddress
    theirs: CableAddress


def local_cables(names: Sequence[str]) -> List[CableAddress]:
    """The IPv4 addresses of this machine's interfaces `names` (the cables to use), in that
    order; an interface with no IPv4 address has none here."""
    import ifaddr

    by_name = {a.nice_name: a for a in ifaddr.get_adapters()}
    out: List[CableAddress] = []
    for name in names:
        adapter = by_name.get(name)
        for ip in adapter.ips if adapter is not None else ():
            # Loopback is no cable: only this machine is at its other end.
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback:
                out.append(CableAddress(name, ip.ip, int(ip.network_prefix)))
    return out[:MAX_CABLES]


def pack_cables(cables: Sequence[CableAddress]) -> bytes:
    out = _CABLE_HEAD.pack(len(cables))
    for c in cables:
        name = c.interface.encode("utf-8")
        out += _CABLE.pack(ipaddress.IPv4Address(c.ip).packed, c.prefix, len(name)) + name
    return out


def unpack_cables(payload: bytes, at: int) -> Tuple[List[CableAddress], int]:
    """(the cable addresses packed at `at`, the offset after them)."""
    if at + _CABLE_HEAD.size > len(payload):
        raise FrameError("a JOIN or ROSTER ends before its cable addresses")
    (n,), at = _CABLE_HEAD.unpack_from(payload, at), at + _CABLE_HEAD.size
    if n > MAX_CABLES:
        raise FrameError(f"{n} cable addresses in one rank's entry; at most {MAX_CABLES}")
    out = []
    for _ in range(n):
        if at + _CABLE.size > len(payload):
            raise FrameError("a cable address ends early")
        ip, prefix, length = _CABLE.unpack_from(payload, at)
        at += _CABLE.size
        if prefix > 32 or at + length > len(payload):
            raise FrameError(f"a cable address has prefix /{prefix} or a name past the payload's end")
        out.append(CableAddress(payload[at:at + length].decode("utf-8", "replace"),
                                str(ipaddress.IPv4Address(ip)), prefix))
        at += length
    return out, at


def find_cable(mine: Sequence[CableAddress], theirs: Sequence[CableAddress]) -> Optional[Cable]:
    """The cable between two ranks: the first of this rank's addresses whose subnet holds one of
    the peer's; None when they share none."""
    for a in mine:
        for b in theirs:
            if a.reaches(b) and a.ip != b.ip:
                return Cable(a, b)
    return None


def cable_device(interface: str, rdma_device: Optional[str], platform: str = sys.platform) -> Optional[str]:
    """The RDMA device of cable interface `interface`: ucsim when asked for (bound to the
    interface's address by the link's own socket), rdma_enN for enN on a Mac, else the
    --rdma-device given (None: the first active one)."""
    if rdma_device == UCSIM:
        return UCSIM
    if platform == "darwin" and rdma_device is None:
        return f"rdma_{interface}"
    return rdma_device


def device_label(device: Optional[str], interface: str) -> str:
    """The device as messages name it: `ucsim:IFNAME` for the emulated one, else its name."""
    if device == UCSIM:
        return f"{UCSIM}:{interface}"
    return device or "the first active device"


def opened_device(named: str) -> str:
    """What the verbs layer opens for a device named on the command line (`ucsim:IF` is ucsim)."""
    return UCSIM if named.startswith(UCSIM + ":") else named


@dataclasses.dataclass(frozen=True)
class Wiring:
    """A rank's view of its group's cables: every rank's cable addresses, by rank."""

    cables: List[List[CableAddress]]

    @property
    def named(self) -> bool:
        """Whether the group named cables at all (else every link runs over the roster's route)."""
        return any(self.cables)

    def cable(self, rank: int, peer: int) -> Optional[Cable]:
        return find_cable(self.cables[rank], self.cables[peer])

    def uncabled(self) -> List[Tuple[int, int]]:
        size = len(self.cables)
        return [(a, b) for a in range(size) for b in range(a + 1, size) if self.cable(a, b) is None]

    def cabled_peers(self, rank: int) -> List[int]:
        return [p for p in range(len(self.cables)) if p != rank and self.cable(rank, p) is not None]

    def ring(self) -> List[int]:
        """The ranks in cycle order (from 0 towards its lower neighbour) when the cables are no
        full mesh but form one ring through every rank (each rank cabled to exactly two others,
        as five to eight Mac minis with three ports must be); [] otherwise."""
        size = len(self.cables)
        if size < 3 or not self.uncabled():
            return []
        near = {r: self.cabled_peers(r) for r in range(size)}
        if any(len(peers) != 2 for peers in near.values()):
            return []
        order, prev = [0], 0
        here = min(near[0])
        while here != 0 and here not in order:
            order.append(here)
            prev, here = here, next(p for p in near[here] if p != prev)
        return order if here == 0 and len(order) == size else []

    def why_uncabled(self, a: int, b: int) -> str:
        def where(r: int) -> str:
            seen = ", ".join(f"{c.interface} {c.ip}/{c.prefix}" for c in self.cables[r])
            return f"rank {r} looked on {seen or 'no interface with an IPv4 address'}"
        return (f"rank {a} and rank {b} share no cable ({where(a)}; {where(b)}): no address of one "
                "is on the subnet of an address of the other")


def refuse_uncabled(wiring: Wiring) -> None:
    """transport rdma with cables named: a group where two ranks share no cable stops here, on
    every rank alike, naming the two ranks and the interfaces looked on; unless the cables
    form a ring (Wiring.ring), which the collectives then go round alone."""
    missing = wiring.uncabled()
    if missing and not wiring.ring():
        a, b = missing[0]
        raise MissingCableError(
            f"--transport rdma cannot cable this group: {wiring.why_uncabled(a, b)}; over RDMA every "
            "two Macs are cabled (a full mesh) or each Mac is cabled to two others, the cables "
            "closing one ring through all of them. Cable the two Macs (one subnet per cable), name "
            "the cable's interface with --interface on both, or run with --transport auto (TCP "
            "where there is no cable)")


def check_named_devices(named: Mapping[int, str], rank: int, wiring: Wiring,
                        rdma_device: Optional[str]) -> Dict[int, str]:
    """--rdma-devices PEER=DEVICE checked against the cables found: {peer: device to open}. A
    device that is not the found cable's (a swapped cable, a wrong name) is refused by name."""
    out: Dict[int, str] = {}
    for peer, device in sorted(named.items()):
        if not 0 <= peer < len(wiring.cables) or peer == rank:
            raise RdmaUnavailableError(f"--rdma-devices {peer}={device}: rank {peer} is not a peer of "
                                       f"rank {rank} in this group of {len(wiring.cables)}")
        cable = wiring.cable(rank, peer)
        if cable is None:
            raise RdmaUnavailableError(f"--rdma-devices {peer}={device}: no cable to rank {peer} was "
                                       f"found ({wiring.why_uncabled(rank, peer)})")
        found = cable_device(cable.mine.interface, rdma_device)
        accepted = {device_label(found, cable.mine.interface), found or ""}
        if device not in accepted:
            raise RdmaUnavailableError(
                f"--rdma-devices {peer}={device}: the cable to rank {peer} is on interface "
                f"{cable.mine.interface} ({cable.mine.ip} to {cable.theirs.ip}), whose device is "
                f"{device_label(found, cable.mine.interface)}: a swapped cable or a wrong name; "
                "swap the cables back, or name that device (or leave --rdma-devices out: each link "
                "finds its cable)")
        out[peer] = opened_device(device)
    return out
