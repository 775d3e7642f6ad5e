"""The lobby: where a group of N ranks (3 to 8) that found each other by discovery gathers
before its mesh forms (link/findgroup.py runs it; link/mesh.py then makes the mesh).

The elected leader listens on a port of its own (its advert in state `lead` names it); each
rank that joins it knocks, and the two prove the pair secret to each other by a
challenge-response before the leader counts it: each side's proof is an HMAC-SHA256 of the
secret over the other side's fresh nonce (its own tag, so a proof made here is no proof in a
pair's hello, and none can be replayed into another connection). A rank with another secret,
model, protocol or group size is refused with the reason, on both sides, and the lobby goes on
waiting for the right ones. The secret itself never travels, nor is it in any advert.

A member's connection stays open while it waits: when it closes (the rank died or left) the
member is dropped at once, so a rank that left is never waited for. Once N-1 members are in,
the leader gives every rank its rank (assign(): the stated rule) and the port where its mesh
will listen, then closes the lobby.

Messages are small JSON objects, each framed as b"DS4L", a little-endian u32 length, the
bytes (at most MAX_MESSAGE), so a stranger's bytes are refused before anything is parsed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import select
import socket
import struct
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..base.log import log
from ..errors import AuthenticationError, FrameError, HelloMismatchError, PeerClosedError, TransportTimeoutError
from .control import listen_socket, recv_some
from .discovery import same_model

MAGIC = b"DS4L"
HEADER = struct.Struct("<4sI")
MAX_MESSAGE = 8192
LOBBY_TAG = b"ds4tp-lobby-v1"
LEADER_ROLE, MEMBER_ROLE = 0, 1
NO_RANK = -1
# How long a fresh connection has to knock and prove, so a silent one cannot hold the lobby.
KNOCK_SEC = 3.0


@dataclasses.dataclass(frozen=True)
class Knock:
    """Who a rank is, as it says when it enters a lobby (and the leader answers alike):
    its advert's instance id and host name, the model digest, the group size, the protocol
    version, the rank it asks for (NO_RANK: any) and whether it holds a secret."""

    instance: str
    host: str
    digest: str
    size: int
    version: int
    ask: int = NO_RANK
    auth: bool = True

    def fields(self) -> dict:
        return {"id": self.instance, "host": self.host, "m": self.digest, "n": self.size,
                "v": self.version, "ask": self.ask, "auth": self.auth}

    @classmethod
    def of(cls, message: dict) -> "Knock":
        try:
            return cls(str(message["id"]), str(message["host"]), str(message["m"]), int(message["n"]),
                       int(message["v"]), int(message["ask"]), bool(message["auth"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise FrameError(f"a lobby knock without its fields ({exc})") from None


@dataclasses.dataclass
class Member:
    """A rank in the leader's lobby: its connection, what it said, the address it came from."""

    sock: socket.socket
    knock: Knock
    address: str

    def name(self) -> str:
        return f"{self.knock.host} at {self.address} (instance {self.knock.instance})"


def proof(secret: Optional[bytes], role: int, verifier_nonce: bytes, prover_nonce: bytes) -> str:
    """The lobby's proof of the secret ("" without one): over the verifier's fresh nonce."""
    if secret is None:
        return ""
    return hmac.new(secret, LOBBY_TAG + bytes([role]) + verifier_nonce + prover_nonce, hashlib.sha256).hexdigest()


def assign(leader: Knock, members: Sequence[Knock]) -> Dict[str, int]:
    """The stated rule, {instance: rank}: the leader is rank 0; a member that asked for a rank
    has it (the lobby refused a second asker of one); the others take the free ranks from the
    lowest, in the order of (host name, instance id), so the same machines get the same ranks
    whenever they meet again with the same names."""
    ranks = {leader.instance: 0}
    ranks.update({m.instance: m.ask for m in members if m.ask != NO_RANK})
    free = [r for r in range(1, leader.size) if r not in ranks.values()]
    for m in sorted((m for m in members if m.ask == NO_RANK), key=lambda m: (m.host, m.instance)):
        ranks[m.instance] = free.pop(0)
    return ranks


# ---------------------------------------------------------------------------------------------
# Framing


def send(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.settimeout(KNOCK_SEC)
    try:
        sock.sendall(HEADER.pack(MAGIC, len(body)) + body)
    except OSError as exc:
        raise PeerClosedError(f"lobby connection failed while sending: {exc}") from None


def recv(sock: socket.socket, until: float) -> dict:
    """The next message, by `until` (monotonic); PeerClosedError on EOF, TransportTimeoutError
    past `until`, FrameError for bytes that are not a lobby message."""
    head = _read(sock, HEADER.size, until)
    magic, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"not a ds4tp lobby message (first bytes {magic!r})")
    if length > MAX_MESSAGE:
        raise FrameError(f"a lobby message of {length} bytes (at most {MAX_MESSAGE})")
    try:
        message = json.loads(_read(sock, length, until))
    except ValueError as exc:
        raise FrameError(f"a lobby message that is not JSON ({exc})") from None
    if not isinstance(message, dict) or not isinstance(message.get("t"), str):
        raise FrameError("a lobby message without its type")
    return message


def _read(sock: socket.socket, n: int, until: float) -> bytes:
    out = b""
    while len(out) < n:
        out += recv_some(sock, n - len(out), until, "the lobby peer")
    return out


def _nonce() -> bytes:
    return secrets.token_bytes(16)


def _mismatch(mine: Knock, theirs: Knock) -> str:
    """Why two ranks are not of one group ("" when they are), the secret aside."""
    if theirs.version != mine.version:
        return f"protocol version {theirs.version}, this rank speaks {mine.version}: run the same mlx_ds4tp"
    if not same_model(theirs.digest, mine.digest):
        return "another model (its fingerprint digest differs): give every rank the same --model"
    if theirs.size != mine.size:
        return f"a group of {theirs.size} ranks, this one gathers {mine.size}: give every rank the same --ranks"
    if theirs.auth != mine.auth:
        return ("authentication failed: one side has a pair secret and the other none; give every "
                "rank the same secret (`ds4tp pair`, --secret or DS4_TP_SECRET)")
    return ""


# ---------------------------------------------------------------------------------------------
# The leader's side


class Lobby:
    """The leader's lobby at (host, a free port): admit() takes the next rank that proves the
    secret, check_members() drops those that left, release() gives out the ranks."""

    def __init__(self, host: str, me: Knock, secret: Optional[bytes]) -> None:
        self.sock = listen_socket(host, 0)
        self.sock.listen(16)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        self.me = me
        self.secret = secret
        self.members: Dict[str, Member] = {}
        self.refused: List[str] = []  # "name: why", for the give-up message
        self.left: List[str] = []
        self.closed = False

    def full(self) -> bool:
        return len(self.members) >= self.me.size - 1

    def wait(self, timeout: float) -> None:
        """Until a rank knocks, a member's connection stirs, or `timeout` seconds."""
        socks = [self.sock, *(m.sock for m in self.members.values())]
        select.select(socks, [], [], max(0.0, timeout))

    def admit(self) -> Optional[Member]:
        """The rank knocking now, once it proved the secret and fits; None when none knocks
        or it was refused (logged, and told why)."""
        ready, _, _ = select.select([self.sock], [], [], 0)
        if not ready:
            return None
        try:
            sock, peer = self.sock.accept()
        except OSError:
            return None
        address = peer[0]
        try:
            member = self._handshake(sock, address)
        except (FrameError, PeerClosedError, TransportTimeoutError, ValueError) as exc:
            self._refuse(sock, f"a connection from {address}", str(exc), tell=False)
            return None
        if member is not None:
            self.members[member.knock.instance] = member
            log(f"discovery: {member.name()} joined this group ({len(self.members)} of "
                f"{self.me.size - 1} workers{_asked(member.knock)})")
            self.tell_members()
        return member

    def _handshake(self, sock: socket.socket, address: str) -> Optional[Member]:
        until = time.monotonic() + KNOCK_SEC
        knock_msg = recv(sock, until)
        if knock_msg["t"] != "knock":
            raise FrameError(f"it sent {knock_msg['t']!r} where a knock comes first")
        theirs = Knock.of(knock_msg)
        who = f"{theirs.host} at {address} (instance {theirs.instance})"
        why = _mismatch(self.me, theirs) or self._ask_refusal(theirs)
        if why:
            self._refuse(sock, who, why)
            return None
        mine = _nonce()
        their_nonce = bytes.fromhex(str(knock_msg.get("nonce", "")))
        send(sock, {"t": "prove", **self.me.fields(), "nonce": mine.hex(),
                    "proof": proof(self.secret, LEADER_ROLE, their_nonce, mine)})
        answer = recv(sock, until)
        if answer["t"] == "error":
            self._refuse(sock, who, f"it refused this leader: {answer.get('why', '')}", tell=False)
            return None
        expected = proof(self.secret, MEMBER_ROLE, mine, their_nonce)
        if answer["t"] != "prove" or not hmac.compare_digest(str(answer.get("proof", "")), expected):
            self._refuse(sock, who, "authentication failed: its proof does not match this rank's pair "
                                    "secret (another secret, or another `ds4tp pair` code)")
            return None
        old = self.members.pop(theirs.instance, None)
        if old is not None:
            old.sock.close()
        return Member(sock, theirs, address)

    def _ask_refusal(self, theirs: Knock) -> str:
        if theirs.ask == NO_RANK:
            return ""
        if not 1 <= theirs.ask < self.me.size:
            return f"rank {theirs.ask} is not a worker's rank of {self.me.size} (1 .. {self.me.size - 1})"
        for m in self.members.values():
            if m.knock.ask == theirs.ask and m.knock.instance != theirs.instance:
                return f"rank {theirs.ask} was asked for by {m.name()}, which joined first; ask for another or none"
        return ""

    def _refuse(self, sock: socket.socket, who: str, why: str, tell: bool = True) -> None:
        log(f"discovery: this leader refused {who}: {why}")
        self.refused.append(f"{who}: {why}")
        if tell:
            try:
                send(sock, {"t": "error", "why": f"refused by the leader {self.me.host}: {why}"})
            except PeerClosedError:
                pass
        sock.close()

    def check_members(self, heard: Callable[[str], bool]) -> List[Member]:
        """Drop the members that left: their connection closed, or `heard(instance)` says their
        advert is gone (removed, or its TTL ran out: a Mac switched off says no goodbye)."""
        gone = []
        for instance, m in list(self.members.items()):
            why = ""
            ready, _, _ = select.select([m.sock], [], [], 0)
            if ready:
                try:
                    data = m.sock.recv(1, socket.MSG_PEEK)
                except OSError:
                    data = b""
                why = "its connection closed" if not data else "it spoke out of turn"
            elif not heard(instance):
                why = "its advert is gone"
            if why:
                log(f"discovery: {m.name()} left this group ({why}); not waiting for it")
                self.left.append(f"{m.name()} ({why})")
                del self.members[instance]
                m.sock.close()
                gone.append(m)
        if gone:
            self.tell_members()
        return gone

    def tell_members(self) -> None:
        """Each member hears who is in, for its own message should the group not fill."""
        names = [self.me.host] + [m.knock.host for m in self.members.values()]
        for m in list(self.members.values()):
            try:
                send(m.sock, {"t": "in", "have": names, "need": self.me.size})
            except PeerClosedError:
                pass  # check_members drops it on the next round

    def release(self, mesh_port: int) -> List[Tuple[int, Member]]:
        """Every member's rank and the mesh's port, sent; the lobby closed. [(rank, member)]."""
        ranks = assign(self.me, [m.knock for m in self.members.values()])
        roster = sorted([[0, self.me.host, "", self.me.instance]] +
                        [[ranks[i], m.knock.host, m.address, i] for i, m in self.members.items()])
        out = []
        for instance, m in self.members.items():
            send(m.sock, {"t": "ranks", "rank": ranks[instance], "port": mesh_port, "roster": roster})
            out.append((ranks[instance], m))
        self.close()
        return sorted(out, key=lambda rm: rm[0])

    def close(self, why: str = "") -> None:
        """Close the lobby; `why` (a leader stepping down or giving up) is told to each member."""
        for m in self.members.values():
            if why:
                try:
                    send(m.sock, {"t": "gone", "why": why})
                except PeerClosedError:
                    pass
            m.sock.close()
        self.members = {}
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _asked(knock: Knock) -> str:
    return "" if knock.ask == NO_RANK else f", asks for rank {knock.ask}"


# ---------------------------------------------------------------------------------------------
# A member's side


@dataclasses.dataclass
class Entered:
    """This rank, in a leader's lobby: the connection, the leader's knock, who is in so far."""

    sock: socket.socket
    leader: Knock
    have: List[str]


def enter(sock: socket.socket, me: Knock, secret: Optional[bytes]) -> Entered:
    """Knock on the lobby at the other end of `sock` and prove the secret both ways.
    AuthenticationError when the leader's proof fails (another secret: this rank tells it so)
    or the leader refuses ours; HelloMismatchError for another model, size or protocol."""
    until = time.monotonic() + KNOCK_SEC
    mine = _nonce()
    try:
        send(sock, {"t": "knock", **me.fields(), "nonce": mine.hex()})
        answer = recv(sock, until)
        if answer["t"] == "error":
            raise _refusal(str(answer.get("why", "")))
        if answer["t"] != "prove":
            raise FrameError(f"the lobby answered {answer['t']!r} to a knock")
        leader = Knock.of(answer)
        their_nonce = bytes.fromhex(str(answer.get("nonce", "")))
        why = _mismatch(me, leader)
        if not why and not hmac.compare_digest(str(answer.get("proof", "")),
                                               proof(secret, LEADER_ROLE, mine, their_nonce)):
            why = ("authentication failed: the leader's proof does not match this rank's pair secret "
                   "(another secret, or another `ds4tp pair` code)")
        if why:
            send(sock, {"t": "error", "why": why})
            raise _refusal(why)
        send(sock, {"t": "prove", "proof": proof(secret, MEMBER_ROLE, their_nonce, mine)})
        answer = recv(sock, until)
        if answer["t"] == "error":
            raise _refusal(str(answer.get("why", "")))
        if answer["t"] != "in":
            raise FrameError(f"the lobby answered {answer['t']!r} to a proof")
    except BaseException:
        sock.close()
        raise
    return Entered(sock, leader, [str(h) for h in answer.get("have", [])])


def _refusal(why: str) -> Exception:
    if "authentication failed" in why:
        return AuthenticationError(why)
    return HelloMismatchError(why)


def wait_for_rank(entered: Entered, until: float, leader_heard: Callable[[], bool]) -> Optional[dict]:
    """The leader's "ranks" message ({"rank", "port", "roster"}) or its "gone" one ({"why"}: it
    stepped down for another leader, or gave up), or None at `until`. PeerClosedError when the
    connection closed without a word or the leader's advert went away (a leader that left is
    not waited for)."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([entered.sock], [], [], min(left, 0.1))
        if not ready:
            if not leader_heard():
                raise PeerClosedError(f"the leader {entered.leader.host}'s advert is gone")
            continue
        message = recv(entered.sock, time.monotonic() + KNOCK_SEC)
        if message["t"] == "in":
            entered.have = [str(h) for h in message.get("have", [])]
        elif message["t"] in ("ranks", "gone"):
            return message
        elif message["t"] == "error":
            raise PeerClosedError(f"the leader {entered.leader.host} closed its group: {message.get('why', '')}")
        else:
            raise FrameError(f"the lobby sent {message['t']!r} while this rank waited for its rank")
