"""The leader's scheduler for `ds4tp serve`: continuous batching over the pair.

One thread owns the model and the control channel. HTTP threads hand it requests and read
events back from a queue per request. Each turn of its loop:
  1. admits waiting requests: looks up the longest stored prefix (prompt_cache), creates the
     session on both ranks from that cache, trimmed where the leader says;
  2. prefills one chunk (`prefill_step` tokens) of each of the oldest sessions still
     prefilling (up to `prompt_concurrency`) in one padded forward (PREFILL_BATCH), so prompts
     that arrive together are prefilled together, and a long prompt delays the running
     sessions by one chunk per step, not by its whole length;
  3. runs one decode step over the rows of every running session plus the sessions whose
     prefill is done (they join the batch), samples each row, streams the text out;
  4. ends finished and abandoned sessions on both ranks, storing their caches for reuse.
When the pair goes down, every session fails with it; `resume` serves again over a pair
joined anew (serve.pair takes a restarted worker back).
As in mlx_lm.generate, a prompt's last token is the first decode input: the prefill covers
the others, so each session's tokens are what mlx-lm generates for it alone.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from typing import Dict, List, Optional

import mlx.core as mx

from .. import transport as tr
from ..link.wire import EVAL_PENDING
from .errors import PairUnavailable
from ..lockstep.prompt_cache import PromptCacheIndex
from ..lockstep.row_sampling import RowSampler, sample_batch, stream_seed
from ..lockstep.sessions import LeaderSessions, drain_failed_work
from ..lockstep.table import kv_code, release_memory
from .finishing import Finishing
from .mixing import MixChoice
from .speculation import verified_tokens
from .requests import Request, RunningSession, reserved_tokens

IDLE_POLL_SEC = 0.25


class Engine(Finishing):
    """See the module docstring. `start()` runs the loop in a daemon thread."""

    def __init__(self, sessions: LeaderSessions, tokenizer, *, prompt_cache_size: int = 10,
                 prefill_step: int = 2048, max_batch: int = 32, debug_hash: int = 0,
                 kv_budget: int = 0, max_queued: int = 64, prompt_concurrency: int = 8,
                 kv_bits: int = 0, kv_group_size: int = 64, prompt_cache_bytes: int = 0,
                 speculation=None, mixed_prefill: int = 0, mixed_when: str = "cheaper"):
        from mlx_lm.models.cache import can_trim_prompt_cache

        from ..link.wire import MAX_PREFILL_ROWS, MAX_TOKENS_PER_FRAME

        self.sessions = sessions
        self.tokenizer = tokenizer
        self.prefill_step = prefill_step
        self.max_batch = max_batch
        # Prompts prefilled together in one padded forward (mlx_lm.server's --prompt-concurrency),
        # within what one PREFILL_BATCH frame may carry.
        self.prompt_concurrency = max(1, min(prompt_concurrency, MAX_PREFILL_ROWS))
        self._frame_tokens = MAX_TOKENS_PER_FRAME
        self.debug_hash = debug_hash
        self.index = PromptCacheIndex(prompt_cache_size,
                                      can_trim_prompt_cache(sessions.table.make_cache()),
                                      prompt_cache_bytes)
        # Every fresh session's cache is quantized so (0: float): the same for all, so that
        # sessions merge into one decode batch.
        self.kv = kv_code(kv_bits, kv_group_size)
        self.speculation = speculation  # serve.speculation.Speculation, or None: no drafts
        # Prompt tokens a prefilling session carries in a decode step (0: prompts are prefilled
        # in forwards of their own). On a Mac decode is bound by reading the weights, so a step
        # that also carries some prompt tokens costs about one pass where two would cost two;
        # on a compute-bound CPU every padded position costs, so it is off by default, and
        # where it is on, the leader mixes where it measured mixing cheaper (serve.mixing).
        self.mixed_prefill = mixed_prefill
        self.mixing = MixChoice(mixed_when)
        # Decode pipelined (lockstep.row_sampling): both ranks sample every row, and each step
        # is sent and queued before the last one's tokens are read. A verify or mixed step
        # needs the tokens first, so with drafts or mixed prefill the steps stay in lockstep.
        self.pipelined = speculation is None and not mixed_prefill
        self._unread = False  # the rows in _running have a step's tokens not read yet
        self._first_unread = False  # ... and one of them is a session's first token
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self._inbox: "queue.Queue[Request]" = queue.Queue()
        # Memory-bounded admission: a session starts only while the tokens reserved by the
        # sessions under way (prompt + max_tokens each) stay within kv_budget (0: no budget);
        # the others wait here in arrival order, at most max_queued of them with the inbox.
        self.kv_budget, self.max_queued = kv_budget, max_queued
        self._waiting: "collections.deque[Request]" = collections.deque()
        self._reserved = 0
        self._released = False  # memory handed back since the last request (release_memory)
        # Every request between leaving the queue and its last event, whatever list its
        # session is in at the moment (a step moves sessions between lists, and a failure can
        # strike in between): the pair going down reaches each of them, none hangs.
        self._owned: Dict[int, Request] = {}
        self._ids = itertools.count(1)
        self._prefilling: List[RunningSession] = []
        self._ready: List[RunningSession] = []
        self._running: List[RunningSession] = []
        self._lock = threading.Lock()
        self._error: Optional[str] = None
        self._down = threading.Event()  # set while the pair is down (see resume)
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.stats = {"requests": 0, "prefilled_tokens": 0, "cached_tokens": 0, "decode_steps": 0,
                      "generated_tokens": 0, "prefill_batches": 0, "prefill_batch_rows": 0, "prefill_padded_tokens": 0,
                      "decode_batch_rows": 0, "verify_steps": 0, "mixed_steps": 0, "drafted_tokens": 0,
                      "accepted_tokens": 0}

    # -- the HTTP threads' side ---------------------------------------------
    @property
    def error(self) -> Optional[str]:
        """Why the pair is down, or None while it is up."""
        return self._error

    def alive(self) -> bool:
        """True while the loop runs and the pair is up."""
        return self._error is None and self._thread is not None and self._thread.is_alive()

    def counts(self) -> Dict[str, int]:
        """Sessions prefilling, waiting to join the batch, decoding (for /health)."""
        return {"prefilling": len(self._prefilling), "waiting": len(self._ready),
                "decoding": len(self._running), "queued": self.queued(),
                "kv_reserved_tokens": self._reserved, "kv_budget_tokens": self.kv_budget,
                "prompt_cache_entries": len(self.index), "prompt_cache_bytes": self.index.nbytes(),
                # MLX's own figures on the leader (the worker's are the same share): arrays
                # alive, freed buffers it keeps for reuse, and the high-water mark.
                "mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
                "mlx_peak_bytes": mx.get_peak_memory(),
                # The leader's table (the worker's is the same): sessions, stored caches.
                "table_sessions": len(self.sessions.table.sessions) + len(self.sessions.table.rows),
                "table_stored": len(self.sessions.table.stored),
                **(self.mixing.figures() if self.mixed_prefill else {})}

    def queued(self) -> int:
        """Requests submitted and not started yet (waiting for room in the KV budget)."""
        return self._inbox.qsize() + len(self._waiting)

    def kv_tokens(self) -> int:
        """Tokens the caches of the sessions under way hold (for /metrics; read from another
        thread, so a snapshot of the lists the engine thread owns)."""
        total = 0
        for session in list(self._prefilling) + list(self._ready) + list(self._running):
            total += len(session.request.prompt) - len(session.todo) - 1 + len(session.generated)
        return max(total, 0)

    def submit(self, request: Request) -> None:
        """Queue a request; PairUnavailable when the pair is down, ValueError when it could
        never fit the budget. A request that must wait while max_queued others already wait
        gets ("busy", reason) as its only event (the HTTP layer's 429)."""
        need = reserved_tokens(request)
        if self.kv_budget and need > self.kv_budget:
            raise ValueError(f"the prompt and max_tokens need {need} cache tokens, more than the "
                             f"server's whole budget (--max-kv-tokens {self.kv_budget}); send a "
                             "shorter prompt or a smaller max_tokens")
        with self._lock:
            if self._error is not None:
                raise PairUnavailable(self._error)
            self._inbox.put(request)

    def start(self) -> None:
        """Run the loop in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="ds4tp-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop and tell the worker to return."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is None:
            self.sessions.stop()

    # -- the loop -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._admit()
                self._end_cancelled()
                decoding = bool(self._running or self._ready)
                # A full batch has no row for a prompt: it is prefilled on its own meanwhile.
                room = len(self._running) + len(self._ready) < self.max_batch
                mix = bool(self.mixed_prefill and decoding and room and self._prefilling
                           and self.mixing.mix())
                if self._prefilling or self._ready or self._first_unread:
                    # Sessions wait to prefill or to join, or the last step made a session's
                    # first token: the last step's tokens are read first, so a finished row is
                    # free for them and a first token is not held back by a chunk or a step
                    # (this may end the last running session). The steady batch pipelines.
                    self._read_ahead()
                if self._prefilling and not mix:
                    self._prefill_chunk()
                if self._running or self._ready:
                    self._decode_step(mix)
        except Exception as exc:  # noqa: BLE001 - every failure ends the pair, reported to all
            self._fail(f"{type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        busy = bool(self._prefilling or self._ready or self._running or self._waiting)
        try:
            request = self._inbox.get_nowait() if busy else self._inbox.get(timeout=IDLE_POLL_SEC)
        except queue.Empty:
            request = None
            if not busy:
                # Idle: nothing would notice a dead worker until the next request, and
                # /health must stop answering 200 as soon as the pair is down.
                gone = self.sessions.peer_gone()
                if gone:
                    raise tr.TransportError(gone)
                if not self._released:  # IDLE_POLL_SEC without work: the pair is idle
                    release_memory()
                    self._released = True
        while request is not None:
            self._released = False
            self._waiting.append(request)
            self._start_waiting()
            if len(self._waiting) > self.max_queued:
                # It could not start, and max_queued others already wait before it.
                self._waiting.pop().events.put((
                    "busy", f"{self.max_queued} requests already wait for room in the KV budget "
                    f"(--max-kv-tokens {self.kv_budget}, --max-queued {self.max_queued}); retry shortly"))
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                request = None
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Start waiting requests, in arrival order, while the KV budget has room."""
        while self._waiting:
            head = self._waiting[0]
            if head.cancelled:
                self._waiting.popleft()
                continue
            need = reserved_tokens(head)
            if self.kv_budget and self._reserved + need > self.kv_budget:
                return  # the head waits for room, and the rest behind it
            self._waiting.popleft()
            self._reserved += need
            self._owned[id(head)] = head
            self._start(head)

    def _start(self, request: Request) -> None:
        sid = next(self._ids)
        reuse = self.index.lookup(request.prompt)
        self.sessions.create(sid, reuse.cache_id, reuse.mode, self.kv)
        if reuse.needs_rewind:
            self.sessions.rewind(sid, reuse.keep)
        request.cached_tokens = reuse.keep
        self.stats["requests"] += 1
        self.stats["cached_tokens"] += reuse.keep
        session = RunningSession(sid, request, reuse, self.tokenizer)
        seed = stream_seed(request.options)
        if self.pipelined:
            self.sessions.sampler(sid, request.options, request.prompt, seed)
            session.sampler = self.sessions.table.samplers[sid]
        else:
            session.sampler = RowSampler(request.options, request.prompt, seed, self.sessions.table.vocab)
        session.sampler.keep_logprobs = request.logprobs is not None
        if self.speculation is not None:
            session.drafter = self.speculation.drafter(request)
        (self._prefilling if session.todo else self._ready).append(session)

    def _prefill_chunk(self) -> None:
        """One chunk of each of the oldest prefilling sessions (up to prompt_concurrency), in one
        padded forward on both ranks: prompts that arrive together cost one forward per chunk,
        not one each, and the running sessions still wait only one chunk's time per step."""
        # One forward takes at most prefill_step tokens in all, padding included, however many
        # rows share it: its activations (the attention scores above all) then never outgrow
        # those of one session's chunk. The rows share the chunk evenly; a short prompt takes
        # only what it needs.
        step = min(self.prefill_step, self._frame_tokens)
        waiting = self._prefilling[: self.prompt_concurrency]
        width = min(max(len(s.todo) for s in waiting), max(step // len(waiting), 1))
        count = max(1, min(len(waiting), step // width))
        rows = [(session, session.todo[:width]) for session in waiting[:count]]
        total = sum(len(chunk) for _, chunk in rows)
        began = time.perf_counter()
        self.sessions.prefill_batch([(session.sid, chunk) for session, chunk in rows])
        self.mixing.prefill_timed(time.perf_counter() - began, total)
        self.stats["prefilled_tokens"] += total
        self.stats["prefill_batches"] += 1
        self.stats["prefill_batch_rows"] = max(self.stats["prefill_batch_rows"], len(rows))
        self.stats["prefill_padded_tokens"] = max(self.stats["prefill_padded_tokens"],
                                                  len(rows) * max(len(c) for _, c in rows))
        for session, chunk in rows:
            session.todo = session.todo[len(chunk):]
            if not session.todo:
                self._prefilling.remove(session)
                self._ready.append(session)

    def _decode_step(self, mix: bool = False) -> None:
        room = self.max_batch - len(self._running)
        joining, self._ready = self._ready[:room], self._ready[room:]
        rows = self._running + joining
        if self.pipelined:
            self._pipelined_step(rows, joining)
            return
        if mix and len(rows) < self.max_batch:
            # Mixed batch: prompts still prefilling join the decode forward with a chunk each,
            # so one pass over the weights serves both (see mixed_prefill).
            entering = self._prefilling[: self.max_batch - len(rows)]
            self._prefilling = self._prefilling[len(entering):]
            rows += entering
        chunks = [s.todo[: self.mixed_prefill] if s.todo else None for s in rows]
        drafts = [[] if c is not None else self._propose(s) for s, c in zip(rows, chunks)] \
            if self.speculation is not None else [[] for _ in rows]
        inputs = [c if c is not None else [s.next_input] + d for s, c, d in zip(rows, chunks, drafts)]
        multi = any(len(i) > 1 for i in inputs)
        began = time.perf_counter()
        if multi:
            logits = self.sessions.verify_batch([(s.sid, i) for s, i in zip(rows, inputs)])
            self.stats["verify_steps"] += 1
        else:
            logits = self.sessions.step([(s.sid, i[0]) for s, i in zip(rows, inputs)])
        took = time.perf_counter() - began
        prompt_tokens = sum(len(c) for c in chunks if c is not None)
        width = max([len(i) for i, c in zip(inputs, chunks) if c is None], default=1)
        if prompt_tokens:
            self.mixing.mixed_timed(took, prompt_tokens, width)
        else:
            self.mixing.decode_timed(took, width)
        if any(c is not None for c in chunks):
            self.stats["mixed_steps"] += 1
        for session, chunk in zip(rows, chunks):
            if chunk is not None:
                session.todo = session.todo[len(chunk):]
                self.stats["prefilled_tokens"] += len(chunk) + (0 if session.todo else 1)
        self._count_step(rows, joining)
        errors: Dict[int, str] = {}
        new: List[Optional[List[int]]] = [[] for _ in rows]  # prefill rows yield no token
        plain = [i for i, (c, d) in enumerate(zip(chunks, drafts)) if c is None and not d]
        if plain:
            mine: Dict[int, str] = {}
            row_logits = logits[mx.array(plain), 0] if multi else (logits if len(plain) == len(rows) else logits[mx.array(plain)])
            tokens = sample_batch(row_logits, [rows[i].sampler for i in plain], mine).tolist()
            for j, i in enumerate(plain):
                new[i] = None if j in mine else [tokens[j]]
                if j in mine:
                    errors[i] = mine[j]
        drafted = [i for i, d in enumerate(drafts) if d]
        if drafted:
            verified = verified_tokens(logits[mx.array(drafted)], [drafts[i] for i in drafted])
            for i, tokens in zip(drafted, verified):
                new[i] = tokens
                rows[i].drafter.accepted(len(drafts[i]), len(tokens) - 1)
                self.stats["drafted_tokens"] += len(drafts[i])
                self.stats["accepted_tokens"] += len(tokens) - 1
        fixed = {i: len(c) for i, c in enumerate(chunks) if c is not None}
        self._take(rows, new, errors, commit=multi, fixed_keep=fixed)

    def _pipelined_step(self, rows: List[RunningSession], joining: List[RunningSession]) -> None:
        """Send and queue this step, its running rows taking each rank's own sample of the last
        step (EVAL_PENDING), then read the last step's tokens while this one runs. A session
        that ends there was a row of this step too: its last token went into its cache."""
        flight = self._running if self._unread else []  # the last step's rows, tokens unread
        taken = self._taken(flight)
        self.sessions.step([(s.sid, EVAL_PENDING if s.fed_all else s.next_input) for s in rows])
        for session in rows:
            session.fed_all = True
        self._unread = True
        self._first_unread = bool(joining)
        self._count_step(rows, joining)
        if not flight:
            self._running = rows
            return
        self._take_drawn(flight, *taken)
        self._running += joining

    def _read_ahead(self) -> None:
        """Read the last step's tokens now, before the turn's prefill chunk or next step would
        hold them back (see _run for when); their rows' next inputs are then the tokens
        themselves, and the tokens not in any cache yet."""
        if not (self.pipelined and self._unread and self._running):
            return
        flight = self._running
        taken = self._taken(flight)
        self._unread = self._first_unread = False
        for session in flight:
            session.fed_all = False
        self._take_drawn(flight, *taken)

    def _taken(self, flight: List[RunningSession]) -> tuple:
        """(tokens, errors, logprobs) of the rows of the last step, kept before another step
        overwrites what the table holds of them; the tokens still lazy."""
        table = self.sessions.table
        drawn = [table.pending[s.sid] for s in flight]
        failed = {i: table.row_errors.pop(s.sid) for i, s in enumerate(flight) if s.sid in table.row_errors}
        logprobs = [table.samplers[s.sid].last_logprobs for s in flight]
        return drawn, failed, logprobs

    def _take_drawn(self, flight: List[RunningSession], drawn: List[mx.array], failed: Dict[int, str],
                    logprobs: list) -> None:
        values = (drawn[0] if len(drawn) == 1 else mx.concatenate(drawn)).tolist()  # waits for them
        new = [None if i in failed else [v] for i, v in enumerate(values)]
        self._take(flight, new, failed, commit=False, logprobs=logprobs)

    def _count_step(self, rows: List[RunningSession], joining: List[RunningSession]) -> None:
        if joining:
            # Prompt tokens are computed once each: the last one is the first decode input.
            self.stats["prefilled_tokens"] += len(joining)
        self.stats["decode_steps"] += 1
        self.stats["decode_batch_rows"] = max(self.stats["decode_batch_rows"], len(rows))
        if self.debug_hash and self.stats["decode_steps"] % self.debug_hash == 0:
            self.sessions.check_hash()

    def _propose(self, session: RunningSession) -> List[int]:
        request = session.request
        return self.speculation.propose(session.drafter, request.prompt + session.generated,
                                        request.num_draft_tokens,
                                        request.max_tokens - len(session.generated))

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
        from mlx_lm.models.cache import can_trim_prompt_cache

        if not self.wait_down(0):
            raise RuntimeError("resume() is for a server whose pair is down; this one is up")
        self.sessions = sessions
        release_memory()  # the old pair's table, its caches and its failed steps
        self.index = PromptCacheIndex(self.index.max_size,
                                      can_trim_prompt_cache(sessions.table.make_cache()),
                                      self.index.max_bytes)
        self._reserved = 0
        with self._lock:
            self._error = None
            self._down.clear()
        self.start()

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message
            self._down.set()
        tr.log(f"serve: the pair is down: {message}")
        self.sessions.abort(message)
        drain_failed_work()
        owned = list(self._owned.values())
        self._owned.clear()
        self._prefilling, self._ready, self._running = [], [], []
        self._unread = self._first_unread = False
        for request in owned:
            request.events.put(("error", message))
        while self._waiting:
            self._waiting.popleft().events.put(("error", message))
        self._reserved = 0
        while True:
            try:
                self._inbox.get_nowait().events.put(("error", message))
            except queue.Empty:
                return
