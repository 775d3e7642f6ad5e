"""A rank at a serving leader's door while its group is short of one (serve/resize.py): the
knock. Its connection is taken and held, its JOIN never answered, so the rank waits there (a
rank started again during a shrink too: the new group's door holds its JOIN, Door.held, and it
is handed on here); when the group grows the knock is let go and the rank dials the new door
at once (link/mesh.py's REDIAL_SEC). A leader alone keeps a door of its own for it, opened
before it loads the whole model, so a rank started meanwhile waits in its backlog."""

from __future__ import annotations

import select
import socket
from typing import Optional, Tuple

from ..link.control import listen_socket
from .held_links import DoorWatch


class DoorKnock:
    """The rank held at the door (one at a time), and the lone leader's door (`listen`: the
    leader's address, the group's door at every size)."""

    def __init__(self, listen: Optional[Tuple[str, int]]):
        self.listen = listen
        self._knock: Optional[socket.socket] = None
        self._door: Optional[socket.socket] = None

    def knocked(self, group) -> bool:
        """Whether a rank dialed the door of `group` (its mesh's; the lone leader's own when
        it is none): its connection taken and held until let_go()."""
        if self._knock is None:
            door = group.mesh.door.sock if group.size() > 1 else self.alone_door()
            if not DoorWatch.pending(door):
                return False
            try:
                self._knock, _ = door.accept()
            except OSError:
                return False
        return True

    def take_held(self, group) -> None:
        """The JOINs `group`'s door held while it formed (ranks started again during a shrink
        or a grow): the first is the knock (none held yet), the others let go (they dial
        again and wait in the door's backlog)."""
        if group.size() < 2:
            return
        held, group.mesh.door.held = group.mesh.door.held, []
        for sock in held:
            if self._knock is None:
                self._knock = sock
            else:
                sock.close()

    def alive(self) -> bool:
        """False (and the knock forgotten) once the rank at the door has gone again."""
        sock = self._knock
        try:
            while sock is not None and select.select([sock], [], [], 0)[0]:
                if not sock.recv(65536, socket.MSG_DONTWAIT):
                    raise OSError("closed")
        except OSError:
            self.let_go()
        return self._knock is not None

    def let_go(self) -> None:
        """The held rank let go: it dials the door again (the next group's)."""
        if self._knock is not None:
            self._knock.close()
            self._knock = None

    def alone_door(self) -> socket.socket:
        """The lone leader's door, opened once (its backlog holds a rank dialing it)."""
        if self._door is None:
            self._door = listen_socket(self.listen[0], self.listen[1])
            self._door.listen(8)
        return self._door

    def close_alone_door(self) -> None:
        """Before a group forms at the leader's address (its door takes the port)."""
        if self._door is not None:
            self._door.close()
            self._door = None

    def close(self) -> None:
        self.let_go()
        self.close_alone_door()


__all__ = ["DoorKnock"]
