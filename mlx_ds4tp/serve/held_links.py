"""What a serving leader watches of its workers while its group changes size (serve/resize.py):
their control connections held across a closed group (a survivor waits there for the leader's
word; a lost rank's connection has closed), the word told them, and a knock at the leader's
door (a restarted rank dialing it) while no group listens there, and, for a group discovery
found, the advert that tells a restarted rank where that door is (Beacon)."""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..errors import FrameError, PeerClosedError, TransportError
from ..link.config import LinkSettings
from ..link.control import ControlChannel, listen_socket
from ..link.findgroup import Reopened
from ..link.hello import ModelIdentity
from ..link.wire import JOIN_PAYLOAD, FrameType
from ..lockstep.protocol.sessions import drain_failed_work


class DoorWatch:
    """A knock at the leader's door while the group is closed: a listener at its address whose
    pending connection is never accepted (closed, the dialer's JOIN is reset, and it dials the
    new door again: link/mesh.py's REDIAL_SEC)."""

    def __init__(self, listen):
        self.sock = listen_socket(listen[0], listen[1])
        self.sock.listen(8)
        self._knocked = False

    @staticmethod
    def pending(sock: socket.socket) -> bool:
        try:
            return bool(select.select([sock], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def knocked(self) -> bool:
        self._knocked = self._knocked or self.pending(self.sock)
        return self._knocked

    def close(self) -> None:
        self.sock.close()


class Beacon:
    """The leader's door advertised again (link.findgroup.Reopened) while its group found by
    discovery is short of a rank: waiting for the lost one, or serving without it. A rank
    started again with its same discovery command finds it (a group of N's lobby sends it to
    the door; a pair's worker joins the door advertised), `door` being the mesh's address, the
    same for every size, and knocks there. Nothing for a group formed by addresses (found_by
    None): its workers know the door."""

    def __init__(self, found_by: Optional[LinkSettings], identity: Optional[ModelIdentity],
                 door: Optional[Tuple[str, int]]):
        self.found_by, self.identity, self.door = found_by, identity or ModelIdentity(), door
        self._lobby: Optional[Reopened] = None

    def open(self) -> None:
        if self.found_by is not None and self.door is not None and self._lobby is None:
            self._lobby = Reopened(self.found_by, self.identity, self.door)

    def close(self) -> None:
        """The lobby closed while the group forms (a rank sent to the door then would JOIN a
        group of the wrong size) or once it is whole."""
        if self._lobby is not None:
            self._lobby.close()
            self._lobby = None


def answer_joins(listen: Tuple[str, int], word: Callable[[int], Optional[bytes]], waited: Set[int],
                 until: float, stop: Callable[[], bool]) -> Set[int]:
    """A group that did not form: each JOIN at the door (`listen`) answered RESIZE with
    word(the rank it asks for) (None: not one of ours, closed unanswered), until every rank of
    `waited` was told, `until`, or stop(); the ranks told. Each told rank follows the RESIZE to
    the group it names (link/mesh.py: RegroupedError; serve/rejoin.py:follow_resize)."""
    door = listen_socket(listen[0], listen[1])
    door.listen(8)
    told: Set[int] = set()
    try:
        while waited - told and time.monotonic() < until and not stop():
            if not select.select([door], [], [], 0.1)[0]:
                continue
            sock, _ = door.accept()
            channel = ControlChannel(sock, 5.0)
            try:
                ftype, payload = channel.recv(timeout=5.0)
                asked = JOIN_PAYLOAD.unpack_from(payload)[2] if ftype == FrameType.JOIN else None
                said = word(asked) if asked is not None else None
                if said is not None:
                    channel.send(FrameType.RESIZE, said)
                    told.add(asked)
            except (TransportError, FrameError, OSError, struct.error):
                pass  # a dialer gone, or not a JOIN: it is not told
            drain_close(sock)
    finally:
        door.close()
    return told


def closed_ranks(held: Dict[int, ControlChannel]) -> List[int]:
    """The held ranks whose connection has closed (what they sent read past: a survivor's
    ERROR naming its failed step is no loss)."""
    lost = []
    for rank, control in held.items():
        try:
            while select.select([control.sock], [], [], 0)[0]:
                try:
                    control.recv(timeout=1.0)
                except PeerClosedError:
                    raise
                except TransportError:
                    continue  # its ERROR, or a frame cut short: it is there
        except (PeerClosedError, OSError, ValueError):
            lost.append(rank)
    return lost


def tell_held(held: Dict[int, ControlChannel], word: Callable[[int], Any]) -> None:
    """Each held worker its word ((frame type, payload), None: nothing), then the connections
    closed in order (their unread frames read off first, so the word is not cut off by a reset)."""
    for rank, control in held.items():
        said = word(rank)
        if said is None:
            continue
        try:
            control.send(*said)
        except (TransportError, OSError):
            pass
    for control in held.values():
        drain_close(control.sock)


def close_group(group, held: Dict[int, ControlChannel]) -> None:
    """A group closed after its workers were told (held: their control channels, in it): what
    they sent read off first, so what was told is not cut off by a reset."""
    for control in held.values():
        drain_close(control.sock, close=False)
    group.close()
    drain_failed_work()


def drain_close(sock: socket.socket, close: bool = True) -> None:
    """Read what the peer sent and nobody read (a reset would cut off what this side sent
    last), then close `sock` unless told not to."""
    try:
        while select.select([sock], [], [], 0)[0]:
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                break
    except OSError:
        pass
    if close:
        sock.close()


__all__ = ["Beacon", "DoorWatch", "answer_joins", "close_group", "closed_ranks", "drain_close", "tell_held"]
