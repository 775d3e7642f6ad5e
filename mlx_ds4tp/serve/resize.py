"""`ds4tp serve --shrink-after SEC`, the leader's side: a lost Mac does not take the service down.

The state machine (one daemon thread on the leader, GroupResizer.run):

  serving --(a rank's loss: the engine down)--> waiting
  waiting --(the lost rank's `ds4tp serve` at the door, or no rank found lost)--> re-form at the
            same size (serve/rejoin.py's REFORM path, nothing reloaded) --> serving
  waiting --(SEC passed, the ranks left hold the model)--> shrinking --> serving at N-1
  waiting --(SEC passed, the ranks left cannot hold it)--> waiting, refused: 503 naming the
            memory needed and had, until the lost rank is back
  serving below N --(a rank at the door)--> growing (no new request admitted; the ones under
            way finish, none cut; the queue waits) --> serving at N again, each rank in its
            started place and share
  growing --(the grown group never forms: the returning rank gone again, seen at once: its
            knock closed, its JOIN connection closed before its link, or no JOIN at the new
            door within GROW_JOIN_SEC of being let go at the old one)--> the members at the
            door told RESIZE to the group they had --> serving below N, the queue served

A rank started again while the group shrinks (or grows) asks for no rank, where every member
was told its own: the forming group's door holds its JOIN unanswered (link.config.Regrouping),
so it never takes a member's place, and the group grows with it once it serves
(serve/door_knock.py).

A group of 3 or more that discovery found keeps its door's address at every size; its lobby is
open while a rank is missing (held_links.Beacon), so the lost rank's own command finds it again.

The loss: the engine's failure closes the group (ServingSessions.abort); with shrinking on,
each worker's control connection is held first (its socket duplicated, so closing the group
leaves it open): the survivors wait on it for the leader's word (serve/rejoin.py:leader_reforms)
and a lost rank is the one whose connection closed (a process killed, a Mac gone: its socket
ends). The word is REFORM (join again at the same size) or RESIZE (lockstep/regroup.py: the new
size, the survivor's rank in it, the share). Every resize reloads every rank's part: the model is
split over the group it was loaded for. The prompt caches (memory and disk) go with the old
share: the new group starts with empty tables and a disk cache keyed by its own share."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .. import gate_ops
from ..base.log import log
from ..errors import PeerClosedError, TransportError, TransportTimeoutError
from ..link.config import Regrouping, default_timeout
from ..link.control import ControlChannel
from ..link.hello import RankFigures
from ..link.mesh import REDIAL_SEC
from ..link.wire import FrameType
from ..lockstep.join_and_load import Joined, rejoin
from ..lockstep.one_rank import OneRank
from ..lockstep.protocol.sessions import worker_channels
from ..lockstep.protocol.table import release_memory
from ..lockstep.regroup import Regroup, lead_regrouped, memory_refusal, share_of
from ..split.agree import model_parts
from ..split.auto import ModelNeed, choose_share_among, model_need
from ..split.errors import ShareRefusedError
from ..split.measure import usable_memory
from ..split.share import SplitShare
from .door_knock import DoorKnock
from .held_links import Beacon, DoorWatch, answer_joins, close_group, closed_ranks, tell_held
from .rejoin import Quit, ServingSessions, fit_worker_room, tell_reform
from .settings import ServeSettings

F = FrameType
POLL_SEC = 0.1
# How long a grow's door waits for the rank back after letting it go at the old door: it dials
# again within REDIAL_SEC (its side's own bound for a door gone), and a loaded Mac a little more.
GROW_JOIN_SEC = REDIAL_SEC + 2.0


@dataclasses.dataclass
class ResizeStatus:
    """What /health and /metrics say of the group: its size now and at start, the state
    (serving, shrinking, growing, waiting), the resizes so far and why a shrink was refused."""

    started_size: int
    size: int
    state: str = "serving"
    shrinks: int = 0
    grows: int = 0
    refused: Optional[str] = None

    def health(self) -> Dict[str, Any]:
        body = {"size": self.size, "started_size": self.started_size, "state": self.state,
                "shrinks": self.shrinks, "grows": self.grows}
        return {**body, "shrink_refused": self.refused} if self.refused else body


@dataclasses.dataclass
class Hooks:
    """What a resize rebuilds beside the engine, made by serve/serving_rank.py: the leader's
    disk cache for a model and share (or None), its KV room for a model (None: --max-kv-tokens
    decides), and the cluster page's view told the new group."""

    make_disk: Callable[[Any, Any, SplitShare], Any]
    own_room: Callable[[Any], Optional[int]]
    regrouped: Callable[[Any, SplitShare], None]


class GroupResizer:
    """The leader's state machine (module docstring). A daemon thread, ended by Quit."""

    def __init__(self, engine, joined: Joined, settings: ServeSettings, hooks: Hooks, quit_: Quit):
        self.engine, self.settings, self.hooks, self.quit = engine, settings, hooks, quit_
        self.group, self.model, self.share = joined.group, joined.model, joined.share
        self.started_share = joined.share
        self.link_identity = gate_ops.joined_with(joined.group)
        size = joined.group.size()
        self.members: List[int] = list(range(size))  # each rank's place in the started group
        self.status = ResizeStatus(size, size)
        self.need: ModelNeed = model_need(settings.model.path, _kv_tokens(settings))
        self.figures: Dict[int, RankFigures] = {0: self._own_figures()}
        self._note_figures()
        self.held: Dict[int, ControlChannel] = {}  # rank now -> its control connection, kept
        self.lost_at = 0.0
        self._lock = threading.Lock()
        # A group discovery found: its lobby open while a rank is missing, so the lost one's
        # `ds4tp serve` started again finds the door (serve/held_links.py:Beacon).
        self.beacon = Beacon(gate_ops.discovered_with(joined.group), self.link_identity[1], self._listen())
        self.knock = DoorKnock(self._listen())

    # -- the engine thread: the group broke ------------------------------------------------
    def hold(self, group, reason: str) -> None:
        """ServingSessions.abort with shrinking on: every worker's control connection kept
        (duplicated) before the group closes, so the survivors wait for this leader's word."""
        held = {}
        try:
            channels = worker_channels(group)
        except TransportError:
            channels = []
        for rank, control in enumerate(channels, 1):
            try:
                held[rank] = ControlChannel(control.sock.dup(), control.timeout)
            except OSError:
                pass
        with self._lock:
            self.held, self.lost_at = held, time.monotonic()
        group.close()

    # -- the thread ------------------------------------------------------------------------
    def run(self) -> None:
        while not self.quit.event.is_set():
            if self.engine.wait_down(0.5):
                self._after_loss()
            elif self.status.size < self.status.started_size and self.knock.knocked(self.group):
                self._grow()

    def _after_loss(self) -> None:
        self.status.state = "waiting"
        with self._lock:
            held = dict(self.held)
        if not held and self.status.size == 1:  # the leader alone failed in itself: start afresh
            self._resume(Joined(self.group, self.model, None, self.share))
            return
        if self.settings.shrink_after <= 0 or not held:
            self._reform_same("the group forms again")
            return
        # A knock taken before the loss (a grow under way) is one at this wait's door too.
        back = self.knock.alive()
        self.knock.let_go()  # its rank dials the next door
        watch = DoorWatch(self._listen())
        self.beacon.open()
        lost: List[int] = []
        try:
            deadline = self.lost_at + self.settings.shrink_after
            log(f"serve: HTTP answers 503; a rank of the group of {self.status.size} is lost: waiting up to "
                f"{self.settings.shrink_after:g} s for it (start its `ds4tp serve` again), then the ranks left "
                "serve on without it")
            while not self.quit.event.is_set() and not back and not watch.knocked():
                lost = closed_ranks(held)
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_SEC)
            # Looked at once more as the wait ends: a rank that dialed since comes back here
            # (closing the watch would reset its JOIN, and the next door may open late).
            back = back or watch.knocked()
        finally:
            watch.close()
            self.beacon.close()
        if self.quit.event.is_set():
            return
        if back or not lost:
            self._reform_same("a rank is back" if back else "no rank was lost")
            return
        self._shrink(lost)

    # -- the same size again (nothing reloaded) --------------------------------------------
    def _tell(self, word: Callable[[int], Any]) -> None:
        """The held workers told `word` (held_links.tell_held), then let go."""
        with self._lock:
            held, self.held = self.held, {}
        tell_held(held, word)

    def _reform_same(self, why: str) -> None:
        """The group formed again at its size, each rank at its place, nothing reloaded (every
        worker alive told REFORM joins by itself; a restarted one takes the place left free)."""
        self._tell(lambda rank: (F.REFORM, why.encode()))
        listen = self._listen()
        where = f"on {listen[0]}:{listen[1]}" if listen else "(discovery)"
        log(f"serve: HTTP answers 503 until the group of {self.group.size()} forms again {where} (start "
            "the stopped rank's `ds4tp serve --role worker` again, with the same --model and secret; "
            "any rank still alive was told the group forms again and joins it by itself)")
        if gate_ops.discovered_with(self.group) is None:
            self.beacon.open()  # a group the resizer formed: its own lobby (else reconnect's)
        while not self.quit.event.is_set():
            try:
                rejoin(self.group, self.settings.split, self.share, self.settings.model.path)
                break
            except TransportTimeoutError:
                continue  # nobody came within the connect timeout: keep listening
            except Exception as exc:  # noqa: BLE001 - a wrong or broken worker; wait for the right one
                log(f"serve: a rank could not rejoin: {type(exc).__name__}: {exc}")
                with self.quit.native() as go:
                    if go:
                        tell_reform(self.group, f"a rank could not rejoin: {exc}")
                time.sleep(0.5)
        self.beacon.close()
        if self.quit.event.is_set():
            return
        self._note_figures()
        if not self._resume(Joined(self.group, self.model, None, self.share)):
            return
        self.status.refused = None
        log(f"serve: the group of {self.group.size()} formed again (transport {self.group.transport}); serving again")

    # -- shrink ----------------------------------------------------------------------------
    def _shrink(self, lost: List[int]) -> None:
        members = [m for rank, m in enumerate(self.members) if rank not in lost]
        share, refusal = self._plan(members)
        if refusal is not None:
            self.status.refused = refusal
            log(f"serve: no shrink: {refusal}; HTTP answers 503 until the lost rank is back")
            self._reform_same("the ranks left cannot hold the model")
            return
        self.status.state = "shrinking"
        began = time.monotonic()
        was = self.status.size
        log(f"serve: rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost for "
            f"{began - self.lost_at:.1f} s: the group shrinks from {was} to {len(members)} (split {share})")

        def close_old() -> None:
            self._tell(lambda rank: None if rank in lost else (
                F.RESIZE, Regroup(len(members), members.index(self.members[rank]), share).pack()))

        # Its door holds a rank started again meanwhile (it asks no rank; every member was told
        # its own): the group grows with it once it serves (DoorKnock.take_held).
        if self._regroup(members, share, close_old, Regrouping()):
            self.status.shrinks += 1
            log(f"serve: shrank from {was} to {len(members)} ranks in {time.monotonic() - began:.1f} s "
                f"({time.monotonic() - self.lost_at:.1f} s since the loss); serving again")

    def _plan(self, members: List[int]):
        """(the share of `members`, why their memory cannot hold the model or None)."""
        figures = [self.figures.get(m, RankFigures()) for m in members]
        if self.settings.split.share.auto and all(f.measured for f in figures) and len(members) > 1:
            try:
                share = choose_share_among(figures, self.need, **model_parts(self.need, len(members)))
            except ShareRefusedError as exc:
                return SplitShare(), str(exc)
        else:
            share = share_of(self.started_share, self.status.started_size, members)
        return share, memory_refusal(self.need, figures, share)

    # -- grow ------------------------------------------------------------------------------
    def _grow(self) -> None:
        self.status.state = "growing"
        self.beacon.close()
        began = time.monotonic()
        self.engine.pause()
        while not self.engine.paused(0.5):
            if self.quit.event.is_set() or self.engine.wait_down(0):
                return  # the loss path takes it from here
        if not self.knock.alive():
            log(f"serve: the rank at the door left before the group grew; serving on with {self.status.size}")
            self.engine.unpause()
            self.status.state = "serving"
            self._beacon_for_size()
            return
        regained = min(set(range(self.status.started_size)) - set(self.members))
        members = sorted(self.members + [regained])
        share = share_of(self.started_share, self.status.started_size, members)
        if len(members) == self.status.started_size:
            share = self.started_share
        was = self.status.size
        log(f"serve: a rank is back at the door: the group grows from {was} to {len(members)} "
            f"(rank {regained} in its place, split {share}); requests wait meanwhile")

        def close_old() -> Optional[str]:
            """The members told, the old group (or the lone leader's door) closed: the knock
            at it is reset and dials the new door (link/mesh.py's REDIAL_SEC), opened next;
            why the group cannot form when that knock had closed already (its rank gone)."""
            if was > 1:
                held = dict(enumerate(worker_channels(self.group), 1))
                for rank, control in held.items():
                    try:
                        control.send(F.RESIZE, Regroup(len(members), members.index(self.members[rank]),
                                                       share).pack())
                    except (TransportError, OSError):
                        pass
                close_group(self.group, held)
            else:
                self.knock.close_alone_door()
            gone = not self.knock.alive()
            self.knock.let_go()
            return "the rank back closed its connection at the door: it is gone" if gone else None

        # The rank back, let go at the old door, dials the new one at once: not there within
        # GROW_JOIN_SEC, it is gone again and the group it had forms again at once.
        grown = Regrouping(unasked=1, unasked_within=GROW_JOIN_SEC)
        if not self._regroup(members, share, close_old, grown, fallback=(list(self.members), self.share)):
            return
        if self.status.size == len(members):
            self.status.grows += 1
            log(f"serve: grew from {was} to {len(members)} ranks in {time.monotonic() - began:.1f} s; serving again")
        else:
            log(f"serve: the group of {len(members)} did not form; serving on with the {self.status.size} "
                f"rank{'s' if self.status.size > 1 else ''} it had ({time.monotonic() - began:.1f} s)")

    # -- both: the new group, its part, the engine over it ---------------------------------
    def _regroup(self, members: List[int], share: SplitShare, close_old: Callable[[], Optional[str]],
                 regrouping: Regrouping, fallback: Optional[Tuple[List[int], SplitShare]] = None) -> bool:
        """Form the group of `members` (each told RESIZE by close_old, the old group's last
        act, after this rank's old part is freed; its door holds other ranks as `regrouping`
        says), load this rank's part, serve. A grow gives `fallback`, the members and share it
        had: when its group does not form (the returning rank gone again: close_old says so
        when its knock closed, or it never JOINs), the group it had forms again and its queue
        is served, not failed."""
        self._drop_model()
        doomed = close_old()
        while not self.quit.event.is_set():
            if len(members) == 1:
                self.knock.alone_door()  # open while the whole model loads: a rank started waits there
            try:
                if doomed is not None:
                    raise PeerClosedError(doomed)
                joined = lead_regrouped(self.link_identity, share, len(members), self.settings.model.path,
                                        self.settings.parts, self.need, regrouping)
                break
            except Exception as exc:  # noqa: BLE001 - a member failed to come; HTTP stays 503
                why = f"the group of {len(members)} did not form: {type(exc).__name__}: {exc}"
                if fallback is not None:
                    log(f"serve: {why}; the group of {len(fallback[0])} it had forms again")
                    self._fall_back(members, *fallback)
                    (members, share), fallback, regrouping, doomed = fallback, None, Regrouping(), None
                    continue
                log(f"serve: {why}; trying again")
                self.engine.give_up(why)  # a grow's queue fails: nobody waits on a group that may never form
                time.sleep(0.5)
        else:
            return False
        self.group, self.model, self.share, self.members = joined.group, joined.model, joined.share, members
        self.status.size = len(members)
        self.knock.take_held(joined.group)
        if self.status.size == self.status.started_size:
            self.knock.let_go()  # whole: a second start of a rank back has no place to take
        self._note_figures()
        if not self._resume(joined):
            return False
        self.status.refused = None
        self._beacon_for_size()
        return True

    def _beacon_for_size(self) -> None:
        """The lobby open while the group serves short of a rank, closed once it is whole."""
        if self.status.size < self.status.started_size:
            self.beacon.open()
        else:
            self.beacon.close()

    def _fall_back(self, grown: List[int], kept: List[int], share: SplitShare) -> None:
        """The members told the grown group (`grown`) that did not form, dialing its door,
        told RESIZE there to the group they had (`kept`, `share`), within the connect timeout."""
        waited = {grown.index(m) for m in kept[1:]}

        def word(asked: int) -> Optional[bytes]:
            if asked not in waited:
                return None  # the returning rank, or a stranger: not of the group that forms
            return Regroup(len(kept), kept.index(grown[asked]), share).pack()

        until = time.monotonic() + float(self.link_identity[0].timeout or default_timeout())
        told = answer_joins(self._listen(), word, waited, until, self.quit.event.is_set)
        if waited - told:
            log(f"serve: rank(s) {', '.join(map(str, sorted(waited - told)))} of the grown group never "
                "came to be told it did not form")

    def _drop_model(self) -> None:
        """The old part freed before the new one loads (their sum may not fit), and its prompt
        caches with it (never used across shares; its disk cache is closed when the next one
        is made, serving_rank.DiskCaches)."""
        self.model = None
        self.engine.drop_sessions()
        release_memory()

    def _resume(self, joined: Joined) -> bool:
        """The engine serving over `joined`'s group once every rank is ready; False when one
        failed first (the loss path takes it from there: the engine stays down, the workers
        held)."""
        group, model = joined.group, joined.model
        grammars = self.engine.sessions.grammars
        disk = self.hooks.make_disk(model, group, joined.share)
        sessions = (ServingSessions(group, model, grammars, disk) if group.size() > 1
                    else OneRank(model, grammars, disk))
        if group.size() > 1 and self.settings.shrink_after > 0:
            sessions.on_abort = self.hold
        try:
            sessions.wait_ready()
            room = self.hooks.own_room(model)
            if room is not None:
                self.engine.admission.kv_budget = room
            if group.size() > 1:
                fit_worker_room(self.engine, sessions, self.settings, room)
        except Exception as exc:  # noqa: BLE001 - a rank failed loading: the loss path again
            why = f"the group formed but a rank failed before serving: {exc}"
            log(f"serve: {why}")
            self.engine.give_up(why)  # a grow's queue fails; a shrink's engine is down already
            sessions.abort(why)  # the workers held (or told REFORM), the group closed
            return False
        self.hooks.regrouped(group, joined.share)
        with self.quit.native() as go:
            if go:
                self.engine.resume(sessions)
                self.status.state = "serving"
        return True

    def count_in(self, registry) -> None:
        """/metrics: the group's size now and at start, and the shrinks and grows so far."""
        from prometheus_client import Gauge

        status = self.status
        for name, what, read in (
                ("group_size", "Ranks serving now (the group shrinks when a Mac is lost)", lambda: status.size),
                ("group_started_size", "Ranks the group was started with", lambda: status.started_size),
                ("group_shrinks", "Times the group shrank to the ranks left (--shrink-after)", lambda: status.shrinks),
                ("group_grows", "Times the group grew back as a lost rank returned", lambda: status.grows)):
            Gauge(f"ds4tp_{name}", what, registry=registry).set_function(read)

    def close(self) -> None:
        """At the leader's stop (the workers told STOP): the group in use now closed, and the
        door of a leader alone; workers still waiting for its word told STOP."""
        self._tell(lambda rank: (F.STOP, b""))
        self.beacon.close()
        self.knock.close()
        self.group.close()

    # -- figures ---------------------------------------------------------------------------
    def _own_figures(self) -> RankFigures:
        """The leader's memory for the shrink's check: what it may use now plus what its part
        holds (freed before a new part loads), capped as --split auto's is
        (DS4_TP_MEMORY_LIMIT_BYTES, also the test hook that lowers it)."""
        mine = self.link_identity[0].figures
        if mine is not None and mine.memory_bytes:
            return mine
        memory = usable_memory() + int(mx.get_active_memory())
        limit = self.settings.split.memory_limit
        return RankFigures(memory_bytes=min(memory, limit) if limit else memory)

    def _note_figures(self) -> None:
        for rank in range(1, self.group.size()):
            figures = self.group.link_to(rank).peer_hello.figures
            if figures is not None:
                self.figures[self.members[rank]] = figures

    def _listen(self):
        return self.link_identity[0].address.listen


def _kv_tokens(settings: ServeSettings) -> int:
    limits = settings.limits
    return limits.kv_budget or limits.prefill_step + settings.http.default_max_tokens


__all__ = ["GroupResizer", "Hooks", "ResizeStatus"]
