"""The leader's scheduler for `ds4tp serve`: continuous batching over the pair.

One thread owns the model and the control channel. Its narrow, thread-safe face to the HTTP
event loop: `submit` a request (the inbox), cancel it (its `cancelled` flag, read at the next
turn), and its events (a queue per request the loop awaits, serve/engine/events.py). Each turn of its loop:
  1. admits waiting requests (serve.engine.admission: the KV budget, the stored prefix of each
     prompt, the session created on both ranks from that cache);
  2. prefills one chunk of the oldest prompts in one padded forward (serve.engine.prefill), unless
     this turn's prompts ride in the decode step (mixed prefill);
  3. runs one decode step over the batch and the sessions joining it (serve.engine.decoding);
  4. takes what the step produced into the sessions, ending the finished ones on both ranks
     and storing their caches for reuse (serve.engine.finishing).
When the pair goes down, every session fails with it; `resume` serves again over a pair
joined anew (serve.serving_rank takes a restarted worker back).
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Dict, Optional

import mlx.core as mx

from ... import transport as tr
from ...base.log import log
from ...lockstep.batch import Batch, BatchSettings
from ...lockstep.protocol.sessions import LeaderSessions, drain_failed_work
from ...lockstep.protocol.table import release_memory
from ...lockstep.speculative import Speculation
from ..errors import PairUnavailableError
from ..limits import ServeLimits
from .admission import Admission
from .decoding import DecodeStepper
from .events import PairDownEvent
from .finishing import Finishing
from .generation import Request, RunningSession, StepOutput
from .prefill import PrefillScheduler

IDLE_POLL_SEC = 0.25


class Engine:
    """See the module docstring. `start()` runs the loop in a daemon thread."""

    def __init__(self, sessions: LeaderSessions, tokenizer, limits: ServeLimits,
                 speculation: Optional[Speculation] = None):
        self.sessions = sessions
        self.tokenizer = tokenizer
        self.limits = limits
        self.batch = Batch(sessions, BatchSettings(limits.max_batch, limits.mixed_prefill, limits.debug_hash),
                           speculation)
        self.admission = Admission(self.batch, tokenizer, limits)
        self.prefill = PrefillScheduler(self.batch, limits)
        self.stepper = DecodeStepper(self.batch, self.prefill.mixing)
        self.finishing = Finishing(self.admission, tokenizer)
        self._inbox: "queue.Queue[Request]" = queue.Queue()
        self._released = False  # memory handed back since the last request (release_memory)
        self._lock = threading.Lock()
        self._error: Optional[str] = None
        self._down = threading.Event()  # set while the pair is down (see resume)
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

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
        for part in (self.admission, self.prefill, self.stepper, self.finishing):
            total.update(part.stats)
        return dict(total)

    def alive(self) -> bool:
        """True while the loop runs and the pair is up."""
        return self._error is None and self._thread is not None and self._thread.is_alive()

    def ended(self) -> bool:
        """True once the loop's thread has ended (or never started)."""
        return self._thread is None or not self._thread.is_alive()

    def counts(self) -> Dict[str, int]:
        """Sessions prefilling, waiting to join the batch, decoding (for /health)."""
        index, (in_table, stored) = self.admission.index, self.sessions.counts()
        return {"prefilling": len(self.prefill.queue), "waiting": len(self.stepper.ready),
                "decoding": len(self.stepper.running), "queued": self.queued(),
                "kv_reserved_tokens": self.admission.reserved, "kv_budget_tokens": self.admission.kv_budget,
                "prompt_cache_entries": len(index), "prompt_cache_bytes": index.nbytes(),
                # MLX's own figures on the leader (the worker's are the same share): arrays
                # alive, freed buffers it keeps for reuse, and the high-water mark.
                "mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
                "mlx_peak_bytes": mx.get_peak_memory(),
                # The leader's table (the worker's is the same): sessions, stored caches.
                "table_sessions": in_table, "table_stored": stored,
                **self._disk_figures(),
                **(self.prefill.mixing.figures() if self.limits.mixed_prefill else {})}

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
        stats, per_token = self.admission.stats, self.prefill.mixing.separate_per_token or 0.0
        saved = stats["disk_tokens"] * per_token - stats["disk_load_ms"] / 1000
        return {"prompt_cache_disk_entries": len(disk), "prompt_cache_disk_bytes": disk.nbytes(),
                "prompt_cache_disk_seconds_saved": round(max(saved, 0.0), 3), **disk.stats}

    def queued(self) -> int:
        """Requests submitted and not started yet (waiting for room in the KV budget)."""
        return self._inbox.qsize() + len(self.admission.waiting)

    def kv_tokens(self) -> int:
        """Tokens the caches of the sessions under way hold (for /metrics; read from another
        thread, so a snapshot of the lists the engine thread owns)."""
        sessions = list(self.prefill.queue) + list(self.stepper.ready) + list(self.stepper.running)
        return max(sum(len(s.request.prompt) - len(s.todo) - 1 + len(s.generated) for s in sessions), 0)

    def submit(self, request: Request) -> None:
        """Queue a request; PairUnavailableError when the pair is down, ValueError when it could
        never fit the budget (Admission.check; a full queue is Admission.offer's "busy")."""
        self.admission.check(request)
        with self._lock:
            if self._error is not None:
                raise PairUnavailableError(self._error)
            self._inbox.put(request)

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
                log(f"serve: the engine did not stop within {timeout:g} s; closing the pair to end its step")
                self.sessions.group.close()
                thread.join(timeout)
        if self._down.is_set():
            return f"the worker was gone already ({self._error})"
        if thread is None or thread.is_alive() or not self.sessions.stop():
            return "the worker could not be told to stop"
        return "the worker was told to stop"

    # -- the loop -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._turn()
        except Exception as exc:  # noqa: BLE001 - every failure ends the pair, reported to all
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        self._end_all("the server is stopping")

    def _turn(self) -> None:
        self._admit()
        for session in self.prefill.take_cancelled() + self.stepper.take_cancelled():
            self.admission.close(session, None)
        stepper = self.stepper
        mix = stepper.has_rows and self.prefill.mixes(stepper.free_rows() > 0)
        if self.prefill.queue or stepper.ready or stepper.first_unread:
            # Sessions wait to prefill or to join, or the last step made a session's first
            # token: the last step's tokens are read first, so a finished row is free for them
            # and a first token is not held back by a chunk or a step (this may end the last
            # running session). The steady batch pipelines.
            self._finish(stepper.read_ahead())
        if self.prefill.queue and not mix:
            stepper.join(self.prefill.chunk())
        if stepper.has_rows:
            entering = self.prefill.hand_over(stepper.free_rows()) if mix else []
            self._finish(stepper.step(entering))

    def _admit(self) -> None:
        busy = bool(self.prefill.queue or self.stepper.has_rows or self.admission.waiting)
        try:
            request = self._inbox.get_nowait() if busy else self._inbox.get(timeout=IDLE_POLL_SEC)
        except queue.Empty:
            request = None
            if not busy:
                # Idle: nothing would notice a dead worker until the next request, and
                # /health must stop answering 200 as soon as the pair is down.
                gone = self.sessions.peer_gone()
                if gone:
                    raise tr.TransportError(gone) from None
                if not self._released:  # IDLE_POLL_SEC without work: the pair is idle
                    release_memory()
                    self._released = True
        started = []
        while request is not None:
            self._released = False
            started += self.admission.offer(request)
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                request = None
        for session in started + self.admission.start_waiting():
            self._place(session)

    def _place(self, session: RunningSession) -> None:
        if session.todo:
            self.prefill.add(session)
        else:
            self.stepper.join([session])

    def _finish(self, out: Optional[StepOutput]) -> None:
        if out is None:
            return
        outcomes = self.finishing.advance(out)
        self.stepper.commit(out, [o.used for o in outcomes])  # before any session ends
        self.stepper.drop(self.finishing.end(out, outcomes))

    # -- failure and resume ---------------------------------------------------
    def wait_down(self, timeout: float) -> bool:
        """True once the pair is down and the loop has ended (a worker may then rejoin)."""
        if not self._down.wait(timeout):
            return False
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def resume(self, sessions: LeaderSessions) -> None:
        """Serve again over a pair joined anew (a worker restarted and rejoined): the sessions
        that were under way have already failed with the pair, and the stored prompt caches
        went with the old worker, so both ranks start from empty tables and the index of
        stored prompts starts empty too."""
        if not self.wait_down(0):
            raise RuntimeError("resume() is for a server whose pair is down; this one is up")
        self.sessions = sessions
        release_memory()  # the old pair's table, its caches and its failed steps
        self.batch.clear(sessions)
        self.admission.renew()
        self.prefill.rebind()
        self.stepper.clear()
        with self._lock:
            self._error = None
            self._down.clear()
        self.start()

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message
            self._down.set()
        log(f"serve: the pair is down: {message}")
        self.sessions.abort(message)
        drain_failed_work()
        self._end_all(message)

    def _end_all(self, message: str) -> None:
        """Every request under way or waiting gets PairDownEvent(message); new ones are refused."""
        with self._lock:
            self._error = self._error or message
        self.prefill.clear()
        self.stepper.clear()
        self.batch.clear()
        self.admission.fail(message)
        while True:
            try:
                self._inbox.get_nowait().events.put(PairDownEvent(message))
            except queue.Empty:
                return
