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
  step N's tokens while step N+1 runs. A step is not sent when every row already has all the
  tokens it may generate in flight (a batch of one then stops as mlx-lm's generate does).
- stepped (drafts, or mixed prefill): the leader reads the logits, samples on its own sampler
  or verifies the drafts (lockstep.sampling.acceptance), and sends the next inputs.

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
from .sampling.acceptance import greedy_rounds, sampled_round
from .sampling.options import SamplingOptions
from .sampling.row_sampling import RowSampler, sample_batch, stream_seed
from .speculative import Drafter, Speculation


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """One generation as the batch takes it: the prompt's tokens, how many it may generate,
    how it samples; logprobs: keep the distribution each token was drawn from;
    num_draft_tokens: drafts a round (None: the batch's; 0: none); reuse: the stored prompt
    cache it starts from (lockstep.caches.prompt_cache); kv: a fresh cache's quantization (the
    SESSION_CREATE code)."""

    prompt: Tuple[int, ...]
    max_tokens: int
    options: SamplingOptions = SamplingOptions()
    logprobs: bool = False
    num_draft_tokens: Optional[int] = None
    reuse: Reuse = Reuse()
    kv: int = 0


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """The batch's shape: rows decoded at once, prompt tokens a prefilling row carries in a
    decode step (0: prompts prefill in forwards of their own), decode steps between logits
    hash checks with the workers (0: none)."""

    max_batch: int = 1
    mixed_prefill: int = 0
    debug_hash: int = 0


class Row:
    """One session as the leader keeps it (see the module docstring)."""

    def __init__(self, rid: int, request: BatchRequest, sampler: RowSampler, drafter: Optional[Drafter]):
        self.id = rid
        self.request = request
        self.todo = list(request.prompt[request.reuse.keep:-1])  # prompt tokens still to prefill
        self.next_input = request.prompt[-1]
        self.generated: List[int] = []
        self.sampler = sampler
        self.drafter = drafter
        # Pipelined: True while the step last sent takes in this row's token of the step
        # before (EVAL_PENDING): when that token is read, it is in the cache already. A token
        # read before the next step is sent (read_ahead) is not, and goes in as its own input.
        self.fed_all = False

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
        self.ready: List[Row] = []  # prefilled, waiting for a row of the batch
        self.running: List[Row] = []  # the rows of the batch, in row order
        self._unread: Optional[Tuple[List[Row], SampledStep]] = None  # sent, not read
        self.first_unread = False  # the unread step made a row's first token
        self._ids = itertools.count(1)
        self.stats = {"decode_steps": 0, "decode_batch_rows": 0, "verify_steps": 0, "mixed_steps": 0,
                      "drafted_tokens": 0, "accepted_tokens": 0, "prefilled_tokens": 0}

    # -- a row's life -----------------------------------------------------------
    def insert(self, request: BatchRequest) -> int:
        """A new session on every rank, from its stored prefix (SESSION_CREATE, REWIND), with
        its sampler (pipelined: on every rank, SAMPLER) and its drafter; its id. Its prompt
        is prefilled next (prefill), then it joins (join)."""
        if not request.prompt:
            raise ValueError("the prompt has zero tokens; give a non-empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens} must be >= 1")
        rid = next(self._ids)
        reuse = request.reuse
        self.sessions.send(Create, rid, reuse.cache_id, reuse.mode, request.kv)
        if reuse.needs_rewind:
            self.sessions.send(Rewind, rid, reuse.keep, 0)
        seed = stream_seed(request.options)
        if self.pipelined:
            self.sessions.send(Sampler, rid, request.options, request.prompt, seed)
            sampler = self.sessions.row_sampler(rid)
        else:
            sampler = RowSampler(request.options, request.prompt, seed, self.sessions.vocab,
                                 grammar=self.sessions.row_grammar(request.options.grammar))
        sampler.keep_logprobs = request.logprobs
        drafter = None
        if self.speculation is not None and Speculation.drafts_for(request.options, request.logprobs,
                                                                   request.num_draft_tokens):
            drafter = self.speculation.drafter(request.prompt, sampler)
        self.rows[rid] = Row(rid, request, sampler, drafter)
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

    def join(self, ids: Sequence[int]) -> None:
        """Prefilled rows: they join the batch at the next step with a free row."""
        self.ready.extend(self.rows[rid] for rid in ids)

    def remove(self, rid: int, store_as: int = 0) -> None:
        """End a session on every rank (SESSION_DESTROY), its cache stored as `store_as` (0:
        dropped); it leaves the batch, or the queue it waited in."""
        row = self.rows.pop(rid)
        self.sessions.send(Destroy, rid, store_as)
        self.ready = [r for r in self.ready if r is not row]
        self.running = [r for r in self.running if r is not row]

    @property
    def has_rows(self) -> bool:
        """Whether a step has rows to run (sessions decoding or waiting to join)."""
        return bool(self.running or self.ready)

    def free_rows(self) -> int:
        """Rows of max_batch the next step leaves free, once the waiting sessions joined."""
        return max(self.settings.max_batch - len(self.running) - len(self.ready), 0)

    def clear(self, sessions: Optional[LeaderSessions] = None) -> None:
        """Forget every row (the pair failed: its tables went with it); `sessions`: decode
        over a pair joined anew from now on."""
        self.rows, self.ready, self.running, self._unread, self.first_unread = {}, [], [], None, False
        if sessions is not None:
            self.sessions = sessions

    # -- the steps ----------------------------------------------------------------
    def step(self, entering: Sequence[int] = ()) -> Optional[StepOutput]:
        """One step over the batch and the rows joining it (`entering`: prefilling rows a
        mixed step carries from now on); what it produced, or, pipelined, what the step
        before it produced (None when nothing was unread)."""
        room = self.settings.max_batch - len(self.running)
        joining, self.ready = self.ready[:room], self.ready[room:]
        rows = self.running + joining
        if self.pipelined:
            if not joining and self._all_in_flight():
                return self.read_ahead()  # every row's last token is in flight: nothing to send
            return self._pipelined(rows, joining)
        out = self._stepped(rows + [self.rows[rid] for rid in entering], joining)
        self.running = out.rows
        return out

    def _all_in_flight(self) -> bool:
        """Whether the unread step holds the last token every running row may generate."""
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

    def _stepped(self, rows: List[Row], joining: List[Row]) -> StepOutput:
        """One step whose inputs the leader chose from the last one's tokens: a prompt chunk
        (mixed), the input token and its drafts (verify), or the input token alone."""
        mixed = self.settings.mixed_prefill
        chunks = [r.todo[:mixed] if r.todo else None for r in rows]
        drafts = [[] if c is not None else self._propose(r) for r, c in zip(rows, chunks)]
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

    def _propose(self, row: Row) -> List[int]:
        if row.drafter is None:
            return []
        k = self.speculation.round_size(row.request.num_draft_tokens, row.room())
        return row.drafter.propose(list(row.request.prompt) + row.generated, k) if k > 0 else []

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
