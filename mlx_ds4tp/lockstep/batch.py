"""The leader's one batch, shaped like mlx-lm's BatchGenerator: `insert` a request (its id),
`step` (what each row produced), `remove` it. `ds4tp run` is a batch of one through it,
`ds4tp serve`'s engine drives it for many; both decode, speculate and sample here alike.

It owns what the leader keeps of each session (Row): the tokens still to prefill, the next
input, the tokens it produced, its sampler and drafter; the command order on the pair
(lockstep.protocol.sessions: SESSION_CREATE, REWIND, SAMPLER, PREFILL_BATCH, EVAL_BATCH,
VERIFY_BATCH, COMMIT_BATCH, SESSION_DESTROY); and the kind of step:

- pipelined (no drafts, no mixed prefill): both ranks sample every row inside the step's
  graph (SAMPLER), and each step is sent and queued before the last one's tokens are read,
  its rows taking each rank's own sample of the last step (EVAL_PENDING): the leader reads
  step N's tokens while step N+1 runs. The caller sends no step when every row already has
  all the tokens it may generate in flight (all_in_flight: it reads ahead instead, and a
  batch of one then stops as mlx-lm's generate does).
- stepped (drafts, or mixed prefill): the leader reads the logits, samples on its own sampler
  or verifies the drafts (lockstep.sampling.acceptance), and sends the next inputs.

Which rows join a step, which prefilling rows carry how many prompt tokens, and how many
drafts each row proposes are the caller's to decide (a StepPlan: serve/engine/schedule.py
decides them for `ds4tp serve`); the batch carries a plan out and holds no policy.

As in mlx_lm.generate, a prompt's last token is the first decode input: the prefill covers
the others, so each session's tokens are what mlx-lm generates for it alone. The ranks are a
value here (the session table's commands go to every worker alike, lockstep.protocol.sessions), not a
constant two.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .caches.prompt_cache import Reuse
from .protocol.commands import (
    EVAL_PENDING,
    CommitBatch,
    Create,
    Destroy,
    EvalBatch,
    PrefillBatch,
    Rewind,
    Sampler,
    VerifyBatch,
)
from .protocol.sessions import LeaderSessions, SampledStep
from .request import GenerationRequest
from .sampling.acceptance import greedy_rounds, sampled_round
from .sampling.row_sampling import RowSampler, sample_batch, stream_seed
from .speculative import Drafter, Speculation

NO_REUSE = Reuse()  # a fresh cache: no stored prefix taken


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """The batch's kind: whether its steps may carry prompt chunks (mixed prefill: stepped,
    each step's chunks planned by the caller), decode steps between logits hash checks with the
    workers (0: none). How many rows a step takes is the caller's plan (StepPlan.join)."""

    mixed_prefill: bool = False
    debug_hash: int = 0


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step carries, as its caller decided (serve/engine/schedule.py, or `ds4tp run`'s
    batch of one): the prefilled rows that join the batch at it, the prefilling rows a mixed step
    takes in from now on, the prompt tokens each row still prefilling carries in it (row id,
    tokens), and the drafts each drafting row proposes (row id, at most k). The batch carries a
    plan out; it chooses nothing."""

    join: Tuple[int, ...] = ()
    enter: Tuple[int, ...] = ()
    chunks: Tuple[Tuple[int, int], ...] = ()
    drafts: Tuple[Tuple[int, int], ...] = ()


class Row:
    """One session as the leader keeps it, from its insert to its remove (see the module
    docstring): the request, the stored prefix it started from, the prompt still to prefill,
    the next input, the tokens the batch produced for it, its sampler and drafter; and what its
    caller (the serving engine) decided of it: the tokens taken into its answer and whether it
    was cancelled. Written only by the thread that drives the batch."""

    def __init__(self, rid: int, request: GenerationRequest, reuse: Reuse, sampler: RowSampler,
                 drafter: Optional[Drafter]):
        self.id = rid
        self.request = request
        self.reuse = reuse
        self.todo = list(request.prompt[reuse.keep:-1])  # prompt tokens still to prefill
        self.next_input = request.prompt[-1]
        self.generated: List[int] = []
        self.sampler = sampler
        self.drafter = drafter
        # Pipelined: True while the step last sent takes in this row's token of the step
        # before (EVAL_PENDING): when that token is read, it is in the cache already. A token
        # read before the next step is sent (read_ahead) is not, and goes in as its own input.
        self.fed_all = False
        # The tokens taken into its answer, up to its end (a verify step may produce more).
        self.taken: List[int] = []
        self.cancelled = False

    def room(self) -> int:
        """Tokens it may still generate."""
        return self.request.max_tokens - len(self.generated)


@dataclasses.dataclass
class RowResult:
    """What a step produced for one row: its new tokens (None: its sampling failed, for
    `error`), the log-probabilities its token was drawn from (where the request asked), or,
    for a prompt row of a mixed step, the `chunk` prompt tokens it took in and no token."""

    tokens: Optional[List[int]]
    error: str = ""
    logprobs: Optional[mx.array] = None
    chunk: int = 0


@dataclasses.dataclass
class StepOutput:
    """A step's rows and what it produced for each; `verify`: a VERIFY_BATCH, whose positions
    the rows did not use are dropped by commit() before any row is removed. seconds, prompt
    and width time the step (how long, the prompt tokens it carried, its widest decode row)."""

    rows: List[Row]
    results: List[RowResult]
    verify: bool = False
    seconds: float = 0.0
    prompt_tokens: int = 0
    width: int = 1


class Batch:
    """The leader's batch (see the module docstring)."""

    def __init__(self, sessions: LeaderSessions, settings: BatchSettings = BatchSettings(),
                 speculation: Optional[Speculation] = None):
        self.sessions = sessions
        self.settings = settings
        self.speculation = speculation
        self.pipelined = speculation is None and not settings.mixed_prefill
        self.rows: Dict[int, Row] = {}
        self.running: List[Row] = []  # the rows of the batch, in row order
        self._unread: Optional[Tuple[List[Row], SampledStep]] = None  # sent, not read
        self.first_unread = False  # the unread step made a row's first token
        self._ids = itertools.count(1)
        self.stats = {"decode_steps": 0, "decode_batch_rows": 0, "verify_steps": 0, "mixed_steps": 0,
                      "drafted_tokens": 0, "accepted_tokens": 0, "prefilled_tokens": 0}

    # -- a row's life -----------------------------------------------------------
    def insert(self, request: GenerationRequest, reuse: Reuse = NO_REUSE, kv: int = 0) -> int:
        """A new session on every rank, from its stored prefix `reuse` (SESSION_CREATE, REWIND;
        `kv`: a fresh cache's quantization, the SESSION_CREATE code), with its sampler
        (pipelined: on every rank, SAMPLER) and its drafter; its id. Its prompt is prefilled
        next (prefill), then it joins a step (StepPlan.join)."""
        if not request.prompt:
            raise ValueError("the prompt has zero tokens; give a non-empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens} must be >= 1")
        rid = next(self._ids)
        self.sessions.send(Create, rid, reuse.cache_id, reuse.mode, kv)
        if reuse.needs_rewind:
            self.sessions.send(Rewind, rid, reuse.keep, 0)
        seed = stream_seed(request.options)
        if self.pipelined:
            self.sessions.send(Sampler, rid, request.options, request.prompt, seed)
            sampler = self.sessions.row_sampler(rid)
        else:
            sampler = RowSampler(request.options, request.prompt, seed, self.sessions.vocab,
                                 grammar=self.sessions.row_grammar(request.options.grammar))
        logprobs = request.logprobs is not None
        sampler.keep_logprobs = logprobs
        drafter = None
        if self.speculation is not None and Speculation.drafts_for(request.options, logprobs,
                                                                   request.num_draft_tokens):
            drafter = self.speculation.drafter(request.prompt, sampler)
        self.rows[rid] = Row(rid, request, reuse, sampler, drafter)
        return rid

    def row(self, rid: int) -> Row:
        return self.rows[rid]

    def prefill(self, chunks: Sequence[Tuple[int, int]]) -> List[int]:
        """One chunk of each (id, tokens) row's prompt in one padded forward (PREFILL_BATCH);
        the ids whose prefill that finished."""
        rows = [(self.rows[rid], count) for rid, count in chunks]
        self.sessions.send(PrefillBatch, [(row.id, row.todo[:count]) for row, count in rows])
        done = []
        for row, count in rows:
            row.todo = row.todo[count:]
            if not row.todo:
                done.append(row.id)
        return done

    def remove(self, rid: int, store_as: int = 0) -> None:
        """End a session on every rank (SESSION_DESTROY), its cache stored as `store_as` (0:
        dropped); it leaves the batch if it was in it."""
        row = self.rows.pop(rid)
        self.sessions.send(Destroy, rid, store_as)
        self.running = [r for r in self.running if r is not row]

    def clear(self, sessions: Optional[LeaderSessions] = None) -> None:
        """Forget every row (the pair failed: its tables went with it); `sessions`: decode
        over a pair joined anew from now on."""
        self.rows, self.running, self._unread, self.first_unread = {}, [], None, False
        if sessions is not None:
            self.sessions = sessions

    # -- the steps ----------------------------------------------------------------
    def step(self, plan: StepPlan = StepPlan()) -> Optional[StepOutput]:
        """One step over the batch and the rows `plan` has join it (and, mixed, the prefilling
        rows it has enter); what it produced, or, pipelined, what the step before it produced
        (None when nothing was unread, or no row is left to step)."""
        joining = [self.rows[rid] for rid in plan.join]
        rows = self.running + joining
        if self.pipelined:
            return self._pipelined(rows, joining) if rows else None
        rows += [self.rows[rid] for rid in plan.enter]
        if not rows:
            return None
        out = self._stepped(rows, joining, dict(plan.chunks), dict(plan.drafts))
        self.running = out.rows
        return out

    @property
    def unread(self) -> bool:
        """Whether a pipelined step was sent and its tokens not read yet."""
        return self._unread is not None

    def all_in_flight(self) -> bool:
        """Whether the unread step holds the last token every running row may generate (a step
        sent now would compute nothing anyone reads)."""
        if self._unread is None or not self.running:
            return False
        flying = {id(r) for r in self._unread[0]}
        return all(id(r) in flying and r.room() <= 1 for r in self.running)

    def read_ahead(self) -> Optional[StepOutput]:
        """The last step's tokens now, before a prefill chunk or the next step would hold them
        back; their rows' next inputs are then the tokens themselves, in no cache yet. None
        when nothing is unread."""
        unread, self._unread, self.first_unread = self._unread, None, False
        if unread is None or not self.running:
            return None
        for row in self.running:
            row.fed_all = False
        return self._read(unread, list(self.running))

    def commit(self, out: StepOutput, used: Sequence[int]) -> None:
        """After a verify step: every rank keeps in each row's cache the positions it used
        (all of a row's tokens, or fewer where the caller ended it early)."""
        if out.verify:
            self.sessions.send(CommitBatch, self.sessions.step_count, list(used))

    def _pipelined(self, rows: List[Row], joining: List[Row]) -> Optional[StepOutput]:
        """Send and queue this step, its running rows taking each rank's own sample of the
        last step, then read the last step's tokens while this one runs. A row that ends
        there was a row of this step too: its last token went into its cache (fed_all)."""
        last, flight = self._unread, list(self.running)  # the last step's rows, tokens unread
        drawn = self.sessions.sampled_step([(r.id, EVAL_PENDING if r.fed_all else r.next_input) for r in rows])
        for row in rows:
            row.fed_all = True
        self._unread, self.first_unread = (rows, drawn), bool(joining)
        self._count(rows, joining)
        self.running = rows
        return self._read(last, flight) if last is not None and flight else None

    def _read(self, unread: Tuple[List[Row], SampledStep], rows: List[Row]) -> StepOutput:
        """What a pipelined step drew for `rows` (rows of it still running); waits for it."""
        step_rows, drawn = unread
        at = {id(r): i for i, r in enumerate(step_rows)}
        values = self.sessions.read(drawn.tokens)
        results = []
        for row in rows:
            i = at[id(row)]
            if i in drawn.errors:
                results.append(RowResult(None, drawn.errors[i]))
                continue
            results.append(RowResult([values[i]], logprobs=drawn.logprobs[i]))
            self._took(row, [values[i]])
        return StepOutput(rows, results)

    def _stepped(self, rows: List[Row], joining: List[Row], chunk_sizes: Dict[int, int],
                 draft_sizes: Dict[int, int]) -> StepOutput:
        """One step whose inputs the leader chose from the last one's tokens: a prompt chunk
        (mixed), the input token and its drafts (verify), or the input token alone."""
        unplanned = [r.id for r in rows if r.todo and chunk_sizes.get(r.id, 0) < 1]
        if unplanned:
            raise ValueError(f"rows {unplanned} still prefill but the step's plan gives them no prompt "
                             "chunk; plan a chunk (StepPlan.chunks) for every row with prompt left")
        chunks = [r.todo[:chunk_sizes[r.id]] if r.todo else None for r in rows]
        drafts = [[] if c is not None else self._propose(r, draft_sizes.get(r.id, 0))
                  for r, c in zip(rows, chunks)]
        inputs = [c if c is not None else [r.next_input] + d for r, c, d in zip(rows, chunks, drafts)]
        multi = any(len(i) > 1 for i in inputs)
        began = time.perf_counter()
        if multi:
            logits = self.sessions.send(VerifyBatch, self.sessions.step_count + 1,
                                        [(r.id, i) for r, i in zip(rows, inputs)])
            self.stats["verify_steps"] += 1
        else:
            logits = self.sessions.send(EvalBatch, self.sessions.step_count + 1,
                                        [(r.id, i[0]) for r, i in zip(rows, inputs)])
        seconds = time.perf_counter() - began
        results: List[Optional[RowResult]] = [None] * len(rows)  # each row's, by its kind below
        for i, (row, chunk) in enumerate(zip(rows, chunks)):
            if chunk is not None:
                row.todo = row.todo[len(chunk):]
                self.stats["prefilled_tokens"] += len(chunk) + (0 if row.todo else 1)
                results[i] = RowResult([], chunk=len(chunk))
        self._count(rows, joining)
        self._sample_plain(rows, chunks, drafts, logits, multi, results)
        self._verify_drafted(rows, drafts, logits, results)
        prompt_tokens = sum(len(c) for c in chunks if c is not None)
        if prompt_tokens:
            self.stats["mixed_steps"] += 1
        width = max([len(i) for i, c in zip(inputs, chunks) if c is None], default=1)
        return StepOutput(rows, results, verify=multi, seconds=seconds, prompt_tokens=prompt_tokens, width=width)

    def _sample_plain(self, rows: List[Row], chunks, drafts, logits: mx.array, multi: bool,
                      results: List[Optional[RowResult]]) -> None:
        """The rows that decode one token this step: sampled on the leader, in one draw."""
        plain = [i for i, (c, d) in enumerate(zip(chunks, drafts)) if c is None and not d]
        if not plain:
            return
        errors: Dict[int, str] = {}
        row_logits = logits[mx.array(plain), 0] if multi else \
            (logits if len(plain) == len(rows) else logits[mx.array(plain)])
        tokens = self.sessions.read(sample_batch(row_logits, [rows[i].sampler for i in plain], errors))
        for j, i in enumerate(plain):
            if j in errors:
                results[i] = RowResult(None, errors[j])
            else:
                results[i] = RowResult([tokens[j]], logprobs=rows[i].sampler.last_logprobs)
                self._took(rows[i], [tokens[j]])

    def _verify_drafted(self, rows: List[Row], drafts, logits: mx.array, results: List[Optional[RowResult]]) -> None:
        """The rows that carried drafts: what the acceptance rule keeps of each (greedy rows
        in one argmax, sampled rows each by its own sampler)."""
        drafted = [i for i, d in enumerate(drafts) if d]
        greedy = [i for i in drafted if rows[i].sampler.key is None]
        verified: Dict[int, List[int]] = {}
        if greedy:
            picked = logits[mx.array(greedy)].astype(mx.float32)
            verified.update(zip(greedy, greedy_rounds(picked, [drafts[i] for i in greedy])))
        for i in drafted:
            if i not in verified:
                width = len(drafts[i]) + 1
                verified[i] = sampled_round(rows[i].sampler, logits[i, :width], drafts[i], rows[i].drafter.probs)
        for i in drafted:
            tokens = verified[i]
            results[i] = RowResult(tokens)
            rows[i].drafter.accepted(len(drafts[i]), len(tokens) - 1)
            self.stats["drafted_tokens"] += len(drafts[i])
            self.stats["accepted_tokens"] += len(tokens) - 1
            self._took(rows[i], tokens)

    @staticmethod
    def _propose(row: Row, k: int) -> List[int]:
        if row.drafter is None or k < 1:
            return []
        return row.drafter.propose(list(row.request.prompt) + row.generated, k)

    @staticmethod
    def _took(row: Row, tokens: List[int]) -> None:
        row.generated += tokens
        row.next_input = tokens[-1]

    def _count(self, rows: List[Row], joining: List[Row]) -> None:
        if joining:
            # Prompt tokens are computed once each: the last one is the first decode input.
            self.stats["prefilled_tokens"] += len(joining)
        self.stats["decode_steps"] += 1
        self.stats["decode_batch_rows"] = max(self.stats["decode_batch_rows"], len(rows))
        if self.settings.debug_hash and self.stats["decode_steps"] % self.settings.debug_hash == 0:
            self.sessions.check_hash()
