"""Whether a group's address is open to others: the one classification of addresses and
interfaces that decides where a group may form without the pair secret, for explicit addresses
(--listen/--coordinator: check_join, called where cli/ resolves the settings) and for discovery
(link/meet.py: private_interface).

Only this machine is on loopback, and only the Mac at the other end of the cable is on a
Thunderbolt interface (the Thunderbolt Bridge, one of its members, a Thunderbolt port with an
address of its own): there a group may form without a secret. Anywhere else (Ethernet, Wi-Fi, a
switch) anyone on the network can dial the leader or a worker's mesh port, join the group, read
every gate's activations (they carry what the prompts said) and corrupt every answer, so a rank
stops before it listens or dials unless it holds a secret (`ds4tp pair`, --secret,
DS4_TP_SECRET), or the user says --insecure (then one warning line).

Linux has no Thunderbolt Bridge to ask: there the interfaces named with --interface are taken
as the cable (the tests' network namespaces stand in for Macs that way). On a Mac a name given
there counts only if it is a Thunderbolt interface: naming Wi-Fi does not make it private.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
import subprocess
import sys
from typing import Dict, FrozenSet, List, Optional, Sequence

from .config import PairAddress

# A Mac's Thunderbolt Bridge: the interface itself (it carries the address when the bridge is on).
BRIDGE = "bridge0"


def thunderbolt_members(platform: str = sys.platform) -> List[str]:
    """The members of macOS's Thunderbolt Bridge (bridge0), the interfaces the Macs' cables are
    on; [] elsewhere or when there is no bridge."""
    if platform != "darwin":
        return []
    return re.findall(r"member:\s+(\S+)", _output(["ifconfig", BRIDGE]))


def thunderbolt_ports(listing: str) -> List[str]:
    """The devices `networksetup -listallhardwareports` (its text: `listing`) names as
    Thunderbolt ports ("Hardware Port: Thunderbolt 1" / "Device: en1"), the bridge's too."""
    return [device for port, device in re.findall(r"Hardware Port:\s*(.+?)\s*\n\s*Device:\s*(\S+)", listing)
            if port.startswith("Thunderbolt")]


def thunderbolt_interfaces(platform: str = sys.platform) -> FrozenSet[str]:
    """Every Thunderbolt interface of this Mac: the bridge, its members and the Thunderbolt
    ports; empty elsewhere."""
    if platform != "darwin":
        return frozenset()
    ports = thunderbolt_ports(_output(["networksetup", "-listallhardwareports"]))
    return frozenset([*thunderbolt_members(platform), *ports])


def _output(command: List[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cable_interfaces(named: Sequence[str] = (), platform: str = sys.platform) -> FrozenSet[str]:
    """The interfaces only the other end of a cable is on: the Thunderbolt ones on a Mac; on
    Linux the interfaces `named` with --interface (there is no Thunderbolt Bridge to ask)."""
    if platform == "darwin":
        return thunderbolt_interfaces(platform)
    return frozenset(named)


def private_interface(name: str, loopback: bool, cable: FrozenSet[str]) -> bool:
    """Whether a group may form on interface `name` without a secret: loopback (only this
    machine) or one of the `cable` interfaces (cable_interfaces)."""
    return loopback or name in cable


# ---------------------------------------------------------------------------------------------
# An address: which interface it is on


@dataclasses.dataclass(frozen=True)
class Exposure:
    """Where a rank listens or dials: the address as given ("10.88.0.1:9911"), where it is in
    words ("loopback", "interface en0", "every interface of this machine"), and whether only
    this machine or the other end of a cable can reach it there."""

    address: str
    where: str
    private: bool


def local_addresses() -> Dict[str, str]:
    """Every address of this machine's interfaces (without an IPv6 scope) -> its interface."""
    import ifaddr

    out: Dict[str, str] = {}
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            out.setdefault(ip.ip if isinstance(ip.ip, str) else ip.ip[0], adapter.nice_name)
    return out


def _resolve(host: str) -> List[str]:
    """The addresses `host` names (a name resolved, an IPv6 scope cut off); [] when it names none."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))


def _source_address(ip: str, port: int) -> Optional[str]:
    """The address of this machine a connection to ip:port leaves from (the routing table's
    answer: a UDP socket's connect sends nothing); None when there is no route."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, port or 9))
            return s.getsockname()[0].split("%")[0]
    except OSError:
        return None


def address_exposure(role: str, host: str, port: int, cable: FrozenSet[str],
                     addresses: Optional[Dict[str, str]] = None) -> Exposure:
    """Where the leader listening on host:port (role "leader") or a worker dialing it (role
    "worker") is reachable from: private on loopback and on a `cable` interface
    (cable_interfaces), open anywhere else, on every interface (0.0.0.0, ::) and where the
    address is not found. `addresses`: local_addresses() (read now when None)."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if "%" in host:  # an IPv6 link-local address names its interface
        name = host.rsplit("%", 1)[1]
        return Exposure(shown, f"interface {name}", name in cable)
    ips = _resolve(host)
    if not ips:
        return Exposure(shown, f"{host} names no address here", False)
    if all(ipaddress.ip_address(ip).is_loopback for ip in ips):
        return Exposure(shown, "loopback", True)
    if any(ipaddress.ip_address(ip).is_unspecified for ip in ips):
        return Exposure(shown, "every interface of this machine", False)
    addresses = local_addresses() if addresses is None else addresses
    names = []
    for ip in ips:
        # The leader's interface holds its address; a worker's is the one its dial leaves from
        # (its own address's, when it dials this machine).
        source = ip if role == "leader" else _source_address(ip, port)
        name = addresses.get(source or "")
        if name is not None and source is not None and ipaddress.ip_address(source).is_loopback:
            name = addresses.get(ip, name)
        if name is None:
            return Exposure(shown, "no interface of this machine" + (" holds it" if role == "leader"
                                                                     else " routes to it"), False)
        names.append(name)
    open_names = [n for n in dict.fromkeys(names) if n not in cable]
    where = f"interface {', '.join(open_names or list(dict.fromkeys(names)))}"
    return Exposure(shown, where, not open_names)


def check_join(address: PairAddress, has_secret: bool, insecure: bool, cable: FrozenSet[str],
               addresses: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Before a rank listens (the leader) or dials (a worker) at `address`: None when the group
    may form as asked (a secret, or an address only this machine or a cable reaches); the one
    warning line to log when `insecure` lets an open group form; else a ValueError naming the
    address and the two fixes."""
    if has_secret or address.role not in ("leader", "worker") or address.address is None:
        return None
    host, port = address.address
    exposure = address_exposure(address.role, host, port, cable, addresses)
    if exposure.private:
        return None
    does = "listens on" if address.role == "leader" else "dials"
    if insecure:
        return (f"WARNING: --insecure: this rank {does} {exposure.address} ({exposure.where}) with no "
                "pair secret: anyone on that network can join the group, read what the prompts say "
                "and change every answer")
    raise ValueError(
        f"this rank {does} {exposure.address} ({exposure.where}: not loopback or a Thunderbolt "
        "link) with no pair secret, so anyone on that network could join the group, read what the "
        "prompts say and change every answer. Run `ds4tp pair` on one Mac and `ds4tp pair CODE` "
        "with the code it prints on each other Mac, or give every rank the same --secret (or "
        "DS4_TP_SECRET); --insecure forms the group open anyway")
