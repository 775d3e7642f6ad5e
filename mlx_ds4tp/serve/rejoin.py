"""`ds4tp serve`'s re-join: the leader's word to its workers when its group breaks (the leader's
state machine, which takes a restarted worker back or shrinks the group, is serve/resize.py),
and the worker that joins its leader again, at its place or at the one a RESIZE names.

Over a group of any size one rank's death breaks the whole group, so every rank forms it
again (gate_ops.reconnect, each keeping its rank and share). The leader says so: before it
closes a broken group it sends each worker REFORM on its control channel (ServingSessions.abort,
tell_reform), and a worker still alive that reads it joins the new group by itself, without
--rejoin, for as long as the leader's door answers (follow_leader). A worker whose own step
failed with the group waits for the leader's word on that channel (leader_reforms): REFORM,
RESIZE (--shrink-after: the group forms at another size; follow_resize), or the channel
closing, an ERROR or STOP (the leader is gone or stopping). So "leader alive" is what the
leader said, never a guess from timing."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional, Tuple

from .. import gate_ops
from ..base.log import log
from ..base.stopping import shielded, stop_reason
from ..errors import AuthenticationError, HelloMismatchError, RegroupedError, TransportError
from ..link.control import dial
from ..link.wire import FrameType
from ..lockstep.errors import MeshReformingError
from ..lockstep.join_and_load import Joined, rejoin
from ..lockstep.protocol.sessions import LeaderSessions, drain_failed_work, leader_channel, worker_channels
from ..lockstep.regroup import Regroup, join_regrouped
from ..split.share import SplitShare
from .settings import ServeSettings

F = FrameType
_DRAIN_BYTES = 1 << 20
# How long a following worker lets its leader's door stay closed before it calls the leader
# gone: the door is closed only while the leader's thread goes from one wait to the next (a
# few Python statements), so this is a bound for a gone leader, not a race with a live one.
DOOR_GRACE_SEC = 10.0


# ============================================================================
# The leader
# ============================================================================


class ServingSessions(LeaderSessions):
    """The serving leader's sessions: a failure tells every worker REFORM, not ERROR (the
    leader lives and takes a restarted worker back: the others join again by themselves), or,
    with --shrink-after, holds their connections for serve/resize.py to say what comes next
    (on_abort)."""

    on_abort: Optional[Callable[[gate_ops.Group, str], None]] = None

    def abort(self, reason: str) -> None:
        if self.on_abort is not None:
            self.on_abort(self.group, reason)
        else:
            tell_reform(self.group, reason)


def tell_reform(group: gate_ops.Group, reason: str) -> None:
    """Close a broken group, each worker told first (REFORM with `reason`, best effort: the dead
    one takes nothing) that the leader forms it again. What the workers sent that nobody read
    (a failed worker's ERROR) is read off first, so the close is an orderly one and the REFORM
    already sent is not cut off by a reset."""
    try:
        controls = worker_channels(group)
    except TransportError:  # closed already: there is nobody left to tell
        controls = []
    text = reason.encode("utf-8", "replace")[:4000]
    for control in controls:
        try:
            control.send(F.REFORM, text)
        except (TransportError, OSError):
            pass  # the worker that died
    for control in controls:
        _drain(control.sock)
    group.close()


def _drain(sock: socket.socket) -> None:
    taken = 0
    try:
        while taken < _DRAIN_BYTES:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
            if not chunk:
                return
            taken += len(chunk)
    except OSError:  # nothing more to read now, or the socket is gone
        return


@dataclasses.dataclass
class Quit:
    """The leader's stop as its rejoin thread sees it: `event` is set when the stop begins, and
    `lock` is held around the thread's native work (closing a pair, resuming the engine); the
    stop takes the lock and keeps it, so none is under way or begins while the interpreter
    exits (a thread inside native code then aborts the process: "terminate called without an
    active exception"). The thread's waits (for a worker to connect) are Python's own."""

    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def begin(self, timeout: float = 30.0) -> None:
        self.event.set()
        self.lock.acquire(timeout=timeout)

    @contextlib.contextmanager
    def native(self) -> Iterator[bool]:
        """The lock held; yields False (do nothing) once the stop has begun."""
        with self.lock:
            yield not self.event.is_set()


def fit_worker_room(engine, sessions, settings: ServeSettings, own_room: Optional[int]) -> None:
    """The KV budget within every worker rank's machine too: different Macs split unevenly hold
    different parts of every cache in different memories, so the budget from memory is the
    smallest of the ranks' (own_room: the leader's; None when --max-kv-tokens gave it, which
    is kept and only warned about when a worker rank holds less)."""
    limits = settings.limits
    room = sessions.worker_kv_room(limits.kv_bits, limits.kv_group_size)
    if room is None:
        log("serve: a worker rank could not read its memory; the KV budget is the leader's (rank 0) alone")
    elif own_room is None:
        if limits.kv_budget > room:
            log(f"serve: --max-kv-tokens {limits.kv_budget} is more than a worker rank's machine holds "
                f"({room} tokens): it may run out of memory under load; give --max-kv-tokens {room} or less")
    else:
        budget = min(own_room, max(room, 1)) if own_room else max(room, 1)
        if budget != engine.admission.kv_budget:
            log(f"serve: KV budget {budget} tokens, the smaller of rank 0's ({own_room or 'unknown'}) "
                f"and the least of ranks 1 .. {sessions.group.size() - 1} ({room})")
            engine.admission.kv_budget = budget


# ============================================================================
# The worker
# ============================================================================


def serve_as_worker(joined: Joined, settings: ServeSettings, grammars: Any,
                    make_disk: Callable[[Any, Any, SplitShare], Any]) -> str:
    """A worker's command loop. A leader that forms the group again (REFORM) is followed: this
    rank joins the new group with its rank and share, with or without --rejoin; one that forms
    it at another size (RESIZE: a rank lost, or back) is followed too, this rank at the rank and
    share it names, its new part loaded (make_disk(model, group, share): its prompt-cache
    directory for that share; the old one's caches are never used across shares).
    With --rejoin the worker also outlives its leader: when the leader stops or dies it waits
    for a leader on the same address and serves it (the same checks as a first join). Without
    it, a leader gone is this process's end: an error naming it, never a hang. Ctrl-C or
    SIGTERM stops it cleanly, the leader told why. Returns how it ended."""
    from ..lockstep.protocol.sessions import serve_worker
    from ..lockstep.protocol.table import release_memory

    group, model, share = joined.group, joined.model, joined.share
    del joined  # this frame holds the part alone: a resize frees it before the next loads
    wait_for_any = settings.rejoin
    where = _leader_at(group, settings)
    disk = make_disk(model, group, share)
    try:
        while True:
            follow, resize = False, b""
            try:
                table = serve_worker(group, model, grammars, disk=disk)  # tells the leader why if it fails
                said = f"the leader said stop after {table.step_count} decode steps"
                if not wait_for_any:
                    return f"rank {group.rank()} stopped: {said}"
                log(f"serve: {said}")
            except MeshReformingError as exc:
                follow, resize = True, exc.resize
                log(f"serve: the leader (rank 0) forms the group again ({exc}); rank {group.rank()} joins it")
            except Exception as exc:  # noqa: BLE001 - the group failed; report it or rejoin
                word = leader_reforms(group)
                follow, resize = word is not None, word or b""
                if follow:
                    log(f"serve: the group broke ({type(exc).__name__}: {exc}); the leader (rank 0) "
                        f"forms it again and rank {group.rank()} joins it")
                elif not wait_for_any:
                    raise TransportError(f"the leader (rank 0) {where} is gone: {exc}; rank {group.rank()} "
                                         "stops (run it with --rejoin to wait for a leader instead)") from None
                else:
                    log(f"serve: the group is down: {type(exc).__name__}: {exc}")
            table = None
            group.close()
            drain_failed_work()
            release_memory()  # the failed group's table, its caches and its failed steps
            if resize:
                model = None
                group, model, share = follow_resize(group, Regroup.unpack(resize), settings)
                disk = make_disk(model, group, share)
                log(f"serve: rank {group.rank()} of {group.size()} now, split {share}; serving")
                continue
            if follow and not wait_for_any:
                follow_leader(group, settings, share)
            else:
                log(f"serve: waiting for a leader {where} (--rejoin) ...")
                _rejoin_leader(group, settings, share)
            log(f"serve: joined a leader again (transport {group.transport})")
    except KeyboardInterrupt:
        with shielded():
            told = _tell_leader(group, drain_failed_work)
        return f"rank {group.rank()} stopped by {stop_reason()}{told}"


def follow_resize(group: gate_ops.Group, regroup: Regroup, settings: ServeSettings) -> Tuple[Any, Any, SplitShare]:
    """A worker told RESIZE: (group, model, share) of the leader's new group, this rank at the
    rank it names, its new part loaded; tried again while the leader's door answers (as
    follow_leader does), an error naming the leader once it does not. A door that answers
    RESIZE (the group it named did not form: the leader falls back to the ranks it had) is
    followed to that group."""
    made_with = gate_ops.joined_with(group)
    address = gate_ops.rejoin_address(group)
    log(f"serve: the leader forms a group of {regroup.size}: rank {group.rank()} joins it as rank "
        f"{regroup.rank} (split {regroup.share}) and loads its new part")
    while True:
        try:
            joined = join_regrouped(made_with, regroup, settings.model.path, settings.parts)
            return joined.group, joined.model, joined.share
        except RegroupedError as exc:
            was, regroup = regroup, Regroup.unpack(exc.resize)
            log(f"serve: the leader's group of {was.size} did not form: it forms a group of {regroup.size} "
                f"again, rank {group.rank()} joins it as rank {regroup.rank} (split {regroup.share})")
        except (HelloMismatchError, AuthenticationError):
            raise
        except TransportError as exc:
            if not _door_open(address, group):
                raise TransportError(f"the leader (rank 0) is gone while the group changed size: {exc}") from None
            time.sleep(0.2)


def _leader_at(group: gate_ops.Group, settings: ServeSettings) -> str:
    address = gate_ops.rejoin_address(group) or settings.link.address.coordinator
    return f"at {address[0]}:{address[1]}" if address else "(discovery)"


def leader_reforms(group: gate_ops.Group) -> Optional[bytes]:
    """After this worker's own step failed with the group: whether the leader forms the group
    again (b"": its REFORM comes; RESIZE's payload: at another size, serve/resize.py), or is
    gone or stopping (None: its channel closes, or ERROR or STOP comes, or nothing within the
    timeout, DS4_TP_TIMEOUT_SEC). Commands the leader sent before it knew are passed over."""
    try:
        control = leader_channel(group)
    except TransportError:
        return None
    deadline = time.monotonic() + control.timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            ftype, payload = control.recv(timeout=left)
        except (TransportError, OSError, ValueError):
            return None
        if ftype == F.REFORM:
            return b""
        if ftype == F.RESIZE:
            return payload
        if ftype == F.STOP:
            return None


def follow_leader(group: gate_ops.Group, settings: ServeSettings, share: SplitShare) -> None:
    """A worker without --rejoin told REFORM: join the leader's new group, with this rank and
    share, for as long as the leader waits for the restarted rank. The leader's door closes
    only between two of its waits (each DS4_TP_TIMEOUT_SEC long), and opens again at once, so
    before each try after the first this worker looks at the door for up to DOOR_GRACE_SEC:
    open, it tries again; closed all that while, the leader is gone (killed or stopped during
    the wait) and this worker stops with an error naming it."""
    address = gate_ops.rejoin_address(group)
    where = f"{address[0]}:{address[1]}" if address else "(unknown)"
    last: Optional[Exception] = None
    while True:
        if last is not None and not _door_open(address, group):
            raise TransportError(
                f"the leader (rank 0) at {where} is gone: its door no longer answers (the last try: "
                f"{last}); rank {group.rank()} stops (run it with --rejoin to wait for a leader "
                "instead)") from None
        try:
            rejoin(group, settings.split, share, settings.model.path)
            return
        except (HelloMismatchError, AuthenticationError):
            raise  # another model, secret or share: waiting would not change it
        except TransportError as exc:
            group.close()  # joined but the share never came: the next try joins afresh
            last = exc
            time.sleep(0.2)  # the leader closed its wait (it waits again at once) or refused this try


def _door_open(address: Optional[Tuple[str, int]], group: gate_ops.Group) -> bool:
    """Whether the leader's door takes a connection within DOOR_GRACE_SEC (or the connect
    timeout, if shorter). The connection is closed at once; the door drops it."""
    if address is None:
        return False
    grace = min(DOOR_GRACE_SEC, gate_ops.rejoin_timeout(group))
    try:
        sock = dial(address[0], address[1], time.monotonic() + grace, "the leader's door")
    except TransportError:
        return False
    sock.close()
    return True


def _rejoin_leader(group: gate_ops.Group, settings: ServeSettings, share: SplitShare) -> None:
    """Join a leader again on the same address, however long that takes."""
    while True:
        try:
            rejoin(group, settings.split, share, settings.model.path)
            return
        except (HelloMismatchError, AuthenticationError):
            raise  # another model, secret or share: waiting would not change it
        except TransportError:
            group.close()  # joined but the share never came: the next try joins afresh
            time.sleep(0.5)  # no leader yet (or one that went away during the join)


def _tell_leader(group: gate_ops.Group, drain) -> str:
    """A stopped worker's goodbye: the leader told why (an ERROR frame, which its failing step or
    idle check reports), the group closed (a step in flight fails at once) and its queued work
    drained, so no MLX work is left running as the process exits."""
    try:
        control = leader_channel(group)
    except TransportError:
        return " (no leader was joined)"
    control.send_error(f"rank {group.rank()} was stopped by {stop_reason()}; start it again and it rejoins")
    group.close()
    drain()
    return "; the leader was told"


__all__ = ["Quit", "ServingSessions", "fit_worker_room", "follow_leader", "follow_resize", "leader_reforms",
           "serve_as_worker", "tell_reform"]
