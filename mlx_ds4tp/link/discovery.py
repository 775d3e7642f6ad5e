"""Finding the other rank without addresses: each rank advertises a DNS-SD service over
multicast DNS (the `zeroconf` package, not a responder of our own) on the pair's interfaces,
and browses for the others'.

An advert's TXT record says what a rank is and where it stands: the model's fingerprint digest
and the protocol version (a rank pairs only with a peer equal in both), its RDMA device, its
figures for `--split auto` (what its hello will carry), the group's size when it is more than
two ranks (n: a rank looks only for ranks of its own size; link/findgroup.py), what it wants
(lead: `run --prompt` or --role leader; work: a worker, or a rank that already holds a worker's share; any: `serve`),
its state (seek: unpaired; lead: a leader waiting for a worker, on the port in the record;
paired), its host name and, for a serving leader, its HTTP URL. The secret is never in it: the
hello's challenge-response proves that (link/hello.py).

Who leads (elect, the stable rule): a rank that may work joins the waiting leader with the
lowest instance id; otherwise a rank that wants to lead leads; two `any` ranks that start
together settle it by instance id (random, drawn at start), once each has been on the link long
enough to hear the other (SETTLE_SEC after its own registration).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import socket
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

from ..base.log import log
from .hello import RankFigures
from .wire import PROTOCOL_VERSION

SERVICE_TYPE = "_ds4tp._tcp.local."
SEEK, LEAD, PAIRED = "seek", "lead", "paired"
WANTS = ("lead", "work", "any")
# After this rank's own registration (which already spans zeroconf's probing, ~1.5 s), how long
# an `any` rank listens before it may lead: a rank started at the same moment is heard by then.
SETTLE_SEC = 0.3
# Records of a rank that died without its goodbye go stale this soon (seconds).
TTL_SEC = 10
# How often the records heard are read again (zeroconf's cache: cheap).
RESOLVE_SEC = 0.05


@dataclasses.dataclass(frozen=True)
class Advert:
    """One rank's advert: what its TXT record says, and (for a peer) where it was found."""

    instance: str
    digest: str
    want: str
    state: str = SEEK
    port: int = 0
    version: int = PROTOCOL_VERSION
    rdma: str = ""
    figures: RankFigures = RankFigures()
    host: str = ""
    http: str = ""
    addresses: Tuple[str, ...] = ()
    size: int = 2

    def txt(self) -> Dict[str, str]:
        """The TXT record's items (each well under DNS-SD's 255 bytes). A pair's record has no
        size item (it is a pair's as it always was); a group's says its size."""
        items = {"v": str(self.version), "id": self.instance, "m": self.digest, "w": self.want,
                 "st": self.state, "p": str(self.port), "rd": self.rdma,
                 "fig": f"{self.figures.memory_bytes},{self.figures.speed}",
                 "host": self.host[:63], "http": self.http[:200]}
        if self.size != 2:
            items["n"] = str(self.size)
        return items

    @classmethod
    def from_txt(cls, items: Dict, addresses: Sequence[str] = ()) -> Optional["Advert"]:
        """The advert a TXT record (bytes or str keys and values) describes; None for one that is
        not a ds4tp rank's (a field missing or malformed): a stranger is ignored, not an error."""
        t = {_text(k): _text(v) for k, v in items.items() if k is not None}
        try:
            memory, speed = (int(x) for x in t.get("fig", "0,0").split(","))
            advert = cls(instance=t["id"], digest=t["m"], want=t["w"], state=t["st"],
                         port=int(t.get("p") or 0), version=int(t["v"]), rdma=t.get("rd", ""),
                         figures=RankFigures(memory, speed), host=t.get("host", ""),
                         http=t.get("http", ""), addresses=tuple(addresses),
                         size=int(t.get("n") or 2))
        except (KeyError, ValueError):
            return None
        if (advert.want not in WANTS or advert.state not in (SEEK, LEAD, PAIRED) or not advert.instance
                or not 2 <= advert.size <= 64):
            return None
        return advert


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


# The digest a worker started without --model advertises: it holds no model, joins a leader of
# any model and receives its part from it (split/part_delivery.py).
ANY_MODEL = "0" * 32


def same_model(a: str, b: str) -> bool:
    """Whether two adverts' digests may be one group's: equal, or one of a worker without a model."""
    return a == b or ANY_MODEL in (a, b)


def model_digest(summary: bytes) -> str:
    """The model's fingerprint as the advert carries it (hex of its hash): ranks with other
    models never try to pair."""
    return hashlib.sha256(summary).hexdigest()[:32]


def elect(me: Advert, peers: Sequence[Advert], settled: bool) -> Tuple[str, Optional[Advert]]:
    """The stable rule: ("join", leader), ("lead", None) or ("wait", None) for `me` among
    `peers` (those not refused). Only peers of the same model digest, protocol and group size
    count (a group of N ranks elects its leader by the same rule: link/findgroup.py)."""
    mates = [p for p in peers if p.instance != me.instance and same_model(p.digest, me.digest)
             and p.version == me.version and p.size == me.size and p.state != PAIRED]
    if me.want != "lead":
        leaders = sorted((p for p in mates if p.state == LEAD and p.port > 0), key=lambda p: p.instance)
        if leaders:
            return "join", leaders[0]
    if me.want == "lead":
        return "lead", None
    if me.want == "work" or not settled:
        return "wait", None
    if any(p.want == "lead" for p in mates):
        return "wait", None  # it is about to lead: join it then
    rivals = [p for p in mates if p.state == SEEK and p.want == "any"]
    if all(me.instance < p.instance for p in rivals):
        return "lead", None
    return "wait", None


# ---------------------------------------------------------------------------------------------
# Interfaces


@dataclasses.dataclass(frozen=True)
class Interface:
    """A network interface the pair is found on: its name, index, IPv4 addresses (with their
    prefix) and IPv6 link-local addresses."""

    name: str
    index: int
    ipv4: Tuple[Tuple[str, int], ...]
    ipv6: Tuple[str, ...]

    @property
    def loopback(self) -> bool:
        return bool(self.ipv4) and all(ipaddress.ip_address(a).is_loopback for a, _ in self.ipv4)

    def listen_host(self) -> str:
        """Where a leader listens on this interface: its IPv4 address, else its IPv6 link-local
        address with the scope."""
        if self.ipv4:
            return self.ipv4[0][0]
        if self.ipv6:
            return f"{self.ipv6[0]}%{self.name}"
        raise ValueError(f"interface {self.name} has no address: give it one (or an IPv6 link-local "
                         "address: bring it up)")


def interface(name: str) -> Interface:
    """The interface called `name`, its addresses read now; a ValueError naming the ones there
    are when there is none of that name."""
    import ifaddr

    adapters = list(ifaddr.get_adapters())
    for a in adapters:
        if a.nice_name == name or a.name == name:
            v4 = tuple((ip.ip, ip.network_prefix) for ip in a.ips if isinstance(ip.ip, str))
            v6 = tuple(ip.ip[0] for ip in a.ips if isinstance(ip.ip, tuple)
                       and ipaddress.ip_address(ip.ip[0]).is_link_local)
            _check_multicast(a.nice_name)
            return Interface(a.nice_name, a.index or socket.if_nametoindex(a.nice_name), v4, v6)
    names = ", ".join(sorted(a.nice_name for a in adapters))
    raise ValueError(f"--interface {name}: no such interface here (there are: {names})")


IFF_MULTICAST = 0x1000


def _check_multicast(name: str, sys_net: str = "/sys/class/net") -> None:
    """On Linux, an interface without the MULTICAST flag (loopback's default) never carries the
    adverts: say so, with the command that turns it on, rather than find nobody."""
    try:
        flags = int(Path(sys_net, name, "flags").read_text().strip(), 16)
    except (OSError, ValueError):
        return  # not Linux, or no such file: nothing to check
    if not flags & IFF_MULTICAST:
        raise ValueError(f"--interface {name} does not carry multicast, which finding the peer "
                         f"needs: run `sudo ip link set {name} multicast on` (or run both ranks in "
                         "a network namespace of their own, where you may)")


def ipv4_advice(name: str, leads: bool) -> str:
    """The one command that gives a Thunderbolt member interface the IPv4 address RDMA needs."""
    return f"sudo ifconfig {name} inet 10.99.0.{1 if leads else 2}/30 alias"


# ---------------------------------------------------------------------------------------------
# The advert on the link


class Finder:
    """This process's advert and its browse on `interfaces`: publish() changes what the advert
    says (sent in the background: an update is a few multicast packets, the latest wins),
    peers() is what was heard. close() sends the goodbye.

    The browser only names the services it hears; a resolver thread reads each one's records
    from zeroconf's cache every RESOLVE_SEC (asking the link for the ones not complete yet), so
    a record missed once or an update (a leader's new state) is picked up on the next round."""

    def __init__(self, interfaces: Sequence[Interface], me: Advert) -> None:
        from zeroconf import IPVersion, ServiceBrowser, Zeroconf

        self.interfaces = tuple(interfaces)
        self.me = me
        self.refused: Set[str] = set()  # instances that refused us, or could not be reached
        self._lock = threading.Lock()
        self._names: Set[str] = set()
        self._peers: Dict[str, Advert] = {}
        self._registered = threading.Event()
        self._dirty = threading.Event()
        self._closed = threading.Event()
        binds: list = [a for i in self.interfaces for a, _ in i.ipv4]
        binds += [(a, 0, i.index) for i in self.interfaces for a in i.ipv6]
        v4, v6 = any(i.ipv4 for i in self.interfaces), any(i.ipv6 for i in self.interfaces)
        version = IPVersion.All if v4 and v6 else IPVersion.V4Only if v4 else IPVersion.V6Only
        try:
            self.zc = Zeroconf(interfaces=binds, ip_version=version)
        except OSError as exc:
            names = ", ".join(i.name for i in self.interfaces)
            raise ValueError(f"cannot use multicast DNS on {names}: {exc}; on Linux's loopback "
                             "run `sudo ip link set lo multicast on`") from None
        self._info = self._service_info(me)
        self.browser = ServiceBrowser(self.zc, SERVICE_TYPE, handlers=[self._changed])
        threading.Thread(target=self._advertise, name="ds4tp-advert", daemon=True).start()
        threading.Thread(target=self._resolve, name="ds4tp-resolve", daemon=True).start()

    def _service_info(self, advert: Advert):
        from zeroconf import ServiceInfo

        addresses = [a for i in self.interfaces for a, _ in i.ipv4] + \
            [a for i in self.interfaces for a in i.ipv6]
        name = f"ds4tp-{advert.instance}"
        return ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=advert.port or 9,
                           properties=advert.txt(), server=f"{name}.local.",
                           parsed_addresses=addresses, host_ttl=TTL_SEC, other_ttl=TTL_SEC)

    def _advertise(self) -> None:
        """Register, then send each change publish() makes, the latest one when several wait."""
        try:
            self.zc.register_service(self._info, allow_name_change=True)
        except Exception as exc:  # noqa: BLE001 - the closed Zeroconf of an exit, or the link down
            log(f"discovery: could not advertise: {exc}")
            return
        finally:
            self._registered.set()
        while not self._closed.is_set():
            if not self._dirty.wait(0.5):
                continue
            with self._lock:
                self._dirty.clear()
                info = self._info
            try:
                self.zc.update_service(info)
            except Exception as exc:  # noqa: BLE001 - as above
                if not self._closed.is_set():
                    log(f"discovery: could not update the advert: {exc}")

    def registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def publish(self, **changes) -> None:
        """Advertise `changes` to this rank's advert (state, port, want, http, figures)."""
        with self._lock:
            self.me = dataclasses.replace(self.me, **changes)
            self._info = self._service_info(self.me)
            self._dirty.set()

    def peers(self) -> List[Advert]:
        with self._lock:
            return list(self._peers.values())

    def _changed(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        with self._lock:
            if state_change is ServiceStateChange.Removed:
                self._names.discard(name)
                self._peers.pop(name, None)
            else:
                self._names.add(name)

    def _resolve(self) -> None:
        from zeroconf import ServiceInfo

        while not self._closed.wait(RESOLVE_SEC):
            with self._lock:
                names = list(self._names)
            for name in names:
                info = ServiceInfo(SERVICE_TYPE, name)
                try:
                    # Asking the link, briefly, on this thread: never the gates' (they do not
                    # exist yet) nor the browser's.
                    if not info.load_from_cache(self.zc) and not info.request(self.zc, 500):
                        continue
                except Exception:  # noqa: BLE001 - closing under our feet; the loop ends
                    continue
                advert = Advert.from_txt(info.properties, info.parsed_scoped_addresses())
                if advert is None or advert.instance == self.me.instance:
                    continue
                with self._lock:
                    if name in self._names:
                        self._peers[name] = dataclasses.replace(
                            advert, port=info.port if advert.state == LEAD else 0)

    def close(self) -> None:
        self._closed.set()
        try:
            self.browser.cancel()
            self.zc.close()  # unregisters: the peers hear the goodbye
        except Exception:  # noqa: BLE001 - closing what is already half gone
            pass


def dial_address(peer: Advert, interfaces: Sequence[Interface]) -> Tuple[str, Interface]:
    """The leader's address to dial and our interface it is on: an IPv4 address on one of our
    interfaces' subnets, else its IPv6 link-local address with our interface's scope; a
    ValueError naming the addresses when none of them is on our link."""
    for addr in peer.addresses:
        ip = ipaddress.ip_address(addr.split("%")[0])
        for iface in interfaces:
            for mine, prefix in iface.ipv4:
                if ip.version == 4 and ip in ipaddress.ip_network(f"{mine}/{prefix}", strict=False):
                    return str(ip), iface
    for addr in peer.addresses:
        ip = ipaddress.ip_address(addr.split("%")[0])
        if ip.version == 6 and ip.is_link_local and len(interfaces) == 1:
            return f"{ip}%{interfaces[0].name}", interfaces[0]
        if ip.version == 6 and ip.is_link_local and "%" in addr:
            scope = addr.split("%")[1]
            return addr, next((i for i in interfaces if i.name == scope), interfaces[0])
    raise ValueError(f"the leader {peer.host or peer.instance} advertises {list(peer.addresses)}, none "
                     f"on {', '.join(i.name for i in interfaces)}'s subnet: give both ends of the "
                     "link addresses on one subnet")
