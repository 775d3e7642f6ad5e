"""Pairing without addresses: advertise, hear the peers, elect who leads (discovery.elect), then
form the group of two as the explicit flags would (form_mesh: the leader's door on the
interface where it was found, on a port it picked; the worker JOINs at the address it found
the leader at), with the same JOIN, hello, secret and model checks. A peer that refuses us
(another secret) is left out of the next elections; a leader that cannot be reached (a stale
record, or a door closed a moment while its group forms again) is not joined for TTL_SEC (a
stale record is gone by then), but is still one that may lead; the search goes on until the
link's timeout. Discovery runs before the group exists: the
gates never see it.

Once met, the leader keeps its door: it forms the pair again there (a restarted worker, a
serving pair that shrank to its leader and grows back), advertising that door as a leader that
must lead (link/findgroup.py:Reopened), which a worker's election joins at once. The worker
keeps its discovering settings: whichever leader leads next, it finds by the election."""

from __future__ import annotations

import atexit
import dataclasses
import secrets
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from ..base.log import log
from ..errors import AuthenticationError, HelloMismatchError, TransportError, TransportTimeoutError
from . import discovery as dsc, exposure
from .config import DiscoverySettings, LinkSettings, PairAddress, default_timeout, secret_bytes
from .connection import Pair
from .control import dial as control_dial
from .hello import PART_RECEIVER, ModelIdentity
from .mesh import Mesh, form_mesh, make_link
from .rdma import rdma_probe

# How long a worker keeps dialing a leader it heard of: a leader listens a moment after its
# advert says so; one that never answers is a stale record (a leader killed without goodbye).
JOIN_DIAL_SEC = 3.0
POLL_SEC = 0.05

Connect = Callable[..., Pair]
_WANTS = {"lead": "this rank leads", "work": "this rank works for a leader",
          "any": "the first to wait for a worker leads"}

_lock = threading.Lock()
_finders: Dict[Tuple, dsc.Finder] = {}


def meet(link: LinkSettings, identity: ModelIdentity, connect: Connect = make_link) -> Tuple[Mesh, LinkSettings]:
    """The group of two `link.discovery` finds (form_mesh(resolved settings, connect) forms it
    once the roles and the address are known), and the settings it forms again with: the
    leader's door (its address, found here), a worker's `link` (it looks again). A ValueError
    before anything is advertised when the link needs a secret and there is none."""
    disc = link.discovery
    interfaces = [dsc.interface(name) for name in disc.interfaces]
    check_secret(link, interfaces)
    finder = finder_for(disc, interfaces, identity, link)
    finder.publish(state=dsc.SEEK, port=0, want=disc.want, http=disc.http_url, figures=link.figures)
    log(f"discovery: looking on {', '.join(disc.interfaces)} for a rank with this model "
        f"({_WANTS[disc.want]})")
    started = time.monotonic()
    deadline = started + (link.timeout or default_timeout())
    refused = finder.refused  # kept for the rejoins: a peer that refused us once is not asked again
    unreached: Dict[str, float] = {}  # a leader's instance -> when it may be tried again
    settle_at: Optional[float] = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise TransportError(_nobody(finder, refused | set(unreached), disc))
        if settle_at is None and finder.registered(0):
            settle_at = now + dsc.SETTLE_SEC
        # A leader not reached lately is heard without its port: not joined, yet still a rank
        # that leads (an `any` rank waits for one that wants to lead rather than lead itself).
        peers = [dataclasses.replace(p, port=0) if unreached.get(p.instance, 0.0) > now else p
                 for p in finder.peers() if p.instance not in refused]
        what, peer = dsc.elect(finder.me, peers, settled=settle_at is not None and now >= settle_at)
        if what == "lead":
            return _paired(*_lead(link, identity, connect, finder, interfaces), started)
        if what == "join":
            try:
                return _paired(_join(link, identity, connect, finder, interfaces, peer), link, started)
            except (AuthenticationError, HelloMismatchError) as exc:
                log(f"discovery: refused by / refusing {_who(peer)}: {exc}")
                refused.add(peer.instance)
            except TransportError as exc:
                log(f"discovery: could not pair with {_who(peer)} ({exc}); looking on")
                unreached[peer.instance] = time.monotonic() + dsc.TTL_SEC
            finder.publish(state=dsc.SEEK, port=0)
            continue
        time.sleep(POLL_SEC)


def _paired(pair: Mesh, again: LinkSettings, started: float) -> Tuple[Mesh, LinkSettings]:
    log(f"discovery: paired {time.monotonic() - started:.2f} s after this rank began looking")
    return pair, again


def check_secret(link: LinkSettings, interfaces: List[dsc.Interface]) -> None:
    """A ValueError, before anything is advertised, when `link` has no secret and one of
    `interfaces` is open to others (not loopback, not a Thunderbolt cable)."""
    if secret_bytes(link.secret) is not None:
        return
    # Only this machine, or the Mac at the other end of a Thunderbolt cable, can be on loopback
    # or a Thunderbolt interface: there discovery may pair without a secret. (--interface here
    # names where to look, so on Linux it makes no interface a cable: cable_interfaces() alone.)
    cable = exposure.cable_interfaces()
    open_links = [i.name for i in interfaces if not exposure.private_interface(i.name, i.loopback, cable)]
    if open_links:
        raise ValueError(
            f"discovery on {', '.join(open_links)} needs a pair secret (that link is not loopback "
            "or a Thunderbolt cable, so others may be on it): run `ds4tp pair` on one machine and "
            "`ds4tp pair CODE` with the code it prints on the other (or give both --secret / "
            "DS4_TP_SECRET)")


def finder_for(disc: DiscoverySettings, interfaces: List[dsc.Interface], identity: ModelIdentity,
               link: LinkSettings) -> dsc.Finder:
    """This process's advert on these interfaces, for this model and group size (kept for its
    rejoins; a group of N ranks finds its members with it too, link/findgroup.py)."""
    if identity == PART_RECEIVER:
        digest = dsc.ANY_MODEL  # no model here: any leader's, which sends this rank its part
    else:
        digest = dsc.model_digest(identity.fingerprint.summary() if identity.fingerprint is not None
                                  else repr(identity).encode())
    key = (disc.interfaces, digest, link.size)
    with _lock:
        finder = _finders.get(key)
        if finder is None:
            # A random instance id: what breaks the tie between two `any` ranks.
            me = dsc.Advert(instance=secrets.token_hex(8), digest=digest, want=disc.want,
                            rdma=_device_of(link, interfaces[0], quiet=True) or "",
                            figures=link.figures, host=socket.gethostname(), http=disc.http_url,
                            size=link.size)
            finder = _finders[key] = dsc.Finder(interfaces, me)
            if len(_finders) == 1:
                atexit.register(close_all)
    return finder


def close_all() -> None:
    """Every advert of this process withdrawn (the peers hear the goodbye)."""
    with _lock:
        finders = list(_finders.values())
        _finders.clear()
    for f in finders:
        f.close()


def _lead(link: LinkSettings, identity: ModelIdentity, connect: Connect, finder: dsc.Finder,
          interfaces: List[dsc.Interface]) -> Tuple[Mesh, LinkSettings]:
    """The pair this rank leads, and the settings of its door (the address it keeps)."""
    iface = interfaces[0]
    host = iface.listen_host()
    port = free_port(host)
    device = _device_of(link, iface)
    finder.publish(state=dsc.LEAD, port=port)
    log(f"discovery: this machine ({socket.gethostname()}) leads; waiting for its worker on "
        f"{iface.name} ({host} port {port})")
    settings = dataclasses.replace(link, address=PairAddress("leader", (host, port), None),
                                   rdma_device=device, discovery=None)
    try:
        pair = form_mesh(settings.resolved(identity), connect)
    except TransportTimeoutError as exc:
        # The handshake's advice names --coordinator; a discovering worker needs none.
        cause = str(exc).split("; start the worker with --coordinator")[0]
        raise TransportTimeoutError(
            f"discovery: this leader on {iface.name}: {cause}; start the other rank with the same "
            "--model (and secret) on the other end of the link (DS4_TP_TIMEOUT_SEC sets how long "
            "to wait)") from None
    finder.publish(state=dsc.PAIRED, port=0)
    return pair, settings


def _join(link: LinkSettings, identity: ModelIdentity, connect: Connect, finder: dsc.Finder,
          interfaces: List[dsc.Interface], leader: dsc.Advert) -> Mesh:
    host, iface = dsc.dial_address(leader, interfaces)
    http = f"; it serves {leader.http}" if leader.http else ""
    log(f"discovery: {_who(leader)} leads (found on {iface.name} at {host} port {leader.port}); "
        f"this machine ({socket.gethostname()}) works for it{http}")
    settings = dataclasses.replace(link, address=PairAddress("worker", None, (host, leader.port)),
                                   rdma_device=_device_of(link, iface), discovery=None)

    def dial(h: str, p: int, deadline: float, what: str) -> socket.socket:
        return control_dial(h, p, min(deadline, time.monotonic() + JOIN_DIAL_SEC), what)

    pair = form_mesh(settings.resolved(identity), connect, dial=dial)
    finder.publish(state=dsc.PAIRED, port=0, want="work")
    return pair


def _device_of(link: LinkSettings, iface: dsc.Interface, quiet: bool = False) -> Optional[str]:
    """The RDMA device of the interface the peer is on: as given, else on macOS the interface's
    own (rdma_enN for enN), else None (the provider's first active device). Says why when auto
    falls back to TCP on this interface, and what to do when RDMA lacks the IPv4 it needs."""
    if link.rdma_device is not None or link.transport == "tcp" or sys.platform != "darwin":
        return link.rdma_device
    device = f"rdma_{iface.name}"
    ok, reason = rdma_probe(device, link.verbs_library or "")
    if quiet:
        return device if ok else None
    if not ok:
        log(f"discovery: transport {link.transport}: no RDMA device {device} for {iface.name} "
            f"({reason}); the gates use TCP on {iface.name}")
        return None
    if not iface.ipv4:
        log(f"discovery: RDMA over {device} needs an IPv4 address on {iface.name}, which has none; "
            f"add one with: {dsc.ipv4_advice(iface.name, True)} (10.99.0.2 on the other Mac)")
    log(f"discovery: RDMA device {device}, the one of {iface.name} where the peer is")
    return device


def free_port(host: str) -> int:
    """A port free now on `host` (the leader listens there a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0) if family == socket.AF_INET else socket.getaddrinfo(host, 0, family)[0][4])
        return s.getsockname()[1]


def _who(peer: dsc.Advert) -> str:
    return f"{peer.host or 'a peer'} (instance {peer.instance})"


def _nobody(finder: dsc.Finder, refused: Set[str], disc: DiscoverySettings) -> str:
    heard = finder.peers()
    other = [p for p in heard if p.digest != finder.me.digest or p.version != finder.me.version]
    why = []
    if not heard:
        why.append("no other ds4tp rank was heard")
    if other:
        why.append(f"{len(other)} rank(s) heard serve another model or protocol")
    if refused:
        why.append(f"{len(refused)} refused (another secret) or not reached")
    return (f"discovery on {', '.join(disc.interfaces)} found no peer to pair with before the "
            f"timeout ({'; '.join(why) or 'none was free'}); start the other rank with the same "
            "--model on the other end of the link (DS4_TP_TIMEOUT_SEC sets how long to look)")


# The names tests/test_discovery.py has always called.
_check_secret = check_secret
