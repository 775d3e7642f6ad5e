"""Forming a group of N ranks (2 to 8), the one way any group forms: rank 0 listens at its door
(link/door.py), the workers dial it and JOIN, the leader gives out the ranks and tells every
rank where the others listen (ROSTER) and the group's id (MESH_ID); then every pair of ranks
makes its own link through connect() (hello, secret, model check, the transport chosen per
link, RDMA bring-up with its warm-up, receives-posted barrier, post cap and re-creation): a
group of two is a door, a JOIN, a ROSTER and one link.

Ranks: a worker may ask for one (JOIN's rank); the leader gives the asked ranks first (a rank
asked twice is refused to the later asker) and the others, lowest free first, in the order
the workers joined. A worker started without a size JOINs with size 0 and learns the leader's
from the ROSTER (its length).

Links come up one at a time in one order every rank walks, (0, 1), (0, 2) .. (1, 2) ..: the
lower rank listens at its door, the higher dials it. The smallest link not yet made always
has both its ranks at it, so the walk never deadlocks, and only one peer at a time dials a
door. A link that fails names both ranks and the device; the whole group fails with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

from ..base.log import log
from ..errors import (
    AuthenticationError,
    FrameError,
    HelloMismatchError,
    PeerClosedError,
    RegroupedError,
    TransportError,
    TransportTimeoutError,
)
from .cable_watch import CableWatch, watch_cables
from .cables import (
    Cable,
    CableAddress,
    Wiring,
    cable_device,
    check_named_devices,
    device_label,
    local_cables,
    opened_device,
    pack_cables,
    refuse_uncabled,
    unpack_cables,
)
from .config import LinkSettings, PairAddress, parse_fault_links
from .connection import Pair
from .control import ControlChannel, dial, tune_socket
from .door import Door
from .handshake import connect
from .rdma import rdma_probe
from .roster import pack_roster, unpack_roster
from .wire import (
    JOIN_PAYLOAD,
    JOIN_TAG,
    MAX_MESH_SIZE,
    MESH_ID_PAYLOAD,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    FrameType,
)

Connect = Callable[..., Pair]
Dial = Callable[[str, int, float, str], socket.socket]
ANY_RANK = -1
LEADERS_SIZE = 0  # JOIN's size from a worker started without one: it takes the leader's
HOLD = "held"  # _check_join's word for a JOIN a regrouping leader holds (LinkSettings.regrouping)


@dataclasses.dataclass
class Mesh:
    """This rank's end of a formed group: its rank, the size, one complete Pair per peer rank
    (each a pair's own link: in it this rank is pair rank 0 towards higher ranks, 1 towards
    lower ones), the group's id, and what stays open until close() (door None: links a test
    made alone with connect())."""

    rank: int
    size: int
    pairs: Dict[int, Pair]
    mesh_id: bytes
    door: Optional[Door]
    keep: List[socket.socket]
    closed: bool = False
    cables: Dict[int, Optional[Cable]] = dataclasses.field(default_factory=dict)
    # --transport rdma over cables that form a ring (no full mesh): the ring, in cycle order.
    # The collectives go round its RDMA links alone (collectives/group.py); the other links
    # are TCP and carry only the leader's commands. [] otherwise.
    cabled_ring: List[int] = dataclasses.field(default_factory=list)
    # A group of 3 or more on named cables: its cables watched while it runs (a pulled one
    # fails the group at once, named); None otherwise (a pair's pull is its gate timeout).
    watch: Optional[CableWatch] = None

    def cable_fault(self) -> Optional[str]:
        """Which of this rank's cables is out (the two ranks, both ends), or None: what a failed
        collective is explained by."""
        return None if self.watch is None else self.watch.explain()

    def transports(self) -> Dict[int, str]:
        """{peer rank: "tcp" | "rdma"}: what each link runs on."""
        return {peer: pair.transport for peer, pair in sorted(self.pairs.items())}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.close()
        for pair in self.pairs.values():
            pair.close()
        if self.door is not None:
            self.door.close()
        for sock in self.keep:
            try:
                sock.close()
            except OSError:
                pass


def make_link(config: LinkSettings, **seams) -> Pair:
    """One link's steps, complete (handshake.connect with this rank's RDMA probe): its RDMA
    queue pair proven, or TCP chosen."""
    return connect(config, rdma_probe=lambda: rdma_probe(config.rdma_device, config.verbs_library),
                   **seams)


def form_mesh(link: LinkSettings, connect: Connect = make_link, *, dial: Dial = dial) -> Mesh:
    """This rank's end of the group `link` (resolved; a worker's size None: the leader's)
    describes; connect(settings, dial=..., door=...) makes each link's pair (a test's seam;
    make_link by default). dial opens a worker's connection to the leader's door (discovery
    gives one that stops early at a stale address)."""
    started = time.monotonic()
    deadline = started + link.timeout
    mine = local_cables(link.cables)
    if link.address.role == "leader":
        rank, roster, cables, mesh_id, door, keep = _gather(link, mine, deadline)
    else:
        rank, roster, cables, mesh_id, door, keep = _join(link, mine, deadline, dial)
    size = len(roster)
    link = dataclasses.replace(link, size=size)
    wiring = Wiring(cables)
    pairs: Dict[int, Pair] = {}
    ring = wiring.ring() if link.transport == "rdma" else []
    try:
        _wired(link, rank, wiring)  # a group that cannot be wired stops before any link
        if ring:
            log(f"mesh: the cables form the ring {'-'.join(map(str, ring))}: --transport rdma runs "
                "every collective round its RDMA links; the links between ranks without a cable "
                "run tcp and carry only the leader's commands")
        for low, high in _link_order(size):
            if rank in (low, high):
                peer = high if rank == low else low
                pairs[peer] = _make_link(link, rank, peer, roster, mesh_id, door, connect, wiring)
        _formed(link, rank, mesh_id, keep, deadline)
    except BaseException:
        for pair in pairs.values():
            pair.close()
        door.close()
        for sock in keep:
            sock.close()
        raise
    mesh = Mesh(rank, size, pairs, mesh_id, door, keep,
                cables={p: wiring.cable(rank, p) if wiring.named else None for p in pairs},
                cabled_ring=ring)
    mesh.watch = watch_cables(rank, size, mesh.cables, [pair.data for pair in pairs.values()])
    kinds = ", ".join(f"{rank}<->{p} {t}" for p, t in mesh.transports().items())
    log(f"mesh: rank {rank} of {size} linked to every peer in "
        f"{time.monotonic() - started:.2f} s ({kinds})")
    return mesh


def _formed(link: LinkSettings, rank: int, mesh_id: bytes, joins: List[socket.socket],
            deadline: float) -> None:
    """The mesh is formed on every rank before any rank's init returns: each worker says its
    links are up (MESH_ID again on its JOIN connection), and the leader, once all have, says so
    to all. So no rank closes a formed mesh (its JOIN connection: to the workers still at their
    doors, "the leader gave up") while another is still linking."""
    ready = MESH_ID_PAYLOAD.pack(mesh_id, rank)
    channels = [ControlChannel(sock, link.timeout) for sock in joins]
    if rank == 0:
        for channel in channels:
            _expect_ready(channel, mesh_id, deadline)
        for channel in channels:
            channel.send(FrameType.MESH_ID, ready)
    else:
        channels[0].send(FrameType.MESH_ID, ready)
        _expect_ready(channels[0], mesh_id, deadline)


def _expect_ready(channel: ControlChannel, mesh_id: bytes, deadline: float) -> None:
    _, payload = channel.recv(FrameType.MESH_ID, timeout=max(0.01, deadline - time.monotonic()))
    if len(payload) != MESH_ID_PAYLOAD.size or MESH_ID_PAYLOAD.unpack(payload)[0] != mesh_id:
        raise FrameError("a rank said the mesh is formed with another mesh's id")


def _wired(link: LinkSettings, rank: int, wiring: Wiring) -> Dict[int, str]:
    """Before any link: a group named cables (--interface) that --transport rdma cannot cable
    is refused here, on every rank alike (each reads the same roster); the devices named per
    peer (rdma_devices, --rdma-devices) checked against the cables found."""
    if not wiring.named:
        return {peer: opened_device(d) for peer, d in (link.rdma_devices or {}).items()}
    if link.transport == "rdma":
        refuse_uncabled(wiring)
    return check_named_devices(link.rdma_devices or {}, rank, wiring, link.rdma_device)


def _link_order(size: int) -> List[Tuple[int, int]]:
    return [(low, high) for low in range(size) for high in range(low + 1, size)]


# ============================================================================
# Membership
# ============================================================================


def join_proof(secret: Optional[bytes], fields: bytes) -> bytes:
    """JOIN's proof: HMAC-SHA256 of the pair secret over the JOIN's other fields and its cable
    addresses (zeros
    without a secret). It keeps strangers out of the rank count; every link's hello then
    authenticates as a pair's does (challenge-response), so a replayed JOIN links nothing."""
    if secret is None:
        return bytes(32)
    return hmac.new(secret, JOIN_TAG + fields, hashlib.sha256).digest()


def _join_fields(size: int, ask: int, port: int, nonce: bytes) -> bytes:
    return JOIN_PAYLOAD.pack(PROTOCOL_VERSION, size, ask, port, nonce, bytes(32))[:-32]


def _gather(link: LinkSettings, mine: List[CableAddress], deadline: float):
    """Rank 0: the workers' JOINs at the door, their ranks, ROSTER and MESH_ID out."""
    host, port = link.address.listen
    door = Door(host, port, link.size, min(link.hello_timeout, link.timeout), [c.ip for c in mine])
    others = "rank 1" if link.size == 2 else f"ranks 1 .. {link.size - 1}"
    log(f"mesh: rank 0 of {link.size} waiting for {others} on {host}:{door.port} ...")
    # channel, asked, host, door port, cables
    members: List[Tuple[ControlChannel, int, str, int, List[CableAddress]]] = []
    door.hold_joins, unasked_by = link.regrouping is not None, deadline
    if link.regrouping is not None and link.regrouping.unasked_within:
        unasked_by = min(deadline, time.monotonic() + link.regrouping.unasked_within)
    try:
        while len(members) < link.size - 1:
            unasked = link.regrouping is not None and link.regrouping.takes_unasked([m[1] for m in members])
            try:
                channel, payload, peer = door.next_join(unasked_by if unasked else deadline)
            except TransportTimeoutError:
                if not unasked or time.monotonic() >= deadline:
                    raise
                raise PeerClosedError("the rank back did not JOIN this door in time after it was let go at "
                                      "the last one: it is gone") from None
            refusal, asked, their_port, their_cables = _check_join(link, payload, members)
            if refusal == HOLD:
                door.hold(channel.sock, peer)
                continue
            if refusal:
                log(f"mesh: refused a JOIN from {peer}: {refusal}")
                channel.send_error(refusal)
                channel.sock.close()
                continue
            members.append((channel, asked, peer.rsplit(":", 1)[0], their_port, their_cables))
            log(f"mesh: {peer} joined ({len(members)} of the {link.size - 1} other ranks"
                f"{'' if asked == ANY_RANK else f', asks for rank {asked}'})")
        ranks = assign_ranks([m[1] for m in members], link.size)
        roster = [("", door.port)] + [("", 0)] * (link.size - 1)
        cables: List[List[CableAddress]] = [mine] + [[] for _ in range(link.size - 1)]
        for (_, _, peer_host, peer_port, their_cables), rank in zip(members, ranks):
            roster[rank] = (peer_host, peer_port)
            cables[rank] = their_cables
        mesh_id = secrets.token_bytes(16)
        for (channel, *_), rank in zip(members, ranks):
            door.joined[rank] = channel.sock
            channel.send(FrameType.ROSTER, pack_roster(roster, rank, cables))
            channel.send(FrameType.MESH_ID, MESH_ID_PAYLOAD.pack(mesh_id, 0))
    except BaseException:
        door.close()
        for channel, *_ in members:
            channel.sock.close()
        raise
    door.mesh_id = mesh_id
    return 0, roster, cables, mesh_id, door, [m[0].sock for m in members]


def _check_join(link: LinkSettings, payload: bytes, members) -> Tuple[str, int, int, List[CableAddress]]:
    """(why the JOIN is refused or "", the rank it asks for, its door's port, its cables)."""
    version, size, asked, port, nonce, proof = JOIN_PAYLOAD.unpack_from(payload)
    if version != PROTOCOL_VERSION:
        return (f"protocol version {version}, this leader speaks {PROTOCOL_VERSION}: run the same "
                "mlx_ds4tp on every rank"), asked, port, []
    packed = payload[JOIN_PAYLOAD.size:]
    try:
        cables, end = unpack_cables(packed, 0)
    except FrameError as exc:
        return f"its cable addresses do not parse ({exc})", asked, port, []
    fields = _join_fields(size, asked, port, nonce) + packed
    if end != len(packed) or not hmac.compare_digest(proof, join_proof(link.secret, fields)):
        return ("authentication failed: the JOIN's proof does not match this leader's pair secret; pair "
                "every Mac with `ds4tp pair`, or give every rank the same --secret / DS4_TP_SECRET"), asked, port, []
    if asked == ANY_RANK and link.regrouping and not link.regrouping.takes_unasked([m[1] for m in members]):
        return HOLD, asked, port, cables  # a rank started again: no member's place is its
    if size not in (link.size, LEADERS_SIZE):
        return (f"the group has {link.size} ranks and this rank was started for {size}; give every "
                f"rank --ranks {link.size} (size={link.size}), or start the workers without --ranks "
                "to take the leader's"), asked, port, []
    if asked != ANY_RANK and not 1 <= asked < link.size:
        return (f"rank {asked} is not a worker's rank of a group of {link.size} (1 .. {link.size - 1}); "
                "ask for one of those, or none"), asked, port, []
    if asked != ANY_RANK and asked in [m[1] for m in members]:
        return (f"rank {asked} was asked for by a worker that joined first; ask for another rank "
                "or none"), asked, port, []
    return "", asked, port, cables


def assign_ranks(asked: List[int], size: int) -> List[int]:
    """The rank of each worker, in join order: asked ranks first, then the lowest free rank to
    each of the others in the order they joined."""
    free = [r for r in range(1, size) if r not in asked]
    out = []
    for want in asked:
        out.append(want if want != ANY_RANK else free.pop(0))
    return out


# How long a worker whose JOIN the leader's door dropped unread dials that door again: a
# re-forming leader opens its new door at once, and a dead one must be an error within ~1 s.
REDIAL_SEC = 1.0


def _join(link: LinkSettings, mine: List[CableAddress], deadline: float, dial: Dial):
    """A worker: dial the leader's door, JOIN, learn the rank, the roster (its length the
    group's size, for a worker started without one) and the group's id."""
    host, port = link.address.coordinator
    until = deadline
    while True:
        try:
            sock, channel, door, answer = _send_join(link, mine, until, deadline, dial)
        except TransportTimeoutError:
            if until == deadline:
                raise
            raise PeerClosedError(f"the leader (rank 0) at {host}:{port} closed its connection (EOF) "
                                  f"before answering this rank's JOIN, and did not open its door again "
                                  f"within {REDIAL_SEC:.0f} s: it is gone") from None
        if answer is not None:
            break
        # The door closed under this JOIN before any answer: a leader forming its group again
        # closes its old door and opens the new one at the same port, and a JOIN that reached
        # the old one in between is dropped unread. Dial again for a few seconds (a leader that
        # died stays gone: the worker must not wait out its whole connect timeout for it).
        until = min(until, time.monotonic() + REDIAL_SEC)
        time.sleep(0.05)
    try:
        ftype, payload = answer
        if ftype == FrameType.HELLO:  # a leader of protocol 13 or older: a pair's says hello first
            raise HelloMismatchError(
                f"the leader at {host}:{port} answered this JOIN with a pair's HELLO: it runs an older "
                f"mlx_ds4tp (protocol before {PROTOCOL_VERSION}); install the same version on every rank")
        if ftype == FrameType.RESIZE:  # a serving leader's group of this size did not form
            raise RegroupedError(f"the leader at {host}:{port} forms its group at another size", payload)
        if ftype != FrameType.ROSTER:
            raise FrameError(f"expected a ROSTER frame, got {ftype.name} ({len(payload)} bytes)")
        roster, rank, cables = unpack_roster(payload)
        if link.size is not None and len(roster) != link.size:
            raise FrameError(f"the leader's ROSTER names {len(roster)} ranks; this rank JOINed a group of {link.size}")
        _, payload = channel.recv(FrameType.MESH_ID)
        if len(payload) != MESH_ID_PAYLOAD.size:
            raise FrameError(f"MESH_ID payload is {len(payload)} bytes, expected {MESH_ID_PAYLOAD.size}")
        mesh_id, _ = MESH_ID_PAYLOAD.unpack(payload)
    except BaseException:
        door.close()
        sock.close()
        raise
    roster[0] = (host, roster[0][1])
    door.size = len(roster)
    door.mesh_id = mesh_id
    door.abort_on = [sock]
    log(f"mesh: rank {rank} of {len(roster)} (leader {host}:{port}); links come up next")
    return rank, roster, cables, mesh_id, door, [sock]


def _send_join(link: LinkSettings, mine: List[CableAddress], dial_by: float, deadline: float, dial: Dial):
    """(socket, channel, this rank's door, the leader's first frame) for one JOIN, dialed by
    `dial_by` and answered by `deadline` (the ROSTER comes once every rank joined); the frame
    is None when the leader's door closed the connection without a word."""
    host, port = link.address.coordinator
    sock = dial(host, port, dial_by, "control")  # the JOIN opens the worker's control connection
    tune_socket(sock)
    channel = ControlChannel(sock, link.timeout)
    try:
        # Every interface: a peer worker may reach this one by another route than the leader
        # did. The roster names the address the leader saw this rank at.
        anywhere = "::" if ":" in sock.getsockname()[0] else "0.0.0.0"
        door = Door(anywhere, 0, link.size or MAX_MESH_SIZE, min(link.hello_timeout, link.timeout))
    except BaseException:
        sock.close()
        raise
    try:
        ask = ANY_RANK if link.ask_rank is None else link.ask_rank
        nonce = secrets.token_bytes(NONCE_BYTES)
        fields = _join_fields(link.size or LEADERS_SIZE, ask, door.port, nonce)
        packed = pack_cables(mine)
        try:
            channel.send(FrameType.JOIN, fields + join_proof(link.secret, fields + packed) + packed)
            answer = channel.recv(timeout=max(0.01, deadline - time.monotonic()))
        except PeerClosedError:
            answer = None
        except TransportError as exc:
            raise _refused(exc, host, port) from None
    except BaseException:
        door.close()
        sock.close()
        raise
    if answer is None:
        door.close()
        sock.close()
    return sock, channel, door, answer


def _refused(exc: TransportError, host: str, port: int) -> TransportError:
    """The leader's answer to this JOIN was a refusal (an ERROR frame): one that waiting would not
    change (another secret, size, version or rank) is raised as such, so a rejoin stops on it."""
    text = str(exc)
    if not text.startswith("peer reported: "):
        return exc
    why = f"the leader (rank 0) at {host}:{port} refused this rank: {text[len('peer reported: '):]}"
    return AuthenticationError(why) if "authentication failed" in text else HelloMismatchError(why)


# ============================================================================
# Links
# ============================================================================


def _make_link(link: LinkSettings, rank: int, peer: int, roster, mesh_id: bytes, door: Door,
               connect: Connect, wiring: Wiring) -> Pair:
    """This rank's link to `peer`: a pair made by connect(), the lower rank on its door; with
    cables named, on the cable the two share (dialed at the peer's address there, its device),
    or over TCP on the roster's route where they share none (transport auto, or rdma whose
    cables form a ring: that link carries commands, never a collective)."""
    devices = _wired(link, rank, wiring)
    device = devices.get(peer, link.rdma_device)
    transport, dial_at, on = link.transport, roster[peer], ""
    device_name = device or "the first active one"
    low, high = min(rank, peer), max(rank, peer)
    if wiring.named:
        cable = wiring.cable(rank, peer)
        ring = wiring.ring() if link.transport == "rdma" else []
        if cable is None:
            transport = "tcp" if link.transport == "auto" or ring else link.transport
            only = (f", for the leader's commands only: the collectives go round the ring of cables "
                    f"{'-'.join(map(str, ring))}" if ring else "")
            log(f"mesh: link rank {low} <-> rank {high}: {wiring.why_uncabled(low, high)}, so "
                f"{transport} over the route to {roster[peer][0] or 'the leader'} (transport {link.transport}{only})")
        else:
            device = devices.get(peer) or cable_device(cable.mine.interface, link.rdma_device)
            dial_at = (cable.theirs.ip, roster[peer][1])
            on = (f" on the cable {cable.mine.interface} {cable.mine.ip} <-> {cable.theirs.interface} "
                  f"{cable.theirs.ip}")
            device_name = device_label(device, cable.mine.interface)
    faulted = parse_fault_links(link.ucsim_fault_links or "")
    faults = link.ucsim_faults if not faulted or (low, high) in faulted else ""
    if rank < peer:
        address = PairAddress("leader", (door.host, door.port), None)
    else:
        address = PairAddress("worker", None, dial_at)
    settings = dataclasses.replace(link, address=address, transport=transport, rdma_device=device,
                                   ucsim_faults=faults, size=2, ask_rank=None, rdma_devices=None)

    def dial_link(host: str, port: int, deadline: float, what: str) -> socket.socket:
        sock = dial(host, port, deadline, what, abort_on=door.abort_on)
        if what == "control":
            # The mesh's id opens the link's control connection: the peer's door refuses a
            # link of another mesh before any hello.
            ControlChannel(sock, link.timeout).send(FrameType.MESH_ID, MESH_ID_PAYLOAD.pack(mesh_id, rank))
        return sock

    try:
        if rank < peer:
            pair = connect(settings, door=door.for_peer(peer))
        else:
            pair = connect(settings, dial=dial_link)
    except TransportError as exc:
        if link.size == 2:
            raise  # the group's one link: its leader is rank 0, its worker rank 1, as its messages say
        where = f"device {device_name}{on}" if transport != "tcp" else "tcp"
        # The pair's own messages say "leader" and "worker": on this link, the lower rank and the higher.
        message = (f"mesh link rank {low} <-> rank {high} ({where}; on this link the leader is rank "
                   f"{low}, the worker rank {high}): {exc}")
        try:
            error = type(exc)(message)
        except TypeError:
            error = TransportError(message)
        raise error from exc
    log(f"mesh: link rank {low} <-> rank {high} up{on}, transport {pair.transport}"
        + (f", device {device_name}" if pair.transport == "rdma" and (device or on) else ""))
    return pair
