"""The decode batch: the sessions decoding together, those waiting to join them, and one
decode step over them a turn, which returns what it produced for each row (StepOutput).

Pipelined (no drafts, no mixed prefill): both ranks sample every row inside the step's graph
(SAMPLER, lockstep.row_sampling), and each step is sent and queued before the last one's
tokens are read, its rows taking each rank's own sample of the last step (EVAL_PENDING): the
leader reads step N's tokens while step N+1 runs. A verify or mixed step needs the tokens
first, so with drafts or mixed prefill the steps are stepped: the leader reads the logits,
samples (or verifies the drafts, serve.speculation) and sends the next step's inputs. As in
mlx_lm.generate, a prompt's last token is the first decode input: the prefill covers the
others, so each session's tokens are what mlx-lm generates for it alone.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

import mlx.core as mx

from ..lockstep.commands import EVAL_PENDING
from ..lockstep.row_sampling import RowSampler, sample_batch, stream_seed
from ..lockstep.sessions import LeaderSessions, SampledStep
from .generation import RowResult, RunningSession, StepOutput, cancelled_out
from .limits import ServeLimits
from .mixing import MixChoice
from .speculation import Speculation, verified_tokens


class DecodeStepper:
    """The decode batch and its steps (see the module docstring)."""

    def __init__(self, sessions: LeaderSessions, limits: ServeLimits, mixing: MixChoice,
                 speculation: Optional[Speculation] = None):
        self.sessions = sessions
        self.max_batch = limits.max_batch
        self.debug_hash = limits.debug_hash
        self.mixed_prefill = limits.mixed_prefill
        self.mixing = mixing  # the step timings it decides by (serve.mixing)
        self.speculation = speculation
        self.pipelined = speculation is None and not limits.mixed_prefill
        self.ready: List[RunningSession] = []  # prefilled, waiting for a row
        self.running: List[RunningSession] = []  # the rows of the batch, in row order
        self._unread: Optional[Tuple[List[RunningSession], SampledStep]] = None  # sent, not read
        self.first_unread = False  # the unread step made a session's first token
        self.stats = {"decode_steps": 0, "decode_batch_rows": 0, "verify_steps": 0, "mixed_steps": 0,
                      "drafted_tokens": 0, "accepted_tokens": 0, "prefilled_tokens": 0}

    @property
    def has_rows(self) -> bool:
        """Whether a decode step has rows to run (sessions decoding or waiting to join)."""
        return bool(self.running or self.ready)

    def free_rows(self) -> int:
        """Rows of max_batch that the next step leaves free, once the waiting sessions joined."""
        return max(self.max_batch - len(self.running) - len(self.ready), 0)

    def prepare(self, session: RunningSession) -> None:
        """Set a new session up for this batch's kind of step: pipelined, both ranks' sampler
        (SAMPLER); speculating, its drafter (None: it decodes one token a step)."""
        request = session.request
        seed = stream_seed(request.options)
        if self.pipelined:
            self.sessions.sampler(session.sid, request.options, request.prompt, seed)
            session.sampler = self.sessions.table.batch.samplers[session.sid]
        else:
            table = self.sessions.table
            session.sampler = RowSampler(request.options, request.prompt, seed, table.vocab,
                                         grammar=table.row_grammar(request.options.grammar))
        session.sampler.keep_logprobs = request.logprobs is not None
        if self.speculation is not None:
            session.drafter = self.speculation.drafter(request)

    def join(self, sessions: List[RunningSession]) -> None:
        """Prefilled sessions: they join the batch at the next step with a free row."""
        self.ready.extend(sessions)

    def step(self, entering: List[RunningSession]) -> Optional[StepOutput]:
        """One decode step over the batch and the sessions joining it (`entering`: prompts a
        mixed step carries from now on); what it produced, or, pipelined, what the step before
        it produced (None when nothing was unread)."""
        room = self.max_batch - len(self.running)
        joining, self.ready = self.ready[:room], self.ready[room:]
        rows = self.running + joining
        if self.pipelined:
            return self._pipelined(rows, joining)
        out = self._stepped(rows + entering, joining)
        self.running = out.rows
        return out

    def read_ahead(self) -> Optional[StepOutput]:
        """The last step's tokens now, before the turn's prefill chunk or next step would hold
        them back; their rows' next inputs are then the tokens themselves, not in any cache
        yet. None when nothing is unread."""
        unread, self._unread, self.first_unread = self._unread, None, False
        if unread is None or not self.running:
            return None
        for session in self.running:
            session.fed_all = False
        return _read(unread, list(self.running))

    def commit(self, out: StepOutput, used: List[int]) -> None:
        """After a verify step: both ranks keep in each row's cache the positions it used."""
        if out.verify:
            self.sessions.commit_batch(used)

    def drop(self, ended: List[RunningSession]) -> None:
        """Sessions that ended leave the batch."""
        self.running = [s for s in self.running if s not in ended]

    def take_cancelled(self) -> List[RunningSession]:
        """The waiting sessions whose requests were cancelled, out of the queue."""
        self.ready, cancelled = cancelled_out(self.ready)
        return cancelled

    def clear(self) -> None:
        self.ready, self.running, self._unread, self.first_unread = [], [], None, False

    def rebind(self, sessions: LeaderSessions) -> None:
        """Decode over a pair joined anew (the batch went with the old one)."""
        self.clear()
        self.sessions = sessions

    # -- the steps ------------------------------------------------------------
    def _pipelined(self, rows: List[RunningSession], joining: List[RunningSession]) -> Optional[StepOutput]:
        """Send and queue this step, its running rows taking each rank's own sample of the last
        step, then read the last step's tokens while this one runs. A session that ends there
        was a row of this step too: its last token went into its cache (fed_all)."""
        last, flight = self._unread, list(self.running)  # the last step's rows, tokens unread
        drawn = self.sessions.sampled_step([(s.sid, EVAL_PENDING if s.fed_all else s.next_input) for s in rows])
        for session in rows:
            session.fed_all = True
        self._unread, self.first_unread = (rows, drawn), bool(joining)
        self._count(rows, joining)
        self.running = rows
        return _read(last, flight) if last is not None and flight else None

    def _stepped(self, rows: List[RunningSession], joining: List[RunningSession]) -> StepOutput:
        """One step whose inputs the leader chose from the last one's tokens: a prompt chunk
        (mixed), the input token and its drafts (verify), or the input token alone."""
        chunks = [s.todo[: self.mixed_prefill] if s.todo else None for s in rows]
        drafts = [[] if c is not None or self.speculation is None else self._propose(s)
                  for s, c in zip(rows, chunks)]
        inputs = [c if c is not None else [s.next_input] + d for s, c, d in zip(rows, chunks, drafts)]
        multi = any(len(i) > 1 for i in inputs)
        began = time.perf_counter()
        if multi:
            logits = self.sessions.verify_batch([(s.sid, i) for s, i in zip(rows, inputs)])
            self.stats["verify_steps"] += 1
        else:
            logits = self.sessions.step([(s.sid, i[0]) for s, i in zip(rows, inputs)])
        self._timed(time.perf_counter() - began, inputs, chunks)
        results: List[Optional[RowResult]] = [None] * len(rows)  # each row's, by its kind below
        for i, (session, chunk) in enumerate(zip(rows, chunks)):
            if chunk is not None:
                session.todo = session.todo[len(chunk):]
                self.stats["prefilled_tokens"] += len(chunk) + (0 if session.todo else 1)
                results[i] = RowResult([], chunk=len(chunk))
        self._count(rows, joining)
        plain = [i for i, (c, d) in enumerate(zip(chunks, drafts)) if c is None and not d]
        if plain:
            errors = {}
            row_logits = logits[mx.array(plain), 0] if multi else \
                (logits if len(plain) == len(rows) else logits[mx.array(plain)])
            tokens = sample_batch(row_logits, [rows[i].sampler for i in plain], errors).tolist()
            for j, i in enumerate(plain):
                results[i] = RowResult(None, errors[j]) if j in errors else \
                    RowResult([tokens[j]], logprobs=rows[i].sampler.last_logprobs)
        drafted = [i for i, d in enumerate(drafts) if d]
        if drafted:
            verified = verified_tokens(logits[mx.array(drafted)], [drafts[i] for i in drafted])
            for i, tokens in zip(drafted, verified):
                results[i] = RowResult(tokens)
                rows[i].drafter.accepted(len(drafts[i]), len(tokens) - 1)
                self.stats["drafted_tokens"] += len(drafts[i])
                self.stats["accepted_tokens"] += len(tokens) - 1
        return StepOutput(rows, results, verify=multi)

    def _timed(self, took: float, inputs: List[List[int]], chunks: List[Optional[List[int]]]) -> None:
        """The step's time, to the mixed-prefill choice: a mixed step beside a decode step as
        wide as its decode rows (1 + the drafts of the widest)."""
        prompt_tokens = sum(len(c) for c in chunks if c is not None)
        width = max([len(i) for i, c in zip(inputs, chunks) if c is None], default=1)
        if prompt_tokens:
            self.mixing.mixed_timed(took, prompt_tokens, width)
            self.stats["mixed_steps"] += 1
        else:
            self.mixing.decode_timed(took, width)

    def _count(self, rows: List[RunningSession], joining: List[RunningSession]) -> None:
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


def _read(unread: Tuple[List[RunningSession], SampledStep], rows: List[RunningSession]) -> StepOutput:
    """What a pipelined step drew for `rows` (rows of it still running); waits for the tokens."""
    step_rows, drawn = unread
    at = {id(s): i for i, s in enumerate(step_rows)}
    values = drawn.tokens.tolist()
    results = [RowResult(None, drawn.errors[i]) if i in drawn.errors else
               RowResult([values[i]], logprobs=drawn.logprobs[i]) for i in (at[id(s)] for s in rows)]
    return StepOutput(rows, results)
