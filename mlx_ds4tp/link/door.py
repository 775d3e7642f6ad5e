"""A group rank's one listener, its door: every connection a rank of a group (2 to 8 ranks)
takes comes in here, and the door sorts it by its first bytes before anyone reads more.

- JOIN (rank 0, while the group gathers): a worker asking for a rank (link/mesh.py);
- MESH_ID then a link's hello (once the roster is out): the control connection of one of this
  rank's links, made by connect() as a pair's is; the id must be this mesh's, so a rank left
  over from an earlier mesh (restarted peers, a stale roster) is refused, never linked. It
  names the dialing rank: a peer that dials ahead of its turn (its own walk of the links is
  ahead of this rank's) is parked until this rank comes to its link;
- DATA_HELLO: a link's gate data connection, which connect() binds to its control connection
  by the session and the secret's proof, as a pair's.

Anything else (a scanner, a HELLO first: a rank of another protocol version, whose workers
said hello where this one JOINs, a JOIN once the group is formed) is told why on an ERROR frame
where it speaks our frames, and dropped; the door keeps waiting.
A connection gets `hello_timeout` to say what it is, so a silent client cannot hold the door.
"""

from __future__ import annotations

import hmac
import select
import socket
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..base.log import log
from ..errors import PeerClosedError, TransportError
from .control import ControlChannel, accept, listen_socket, recv_some
from .wire import (
    DATA_MAGIC,
    HELLO_HEAD,
    JOIN_PAYLOAD,
    MAGIC,
    MESH_ID_PAYLOAD,
    PROTOCOL_VERSION,
    FrameType,
)

_PEEK_BYTES = 4


class Door:
    """One listening socket at (host, port) (port 0: any free one; `port` says which), shared by
    the mesh's membership (JOIN, rank 0 only) and every link this rank listens for.

    mesh_id: the mesh's id once the roster is out (None while it gathers): links must present
    it. abort_on: sockets whose EOF or data means the bring-up is over (a worker's connection
    to the leader: the leader gave up), so a wait at the door ends then, not at the timeout.
    cables: more addresses it listens on at the same port, this rank's cable addresses (a leader
    listening on its LAN address: its links run over the cables, dialed at their addresses)."""

    def __init__(self, host: str, port: int, size: int, hello_timeout: float,
                 cables: Sequence[str] = ()):
        self.sock = listen_socket(host, port)
        self.sock.listen(4 * size)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        self.cable_socks: List[socket.socket] = []
        try:
            # A door on every interface (0.0.0.0, ::) already takes the cables' connections.
            for ip in cables if host not in ("0.0.0.0", "::", "") else ():
                if ip != host:
                    self.cable_socks.append(listen_socket(ip, self.port))
                    self.cable_socks[-1].listen(4 * size)
        except BaseException:
            self.close()
            raise
        self.size = size
        self.hello_timeout = hello_timeout
        self.mesh_id: Optional[bytes] = None
        self.abort_on: List[socket.socket] = []
        self._parked: Dict[int, Tuple[socket.socket, str]] = {}
        # A regrouping leader's (LinkSettings.regrouping): a JOIN it does not take, its reply
        # never sent, kept open for serve/resize.py (a restarted rank waits there, not refused).
        self.hold_joins = False
        self.held: List[socket.socket] = []
        # The leader's: each worker's JOIN connection by rank, once the roster is out. A worker
        # says nothing there until all its links are up, so its end closing while the leader
        # waits for its link is its death, an error at once (not a wait for the deadline).
        self.joined: Dict[int, socket.socket] = {}

    # -- what the mesh and its links call ----------------------------------------
    def next_join(self, deadline: float) -> Tuple[ControlChannel, bytes, str]:
        """The next worker's JOIN: (its control channel, the JOIN payload, "host:port")."""
        while True:
            sock, peer = self._take(deadline, "JOIN")
            kind, payload = self._sort(sock, peer, deadline)
            if kind == FrameType.JOIN and self.mesh_id is None:
                return ControlChannel(sock, self.hello_timeout), payload, peer
            self._refuse(sock, peer, kind, "a worker's JOIN", payload)

    def for_peer(self, peer: int) -> "LinkDoor":
        """The door as connect() sees it for the link to rank `peer`."""
        return LinkDoor(self, peer)

    def accept(self, deadline: float, what: str, watch: Optional[ControlChannel] = None,
               peer: Optional[int] = None) -> Tuple[socket.socket, str]:
        """A link's next connection: "control" from rank `peer` after this mesh's MESH_ID
        (another rank's is parked for its turn), "gate data" by its DATA_HELLO (which
        connect() checks against the control connection's session)."""
        if what == "control" and peer in self._parked:
            return self._parked.pop(peer)
        while True:
            sock, where = self._take(deadline, what, watch)
            kind, payload = self._sort(sock, where, deadline)
            if kind == FrameType.MESH_ID:
                _, rank = MESH_ID_PAYLOAD.unpack(payload)
                if what == "control" and rank == peer:
                    return sock, where
                if rank != peer and 0 <= rank < self.size and rank not in self._parked:
                    self._parked[rank] = (sock, where)
                    continue
            if what == "gate data" and kind == "data":
                return sock, where
            if kind == FrameType.JOIN and self.hold_joins:
                self.hold(sock, where)
                continue
            self._refuse(sock, where, kind, f"a link's {what} connection", payload)

    def hold(self, sock: socket.socket, peer: str) -> None:
        """A JOIN kept unanswered (hold_joins): its rank waits for the group to grow."""
        log(f"mesh door {self.host}:{self.port}: holds the JOIN of a rank started again ({peer}) "
            "until this group serves; it joins the group grown back")
        self.held.append(sock)

    def close(self) -> None:
        """The listeners and every connection parked or held closed (a held rank dials again)."""
        for sock, _ in self._parked.values():
            sock.close()
        self._parked.clear()
        for sock in self.held:
            sock.close()
        self.held.clear()
        for sock in (self.sock, *self.cable_socks):
            try:
                sock.close()
            except OSError:
                pass

    # -- sorting -----------------------------------------------------------------
    def _take(self, deadline: float, what: str,
              watch: Optional[ControlChannel] = None) -> Tuple[socket.socket, str]:
        while self.abort_on:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _, _ = select.select([self.sock, *self.abort_on], [], [], remaining)
            if self.sock in ready:
                break
            if ready:
                raise PeerClosedError(f"the mesh's leader gave up its bring-up while this rank "
                                      f"waited at its door for {what}")
        listener = self.sock
        while self.cable_socks:  # which of the listeners a connection waits at
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            watched = [] if watch is None else [watch.sock]
            ready, _, _ = select.select([self.sock, *self.cable_socks, *watched], [], [], remaining)
            listener = next((s for s in (self.sock, *self.cable_socks) if s in ready), self.sock)
            if ready:
                break
        return accept(listener, deadline, what, watch=watch)

    def _sort(self, sock: socket.socket, peer: str, deadline: float):
        """What the connection is: (FrameType.JOIN | MESH_ID, payload), ("data", b""),
        (another frame type, b""), or (None, reason) when it said nothing we read."""
        until = min(deadline, time.monotonic() + self.hello_timeout)
        try:
            head = _peek(sock, _PEEK_BYTES, until)
        except TransportError as exc:
            return None, str(exc)
        word = int.from_bytes(head, "little")
        if word == DATA_MAGIC:
            return "data", b""
        if word != MAGIC:
            return None, f"first word 0x{word:08x} is not a ds4tp frame"
        channel = ControlChannel(sock, self.hello_timeout)
        try:
            ftype, payload = channel.recv(timeout=max(0.01, until - time.monotonic()))
        except TransportError as exc:
            return None, str(exc)
        if ftype == FrameType.JOIN and len(payload) < JOIN_PAYLOAD.size:
            return None, f"JOIN payload is {len(payload)} bytes, expected at least {JOIN_PAYLOAD.size}"
        if ftype == FrameType.MESH_ID:
            if len(payload) != MESH_ID_PAYLOAD.size:
                return None, f"MESH_ID payload is {len(payload)} bytes, expected {MESH_ID_PAYLOAD.size}"
            if self.mesh_id is None or not hmac.compare_digest(payload[:len(self.mesh_id)], self.mesh_id):
                return "stale", payload
        return ftype, payload

    def _refuse(self, sock: socket.socket, peer: str, kind, wanted: str, said) -> None:
        if kind == "stale":
            why = ("its mesh id is not this mesh's: it is a link of an earlier mesh (a rank "
                   "restarted, or one left over from another run); restart every rank of the mesh")
        elif kind == FrameType.JOIN:
            why = (f"this mesh of {self.size} ranks is already formed; a rank that joins late "
                   "must wait for the next mesh (restart every rank)")
        elif kind == FrameType.HELLO:
            why = _hello_refusal(said)
        elif kind is None:
            why = f"it sent nothing this door reads ({said})"
        else:
            name = kind.name if isinstance(kind, FrameType) else str(kind)
            why = f"it sent {name} where the door waited for {wanted}"
        log(f"mesh door {self.host}:{self.port}: refused a connection from {peer}: {why}")
        if kind is not None and kind != "data":
            ControlChannel(sock, 1.0).send_error(f"refused by the mesh rank at {self.host}:{self.port}: {why}")
        try:
            sock.close()
        except OSError:
            pass


def _hello_refusal(payload: bytes) -> str:
    """Why a HELLO first at a door is refused: this version's ranks JOIN a door first, so it is a
    rank of another protocol version (named, with both numbers), or a bare link's hello."""
    version = HELLO_HEAD.unpack_from(payload)[1] if len(payload) >= HELLO_HEAD.size else 0
    if version != PROTOCOL_VERSION:
        return (f"protocol version: the dialing rank speaks {version}, this rank {PROTOCOL_VERSION}; "
                "install the same mlx-ds4tp version on every machine")
    return ("it said a link's hello where a group's rank JOINs first; join with mlx_ds4tp.init(...) "
            "or `ds4tp ... --role worker`")


def _peek(sock: socket.socket, n: int, until: float) -> bytes:
    """The first n bytes without taking them off the socket."""
    while True:
        head = recv_some(sock, n, until, "the dialing rank", socket.MSG_PEEK)
        if len(head) >= n:
            return head[:n]
        time.sleep(0.001)


class LinkDoor:
    """A mesh rank's door for one link (connect()'s door seam): the control connection it
    takes is the one rank `peer` opened."""

    def __init__(self, door: Door, peer: int):
        self.door, self.peer, self.port = door, peer, door.port

    def accept(self, deadline: float, what: str,
               watch: Optional[ControlChannel] = None) -> Tuple[socket.socket, str]:
        joined = self.door.joined.get(self.peer) if watch is None and what == "control" else None
        if joined is None:
            return self.door.accept(deadline, what, watch, self.peer)
        try:
            return self.door.accept(deadline, what, ControlChannel(joined, 1.0), self.peer)
        except PeerClosedError as exc:
            raise PeerClosedError(f"rank {self.peer} closed its JOIN connection before it opened this "
                                  f"link: it is gone ({exc})") from None
