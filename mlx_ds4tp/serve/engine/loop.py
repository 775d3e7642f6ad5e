"""The leader's engine for `ds4tp serve`: continuous batching over the pair.

One thread owns the model and the control channel. Its narrow, thread-safe face to the HTTP
event loop: `submit` a request (its Ticket back), `cancel` it by the ticket's id, and its
events (a queue per request the loop awaits, serve/engine/events.py). Submissions and cancels
travel in one inbox, so the engine thread alone writes what it holds. Each turn of its loop:
  1. takes what the inbox holds (requests to queue, cancels to mark);
  2. plans the turn (serve.engine.schedule.plan_turn: one frozen TurnPlan);
  3. carries the plan out: drops, ends, refusals and admissions (serve.engine.admission), a
     read-ahead of the last pipelined step, a prefill forward (serve.engine.prefill), the
     decode step (the leader's batch, lockstep/batch.py);
  4. routes what each read or step produced into the rows' answers, ending the finished rows
     on both ranks and storing their caches for reuse (serve.engine.finishing).
When the pair goes down, every request fails with it; `resume` serves again over a pair
joined anew (serve.serving_rank takes a restarted worker back).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
from typing import Callable, Dict, List, Optional, Set, Union

import mlx.core as mx

from ...base.log import log
from ...errors import TransportError
from ...lockstep.batch import Batch, BatchSettings, Row, StepOutput
from ...lockstep.protocol.sessions import LeaderSessions, drain_failed_work
from ...lockstep.protocol.table import release_memory
from ...lockstep.request import GenerationRequest
from ...lockstep.speculative import Speculation
from ..errors import PairUnavailableError
from ..limits import ServeLimits
from .admission import Admission
from .events import PairDownEvent
from .finishing import Finishing
from .generation import Ticket
from .mixing import MixChoice
from .prefill import PrefillForward
from .schedule import Queued, ScheduleLimits, TurnPlan, TurnState, plan_turn

IDLE_POLL_SEC = 0.25


@dataclasses.dataclass(frozen=True)
class _Cancel:
    """A cancel on its way to the engine thread (Engine.cancel)."""

    ticket_id: int


class Engine:
    """See the module docstring. `start()` runs the loop in a daemon thread."""

    def __init__(self, sessions: LeaderSessions, tokenizer, limits: ServeLimits,
                 speculation: Optional[Speculation] = None):
        self.sessions = sessions
        self.tokenizer = tokenizer
        self.limits = limits
        self.speculation = speculation
        self.batch = Batch(sessions, BatchSettings(limits.mixed_prefill > 0, limits.debug_hash), speculation)
        self.schedule = ScheduleLimits.for_limits(limits)
        self.admission = Admission(self.batch, limits)
        self.mixing = MixChoice(limits.mixed_when)
        self.prefill = PrefillForward(self.mixing)
        self.finishing = Finishing(self.admission, tokenizer)
        # The rows not in the batch yet, oldest first: prompts to prefill, prefilled ones to join.
        self.prefilling: List[Row] = []
        self.ready: List[Row] = []
        self._cancelled: Set[int] = set()  # ids of waiting requests cancelled
        self._inbox: "queue.Queue[Union[Ticket, _Cancel]]" = queue.Queue()
        self._ids = itertools.count(1)
        self._released = False  # memory handed back since the last request (release_memory)
        self._lock = threading.Lock()
        self._error: Optional[str] = None
        self._down = threading.Event()  # set while the pair is down (see resume)
        self._stopping = False
        # A group about to change size (serve/resize.py's grow): admit nothing more, and end the
        # loop once no request is under way, the waiting ones kept for the next group.
        self._pausing = False
        self._paused = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # Called on this thread between turns while idle (serve/cluster.py asks the workers'
        # figures then, never in the middle of decoding).
        self.on_idle: Optional[Callable[[LeaderSessions], None]] = None

    # -- the HTTP face's side (any thread) ------------------------------------
    @property
    def error(self) -> Optional[str]:
        """Why the pair is down, or None while it is up."""
        return self._error

    @property
    def stats(self) -> Dict[str, int]:
        """Totals since start, each part's own (prefilled tokens are counted by the prefill
        forwards and by the decode steps that take prompt tokens in)."""
        total: "collections.Counter[str]" = collections.Counter()
        for part in (self.admission, self.prefill, self.batch, self.finishing):
            total.update(part.stats)
        return dict(total)

    def alive(self) -> bool:
        """True while the loop runs (or is paused for the group to change size: it resumes) and
        the pair is up."""
        running = self._thread is not None and self._thread.is_alive()
        return self._error is None and (running or self._paused.is_set())

    def ended(self) -> bool:
        """True once the loop's thread has ended (or never started)."""
        return self._thread is None or not self._thread.is_alive()

    def counts(self) -> Dict[str, int]:
        """Sessions prefilling, waiting to join the batch, decoding (for /health)."""
        index, (in_table, stored) = self.admission.index, self.sessions.counts()
        return {"prefilling": len(self.prefilling), "waiting": len(self.ready),
                "decoding": len(self.batch.running), "queued": self.queued(),
                "kv_reserved_tokens": self.admission.reserved, "kv_budget_tokens": self.admission.kv_budget,
                "prompt_cache_entries": len(index), "prompt_cache_bytes": index.nbytes(),
                # MLX's own figures on the leader (the worker's are the same share): arrays
                # alive, freed buffers it keeps for reuse, and the high-water mark.
                "mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
                "mlx_peak_bytes": mx.get_peak_memory(),
                # The leader's table (the worker's is the same): sessions, stored caches.
                "table_sessions": in_table, "table_stored": stored,
                **self._disk_figures(),
                **(self.mixing.figures() if self.limits.mixed_prefill else {})}

    @property
    def disk_cache(self):
        """This leader's --prompt-cache-dir (lockstep.caches.disk_cache.DiskCache), or None."""
        return self.admission.disk

    def _disk_figures(self) -> Dict[str, float]:
        """The leader's --prompt-cache-dir: its files, and the prefill time the prefixes loaded
        from it saved (their tokens at the prefill rate measured here, less the loading)."""
        disk = self.admission.disk
        if disk is None:
            return {}
        stats, per_token = self.admission.stats, self.mixing.separate_per_token or 0.0
        saved = stats["disk_tokens"] * per_token - stats["disk_load_ms"] / 1000
        return {"prompt_cache_disk_entries": len(disk), "prompt_cache_disk_bytes": disk.nbytes(),
                "prompt_cache_disk_seconds_saved": round(max(saved, 0.0), 3), **disk.stats}

    def queued(self) -> int:
        """Requests submitted and not started yet (waiting for room in the KV budget)."""
        return self._inbox.qsize() + len(self.admission.waiting)

    def kv_tokens(self) -> int:
        """Tokens the caches of the rows under way hold (for /metrics; read from another
        thread, so a snapshot of the lists the engine thread owns)."""
        rows = list(self.prefilling) + list(self.ready) + list(self.batch.running)
        return max(sum(len(r.request.prompt) - len(r.todo) - 1 + len(r.taken) for r in rows), 0)

    def submit(self, request: GenerationRequest) -> Ticket:
        """Queue a request; its Ticket (its id and events). PairUnavailableError when the pair
        is down, ValueError when it could never fit the budget (Admission.check; a full queue
        is the scheduler's BusyEvent)."""
        self.admission.check(request)
        with self._lock:
            if self._error is not None:
                raise PairUnavailableError(self._error)
            ticket = Ticket(next(self._ids), request)
            self._inbox.put(ticket)
        return ticket

    def cancel(self, ticket_id: int) -> None:
        """Cancel a request (from any thread): the engine thread ends it at its next turn, its
        session dropped on every rank, and sends it nothing more. A request that has ended
        already, or is cancelled twice, is left as it is."""
        self._inbox.put(_Cancel(ticket_id))

    def start(self) -> None:
        """Run the loop in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="ds4tp-engine", daemon=True)
        self._thread.start()

    def begin_stop(self) -> None:
        """Take no more requests and end those under way ("the server is stopping"), so their
        answers end before the HTTP server's graceful stop does: safe from a signal handler."""
        self._stopping = True

    def stop(self, timeout: float = 30.0) -> str:
        """Stop the loop and tell the worker to return; what became of the worker, for the
        leader's last line. The loop's thread is always ended before this returns (a step
        stuck at a gate fails at once when the pair is closed): a thread left inside MLX while
        the interpreter exits aborts the process ("terminate called without an active
        exception")."""
        self._stopping = True
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log(f"serve: the engine did not stop within {timeout:g} s; closing the group to end its step")
                self.sessions.group.close()
                thread.join(timeout)
        if self._down.is_set():
            return f"a worker rank was gone already ({self._error})"
        if thread is None or thread.is_alive() or not self.sessions.stop():
            return "the workers (ranks 1 ..) could not all be told to stop"
        return "the workers (ranks 1 ..) were told to stop"

    # -- the loop -------------------------------------------------------------
    def pause(self) -> None:
        """Admit no more requests (they wait, queued) and end the loop at the first turn with
        none under way, failing nobody: the group then changes size and resume() serves the
        queue over it. Engine.paused says when."""
        self._pausing = True

    def paused(self, timeout: float) -> bool:
        """True once pause() has ended the loop."""
        return self._paused.wait(timeout)

    def unpause(self) -> None:
        """Serve on over the same group after pause() (the grow it paused for did not happen):
        the loop runs again, the queue and the stored prompt caches as they were."""
        if not self._paused.is_set():
            return
        if self._thread is not None:
            self._thread.join()
        self._pausing = False
        self._start_unpaused()

    def _start_unpaused(self) -> None:
        """The loop started again, then the pause cleared: alive() stays True throughout, so a
        request waiting through the pause is never told the engine stopped."""
        self.start()
        self._paused.clear()

    def _under_way(self) -> bool:
        return bool(self.prefilling or self.ready or self.batch.running)

    def _run(self) -> None:
        try:
            while not self._stopping:
                if self._pausing and not self._under_way():
                    self._paused.set()
                    return
                self._turn()
        except Exception as exc:  # noqa: BLE001 - every failure ends the pair, reported to all
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        self._end_all("the server is stopping")

    def _turn(self) -> None:
        self._take_inbox()
        self._carry(plan_turn(self._state(), self.schedule))

    def _state(self) -> TurnState:
        batch = self.batch
        waiting = () if self._pausing else tuple(Queued(t.id, t.request.kv_tokens, t.id in self._cancelled)
                                                 for t in self.admission.waiting.values())
        return TurnState(waiting, self.admission.reserved, tuple(self.prefilling), tuple(self.ready),
                         tuple(batch.running), batch.pipelined, batch.unread, batch.first_unread,
                         batch.all_in_flight(), self.mixing.estimates(), self.speculation)

    def _carry(self, plan: TurnPlan) -> None:
        """Carry a turn's plan out, in its order (schedule.TurnPlan)."""
        for ticket_id in plan.drop:
            self.admission.drop(ticket_id)
            self._cancelled.discard(ticket_id)
        for rid in plan.end:
            self._abandon(self.batch.row(rid))
        for ticket_id in plan.refuse:
            self.admission.refuse(ticket_id)
        for ticket_id in plan.admit:
            ticket = self.admission.waiting[ticket_id]
            row = self.admission.start(ticket_id)
            self.finishing.open(row, ticket)
            (self.prefilling if row.todo else self.ready).append(row)
        if plan.mix_decided:
            self.mixing.decided()
        if plan.read_ahead:
            self._route(self.batch.read_ahead())
        if plan.prefill:
            done = set(self.prefill.run(self.batch, plan.prefill))
            self.ready += [r for r in self.prefilling if r.id in done]
            self.prefilling = [r for r in self.prefilling if r.id not in done]
        if plan.step is not None:
            moved = set(plan.step.join) | set(plan.step.enter)
            self.ready = [r for r in self.ready if r.id not in moved]
            self.prefilling = [r for r in self.prefilling if r.id not in moved]
            self._route(self.batch.step(plan.step))

    def _take_inbox(self) -> None:
        """Queue the requests submitted and mark the cancels, in the order they came; waits a
        while for one when there is nothing to do."""
        busy = self._under_way() or bool(self.admission.waiting and not self._pausing)
        try:
            item = self._inbox.get_nowait() if busy else self._inbox.get(timeout=IDLE_POLL_SEC)
        except queue.Empty:
            item = None
            if not busy:
                # Idle: nothing would notice a dead worker until the next request, and
                # /health must stop answering 200 as soon as the pair is down.
                gone = self.sessions.peer_gone()
                if gone:
                    raise TransportError(gone) from None
                if self.on_idle is not None:
                    self.on_idle(self.sessions)
                if not self._released:  # IDLE_POLL_SEC without work: the pair is idle
                    release_memory()
                    self._released = True
        while item is not None:
            self._released = False
            if isinstance(item, _Cancel):
                self._mark_cancelled(item.ticket_id)
            else:
                self.admission.queue(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _mark_cancelled(self, ticket_id: int) -> None:
        rid = self.admission.row_of.get(ticket_id)
        if rid is not None:
            self.batch.row(rid).cancelled = True
        elif ticket_id in self.admission.waiting:
            self._cancelled.add(ticket_id)

    def _abandon(self, row: Row) -> None:
        """End a cancelled row on every rank, its cache dropped; nobody is told."""
        self.finishing.forget(row)
        self.admission.close(row, None)
        self.prefilling = [r for r in self.prefilling if r is not row]
        self.ready = [r for r in self.ready if r is not row]

    def _route(self, out: Optional[StepOutput]) -> None:
        """What a read or a step produced, into the rows' answers; the finished rows ended."""
        if out is None:
            return
        if not self.batch.pipelined:
            # A stepped step's time, to the mixed-prefill estimates: a mixed step beside a
            # decode step as wide as its decode rows (1 + the drafts of the widest).
            if out.prompt_tokens:
                self.mixing.mixed_timed(out.seconds, out.prompt_tokens, out.width)
            else:
                self.mixing.decode_timed(out.seconds, out.width)
        outcomes = self.finishing.advance(out)
        self.batch.commit(out, [o.used for o in outcomes])  # before any row ends
        self.finishing.end(out, outcomes)

    # -- failure and resume ---------------------------------------------------
    def wait_down(self, timeout: float) -> bool:
        """True once the pair is down and the loop has ended (a worker may then rejoin)."""
        if not self._down.wait(timeout):
            return False
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def resume(self, sessions: LeaderSessions) -> None:
        """Serve again over a pair joined anew (a worker restarted and rejoined), or over a
        group of another size after pause(): the sessions that were under way have already
        failed with the pair (or ended), and the stored prompt caches went with the old group
        (never used across shares), so every rank starts from an empty table and the index of
        stored prompts starts empty too; requests still waiting are served by the new group."""
        if not (self._paused.is_set() or self.wait_down(0)):
            raise RuntimeError("resume() is for a server whose pair is down; this one is up")
        if self._thread is not None:
            self._thread.join()
        self._pausing = False
        self.sessions = sessions
        release_memory()  # the old pair's table, its caches and its failed steps
        self.batch.clear(sessions)
        self.admission.renew()
        self._forget_rows()
        with self._lock:
            self._error = None
            self._down.clear()
        self._start_unpaused()

    def give_up(self, message: str) -> None:
        """A paused engine whose next group did not form: the requests waiting fail
        (PairDownEvent(message)) and new ones are refused (503) until resume()."""
        if self._down.is_set() or not self._paused.is_set():
            return
        with self._lock:
            self._error = message
            self._down.set()
        self._end_all(message)

    def drop_sessions(self) -> None:
        """While the group changes size (down, or paused): the old group's table let go, so its
        part of the model is freed before the next part loads; an empty one stands in (/health
        reads it, and the old disk cache's figures) until resume()."""
        from ...lockstep.one_rank import OneRank

        self.sessions = OneRank(None, self.sessions.grammars, self.sessions.disk)
        self.batch.clear(self.sessions)

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message
            self._down.set()
        log(f"serve: the group is down: {message}")
        self.sessions.abort(message)
        drain_failed_work()
        self._end_all(message)

    def _end_all(self, message: str) -> None:
        """Every request under way or waiting gets PairDownEvent(message); new ones are refused."""
        with self._lock:
            self._error = self._error or message
        self._forget_rows()
        self.batch.clear()
        self.admission.fail(message)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Ticket):
                item.events.put(PairDownEvent(message))

    def _forget_rows(self) -> None:
        """The rows went with the pair (their requests are told by Admission.fail)."""
        self.prefilling, self.ready, self._cancelled = [], [], set()
        self.finishing.replies = {}
