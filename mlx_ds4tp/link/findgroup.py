"""Finding a group of N ranks (3 to 8) without addresses: every rank advertises (its record says
the group's size, link/discovery.py), the leader is elected by the pair's own rule
(discovery.elect, among ranks of the same model digest, protocol and size), it opens its lobby
(link/lobby.py) and the others enter it, each proving the pair secret by a challenge-response;
once N-1 are in, the leader gives out the ranks (lobby.assign: the leader 0, asked ranks, then
by host name and instance id) and the port its mesh listens on. find_group() returns what the
mesh's bring-up takes (Found.settings(link) for gate_ops.init_pair, or Found.init_kwargs() for
mlx_ds4tp.init).

A rank that refuses us, or that we refuse (another secret), is left out of the next elections
and the others carry on; a leader that hears a lower-id leader of the same group steps down and
joins it (two that began leading at once settle on one); a member or leader that left (its
connection closed, its advert removed or its TTL gone) is never waited for. A search that
cannot gather all N by the timeout raises GroupNotFoundError naming what it saw and how many
were missing. Two ranks need no lobby: link/meet.py's election is all they need; both kinds of
search end at the leader's door (link/mesh.py's form_mesh), where any group forms.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

from ..base.log import log
from ..errors import AuthenticationError, GroupNotFoundError, HelloMismatchError, TransportError
from . import discovery as dsc, lobby as lb, meet
from .config import LinkSettings, PairAddress, default_timeout, secret_bytes
from .control import dial as control_dial
from .hello import ModelIdentity

POLL_SEC = 0.05


@dataclasses.dataclass(frozen=True)
class Found:
    """What discovery found: this rank's role and rank in a group of `size`, and `address`:
    where the leader's mesh listens (the leader's own listen address; a worker's coordinator).
    roster: every rank as (rank, host name, instance id); elapsed: seconds the search took."""

    role: str
    rank: int
    size: int
    address: Tuple[str, int]
    interface: str
    roster: Tuple[Tuple[int, str, str], ...]
    elapsed: float

    def settings(self, link: LinkSettings) -> LinkSettings:
        """`link` (the discovering settings) made into the mesh's: its address, its size and,
        for a worker, the rank it asks for (the one the leader gave it)."""
        size = self.size
        if self.role == "leader":
            address, ask = PairAddress("leader", self.address, None), None
        else:
            # A rank re-joining a group that lost one is given none: the mesh gives it the free
            # one; and no size, it takes the leader's (a serving group short of ranks may grow
            # back by one at a time, serve/resize.py).
            address, ask = PairAddress("worker", None, self.address), (self.rank if self.rank > 0 else None)
            size = size if self.rank >= 0 else None
        return dataclasses.replace(link, address=address, discovery=None, size=size, ask_rank=ask)

    def init_kwargs(self) -> Dict:
        """mlx_ds4tp.init's keywords for this rank: role, listen or coordinator, size, rank."""
        if self.role == "leader":
            return {"role": "leader", "listen": self.address, "size": self.size}
        return {"role": "worker", "coordinator": self.address, "size": self.size,
                "rank": self.rank if self.rank > 0 else None}


def find_group(link: LinkSettings, identity: ModelIdentity) -> Found:
    """The group of link.size ranks (3 to 8) that link.discovery finds for this model and this
    pair secret. ValueError before anything is advertised for settings that cannot (a pair's
    size, no discovery, an open link without a secret); GroupNotFoundError at link.timeout
    (DS4_TP_TIMEOUT_SEC) naming who was seen and how many were missing."""
    disc = link.check().discovery
    if disc is None:
        raise ValueError("find_group needs discovery settings (DiscoverySettings: the interfaces to "
                         "look on); with an address, mlx_ds4tp.init(size=N) makes the mesh")
    if link.size < 3:
        raise ValueError(f"size={link.size}: two ranks find each other by link.meet.meet (its "
                         "election, no lobby); find_group gathers 3 to 8 (--ranks N)")
    interfaces = [dsc.interface(name) for name in disc.interfaces]
    meet.check_secret(link, interfaces)
    return _Search(link, identity, interfaces).run()


class _Search:
    """One rank's search: its advert, the ranks it refused (and why), its lobby while it
    leads, the lobby it is in while it waits."""

    def __init__(self, link: LinkSettings, identity: ModelIdentity, interfaces: List[dsc.Interface]) -> None:
        disc = link.discovery
        self.link, self.interfaces, self.size = link, interfaces, link.size
        self.secret = secret_bytes(link.secret)
        self.timeout = float(link.timeout or default_timeout())
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        want = disc.want if link.ask_rank is None else ("lead" if link.ask_rank == 0 else "work")
        self.finder = meet.finder_for(disc, interfaces, identity, link)
        self.finder.publish(state=dsc.SEEK, port=0, want=want, http=disc.http_url, figures=link.figures)
        me = self.finder.me
        self.knock = lb.Knock(me.instance, me.host, me.digest, self.size, me.version,
                              lb.NO_RANK if not link.ask_rank else link.ask_rank, self.secret is not None)
        self.refused: Set[str] = self.finder.refused  # another secret, model or size: for good
        self.unreachable: Set[Tuple[str, int]] = set()  # (instance, lobby port): a closed lobby
        self.why: Dict[str, str] = {}
        self.seen: Dict[str, dsc.Advert] = {}  # every rank of this group heard, its latest advert
        self.lobby: Optional[lb.Lobby] = None
        self.entered: Optional[lb.Entered] = None
        log(f"discovery: looking on {', '.join(disc.interfaces)} for the {self.size - 1} other ranks of "
            f"a group of {self.size} with this model")

    def run(self) -> Found:
        settle_at: Optional[float] = None
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                raise GroupNotFoundError(self.missing())
            if settle_at is None and self.finder.registered(0):
                settle_at = now + dsc.SETTLE_SEC
            peers = self.peers()
            what, peer = dsc.elect(self.finder.me, peers, settled=settle_at is not None and now >= settle_at)
            found = self.lead() if what == "lead" else self.join(peer) if what == "join" else None
            if found is not None:
                if found.rank < 0:
                    log(f"discovery: a group of {self.size} that lost a rank, found in {found.elapsed:.2f} s: "
                        f"this machine re-joins it with the rank left free (leader {found.roster[0][1]})")
                else:
                    log(f"discovery: a group of {self.size} in {found.elapsed:.2f} s: this machine is rank "
                        f"{found.rank} ({', '.join(f'{r}: {h}' for r, h, _ in found.roster)})")
                return found
            if what == "wait":
                time.sleep(POLL_SEC)

    def peers(self) -> List[dsc.Advert]:
        """The adverts heard now, less the refused ones (every one heard is remembered)."""
        heard = self.finder.peers()
        self.seen.update((p.instance, p) for p in heard if self.mate(p))
        return [p for p in heard if p.instance not in self.refused
                and (p.instance, p.port) not in self.unreachable]

    def heard(self, instance: str) -> bool:
        """Whether `instance` is still advertised (one never heard yet counts as there)."""
        return instance not in self.seen or any(p.instance == instance for p in self.finder.peers())

    def mate(self, p: dsc.Advert) -> bool:
        me = self.finder.me
        return dsc.same_model(p.digest, me.digest) and p.version == me.version and p.size == me.size

    def refuse(self, peer: dsc.Advert, why: str) -> None:
        self.refused.add(peer.instance)
        self.why[peer.instance] = why

    def pass_over(self, peer: dsc.Advert, why: str) -> None:
        """Leave out this lobby of `peer` (it closed, or its leader went): not the rank itself,
        which may lead again, on another port, once it stepped down or its advert is fresh."""
        self.unreachable.add((peer.instance, peer.port))
        self.why[peer.instance] = why

    # -- leading -------------------------------------------------------------------------------
    def lead(self) -> Optional[Found]:
        iface = self.interfaces[0]
        host = listen_host(self.interfaces)
        lobby = self.lobby = lb.Lobby(host, self.knock, self.secret)
        self.finder.publish(state=dsc.LEAD, port=lobby.port)
        log(f"discovery: this machine ({socket.gethostname()}) leads a group of {self.size}; waiting for "
            f"{self.size - 1} ranks on {iface.name} ({host} port {lobby.port})")
        try:
            while not lobby.full():
                if time.monotonic() >= self.deadline:
                    message = self.missing()
                    lobby.close(why=f"the leader gave up: {message}")
                    raise GroupNotFoundError(message)
                lower = self.lower_leader()
                entered = self.enter(lower) if lower is not None else None
                if entered is not None:
                    # It took this rank in: only now does this lobby close (a stranger that
                    # leads is refused by its proof and this rank's members stay).
                    log(f"discovery: this machine steps down for {_who(lower)}, a leader of this group "
                        "with a lower id")
                    lobby.close(why=f"{_who(lower)} leads this group instead")
                    self.lobby = None
                    return self.wait_in(lower, *entered)
                lobby.wait(POLL_SEC)
                lobby.admit()
                self.peers()
                lobby.check_members(self.heard)
            mesh_port = meet.free_port(host)
            ranks = lobby.release(mesh_port)
        except BaseException:
            lobby.close()
            raise
        self.finder.publish(state=dsc.PAIRED, port=0)
        roster = ((0, self.knock.host, self.knock.instance),) + tuple(
            (r, m.knock.host, m.knock.instance) for r, m in ranks)
        return Found("leader", 0, self.size, (host, mesh_port), iface.name, roster,
                     time.monotonic() - self.started)

    def lower_leader(self) -> Optional[dsc.Advert]:
        """A leader of this group with a lower instance id (or one that must lead), not refused:
        two ranks that began leading at once settle on that one (a rank that must lead, `want`
        lead, never yields)."""
        me = self.finder.me
        if me.want == "lead":
            return None
        # A leader that must lead (want "lead": also a formed group's leader taking a rank
        # back, Reopened) is yielded to whatever its id.
        lower = [p for p in self.peers() if self.mate(p) and p.state == dsc.LEAD and p.port > 0
                 and (p.instance < me.instance or p.want == "lead")]
        return min(lower, key=lambda p: p.instance, default=None)

    # -- joining -------------------------------------------------------------------------------
    def join(self, leader: dsc.Advert) -> Optional[Found]:
        entered = self.enter(leader)
        return None if entered is None else self.wait_in(leader, *entered)

    def enter(self, leader: dsc.Advert) -> Optional[Tuple[lb.Entered, str, dsc.Interface]]:
        """This rank in `leader`'s lobby, the secret proven both ways: (the lobby, the address it
        was reached at, our interface); None when it refused us or we it (left out for good),
        or it could not be reached (that lobby passed over)."""
        host, iface = dsc.dial_address(leader, self.interfaces)
        log(f"discovery: {_who(leader)} leads a group of {self.size} (found on {iface.name} at {host} "
            f"port {leader.port}); this machine ({socket.gethostname()}) joins it")
        try:
            sock = control_dial(host, leader.port, min(self.deadline, time.monotonic() + meet.JOIN_DIAL_SEC),
                                "the group's lobby")
            entered = lb.enter(sock, self.knock, self.secret)
        except (AuthenticationError, HelloMismatchError) as exc:
            log(f"discovery: refused by / refusing {_who(leader)}: {exc}")
            self.refuse(leader, str(exc))
            return None
        except TransportError as exc:
            log(f"discovery: could not join {_who(leader)} ({exc}); looking on")
            self.pass_over(leader, f"could not be reached ({exc})")
            return None
        return entered, host, iface

    def wait_in(self, leader: dsc.Advert, entered: lb.Entered, host: str, iface: dsc.Interface) -> Optional[Found]:
        """Wait in `leader`'s lobby for this rank's rank; None when the leader closed it or left
        (this rank looks again), GroupNotFoundError at the deadline."""
        self.entered = entered
        self.finder.publish(state=dsc.PAIRED, port=0)
        try:
            message = lb.wait_for_rank(entered, self.deadline, lambda: self.heard(leader.instance))
        except TransportError as exc:
            log(f"discovery: {exc}; looking on")
            self.pass_over(leader, f"left ({exc})")
            message = {"t": "left"}
        finally:
            entered.sock.close()
        if message is None:
            raise GroupNotFoundError(self.missing())
        if message["t"] != "ranks":
            if message["t"] == "gone":
                log(f"discovery: {_who(leader)} closed its group: {message.get('why', '')}; looking on")
            self.entered = None
            self.finder.publish(state=dsc.SEEK, port=0)
            return None
        roster = tuple((int(r), str(h), str(i)) for r, h, _, i in message["roster"])
        return Found("worker", int(message["rank"]), self.size, (host, int(message["port"])), iface.name,
                     roster, time.monotonic() - self.started)

    # -- giving up -----------------------------------------------------------------------------
    def missing(self) -> str:
        """Why no group formed: where this rank stood, who it heard, how many were missing."""
        n = self.size
        heard = self.finder.peers()
        self.peers()
        now = {p.instance for p in heard}
        mates = list(self.seen.values())
        if self.lobby is not None and not self.lobby.closed:
            members = list(self.lobby.members.values())
            have = 1 + len(members)
            stood = (f"this rank led and {len(members)} of the {n - 1} ranks it needs joined it"
                     + (f" ({', '.join(m.name() for m in members)})" if members else ""))
            stood += "".join(f"; left: {w}" for w in self.lobby.left)
            stood += "".join(f"; refused: {w}" for w in self.lobby.refused)
        elif self.entered is not None:
            have = len(self.entered.have)
            stood = (f"this rank joined {self.entered.leader.host}'s group, which had {have} of the {n} "
                     f"ranks ({', '.join(self.entered.have)})")
        else:
            have = 1 + len([p for p in mates if p.instance not in self.refused and p.instance in now
                            and (p.instance, p.port) not in self.unreachable])
            stood = "no rank led a group this rank could join"
        saw = [f"{_who(p)} at {', '.join(p.addresses) or '?'}: {self.state_of(p, p.instance in now)}"
               for p in mates]
        others = len([p for p in heard if not self.mate(p)])
        return (f"discovery on {', '.join(i.name for i in self.interfaces)} could not gather a group of "
                f"{n} ranks with this model before the timeout ({self.timeout:.0f} s): {stood}; "
                f"missing {max(0, n - have)} of the {n} ranks; heard "
                + ("; ".join(saw) if saw else "no other rank of this model and group size")
                + (f"; and {others} rank(s) of another model, protocol or group size" if others else "")
                + f". Start the missing ranks with the same --model, --ranks {n} and pair secret on this "
                "link (DS4_TP_TIMEOUT_SEC sets how long to look)")

    def state_of(self, p: dsc.Advert, heard: bool) -> str:
        if p.instance in self.refused:
            return f"refused ({self.why.get(p.instance, 'another secret, or gone')})"
        if (p.instance, p.port) in self.unreachable:
            return f"its lobby {self.why.get(p.instance, 'could not be reached')}"
        if not heard:
            return "left (its advert is gone)"
        return {dsc.SEEK: "looking", dsc.LEAD: "leading a group", dsc.PAIRED: "in a group"}[p.state]


class Reopened:
    """A formed group's leader taking a rank back (gate_ops.reconnect of a group that discovery
    found, or a serving group short of a rank, serve/held_links.py:Beacon): while it does, it
    advertises `lead` again with want "lead", so a restarted rank that runs discovery again
    joins it, even one already leading a lobby of its own. A group of N opens its lobby again:
    each rank that enters and proves the secret is sent at once the mesh's port and no rank
    (lobby.NO_RANK: the mesh's door gives it the one left free). A pair has no lobby (its
    worker's election, link/meet.py, joins a leader's door directly): the advert names the
    door itself. The ranks still in the group dial the mesh's door themselves. close()
    withdraws it (advert `paired`)."""

    def __init__(self, link: LinkSettings, identity: ModelIdentity, mesh_address: Tuple[str, int]) -> None:
        disc = link.check().discovery
        interfaces = [dsc.interface(name) for name in disc.interfaces]
        self.finder = meet.finder_for(disc, interfaces, identity, link)
        me = self.finder.me
        self.want = me.want
        self.mesh_port = int(mesh_address[1])
        self.lobby: Optional[lb.Lobby] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if link.size > 2:
            secret = secret_bytes(link.secret)
            knock = lb.Knock(me.instance, me.host, me.digest, link.size, me.version, lb.NO_RANK, secret is not None)
            self.lobby = lb.Lobby(listen_host(interfaces), knock, secret)
        port = self.lobby.port if self.lobby is not None else self.mesh_port
        self.finder.publish(state=dsc.LEAD, port=port, want="lead")
        restart = f"--ranks {link.size}" if link.size > 2 else "--model"
        log(f"discovery: this machine leads its group again (port {port}) for the rank that left: one "
            f"started again with the same {restart} and secret re-joins it")
        if self.lobby is not None:
            self._thread = threading.Thread(target=self._welcome, name="ds4tp-reopened", daemon=True)
            self._thread.start()

    def _welcome(self) -> None:
        lobby = self.lobby
        while not self._stop.is_set():
            lobby.wait(POLL_SEC)
            if self._stop.is_set():
                return
            member = lobby.admit()
            if member is None:
                continue
            roster = [[0, lobby.me.host, "", lobby.me.instance]]
            try:
                lb.send(member.sock, {"t": "ranks", "rank": lb.NO_RANK, "port": self.mesh_port, "roster": roster})
                log(f"discovery: {member.name()} re-joins this group at its mesh's door (port {self.mesh_port})")
            except TransportError as exc:
                log(f"discovery: {member.name()} left before it was told where to join ({exc})")
            lobby.members.pop(member.knock.instance, None)
            member.sock.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.lobby is not None:
            self.lobby.close()
        self.finder.publish(state=dsc.PAIRED, port=0, want=self.want)


def listen_host(interfaces: List[dsc.Interface]) -> str:
    """Where a leader's lobby and mesh listen: on its one interface's address; on several (a
    Mac with a cable to each other Mac), every address, so a rank found on any of them can
    reach it (IPv6's wildcard, which takes IPv4 too, where one has only a link-local address)."""
    if len(interfaces) == 1:
        return interfaces[0].listen_host()
    return "0.0.0.0" if all(i.ipv4 for i in interfaces) else "::"


def _who(peer: dsc.Advert) -> str:
    return f"{peer.host or 'a rank'} (instance {peer.instance})"
