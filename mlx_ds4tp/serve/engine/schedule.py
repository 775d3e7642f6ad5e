"""The engine's one scheduler: `plan_turn` decides each turn of `ds4tp serve`'s engine, from
what the engine holds at the turn's start, and returns the decision as one frozen TurnPlan
that the engine (serve/engine/loop.py) carries out and the leader's batch (lockstep/batch.py)
executes without choosing anything itself. Each turn it decides:

- who leaves unfinished: cancelled requests still waiting (dropped), cancelled rows (ended on
  every rank, their caches not stored);
- who is admitted: waiting requests in arrival order while the KV budget has room for their
  prompt and every token they may generate (the head waits for room, and the rest behind it),
  and who is refused because more than max_queued would wait (the newest: a BusyEvent);
- whether the last pipelined step's tokens are read first: a prompt waiting to prefill or to
  join, or a first token in that step, is not held back by a chunk or a step;
- which prompts prefill in a forward of their own, and how much: one chunk of each of the
  oldest (up to prompt_concurrency) in one padded forward of at most prefill_step tokens, the
  rows sharing it evenly and a short prompt taking only what it needs;
- whether the decode step carries prompt tokens instead (--mixed-prefill: the cheaper of the
  two as measured, serve/engine/mixing.py's estimates), and which prompts it takes in;
- which prefilled rows join the step (up to max_batch rows), and how many drafts each
  drafting row proposes (at most one less than the tokens it may still generate);
- whether no step is sent at all: pipelined, every row's last token already in flight.

A turn that admits requests plans nothing else: their rows exist (their stored prefixes looked
up) once it is carried out, and the next turn, which follows at once, plans their prefill with
everything else. Rows that end by their tokens (an eos, a stop string, max_tokens) end as the step's
output is routed (serve/engine/finishing.py), since no plan can know those in advance.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from ...lockstep.batch import Row, StepPlan
from ...lockstep.protocol.commands.limits import MAX_PREFILL_ROWS, MAX_TOKENS_PER_FRAME
from ...lockstep.speculative import Speculation
from ..limits import ServeLimits
from .mixing import PROBE_EVERY, MixEstimates


@dataclasses.dataclass(frozen=True)
class Queued:
    """A request waiting for room in the KV budget: its id, the cache tokens it may come to
    hold, and whether it was cancelled while it waited."""

    id: int
    kv_tokens: int
    cancelled: bool = False


@dataclasses.dataclass(frozen=True)
class ScheduleLimits:
    """What the scheduler plans within, resolved once from ServeLimits (for_limits)."""

    max_batch: int = 32
    kv_budget: int = 0  # 0: no budget
    max_queued: int = 64
    prefill_step: int = 2048  # tokens of one prefill forward, padding included
    prompt_concurrency: int = 8  # prompts prefilled together in one forward
    mixed_prefill: int = 0  # prompt tokens a prefilling row carries in a decode step (0: never)

    @classmethod
    def for_limits(cls, limits: ServeLimits) -> "ScheduleLimits":
        # One forward's activations (the attention scores above all) never outgrow those of one
        # session's chunk, and no more than one PREFILL_BATCH frame carries.
        return cls(limits.max_batch, limits.kv_budget, limits.max_queued,
                   min(limits.prefill_step, MAX_TOKENS_PER_FRAME),
                   max(1, min(limits.prompt_concurrency, MAX_PREFILL_ROWS)), limits.mixed_prefill)


@dataclasses.dataclass(frozen=True)
class TurnState:
    """What the engine holds at a turn's start, as the scheduler reads it (nothing is written):
    the requests waiting for admission in arrival order and the KV tokens reserved by those
    started; the rows prefilling (oldest first), prefilled and waiting for a batch row, and in
    the batch; whether the batch pipelines, whether a pipelined step is unread, whether it made
    a row's first token, whether it holds every running row's last token; the mixed-prefill
    estimates; the speculation rows draft by (None: no drafting)."""

    waiting: Tuple[Queued, ...] = ()
    reserved: int = 0
    prefilling: Tuple[Row, ...] = ()
    ready: Tuple[Row, ...] = ()
    running: Tuple[Row, ...] = ()
    pipelined: bool = True
    unread: bool = False
    first_unread: bool = False
    all_in_flight: bool = False
    mix: MixEstimates = MixEstimates()
    speculation: Optional[Speculation] = None


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """One turn, decided (see the module docstring), in the order the engine carries it out:
    drop (waiting request ids cancelled), end (row ids cancelled), refuse (waiting request ids
    refused: the queue is full), admit (waiting request ids that start, in order), read_ahead
    (read the last pipelined step's tokens first), prefill ((row id, prompt tokens) of one
    padded forward), step (the decode step, None: none is sent); mix_decided: this turn made a
    measured mixed-prefill decision (counted for the next probe)."""

    drop: Tuple[int, ...] = ()
    end: Tuple[int, ...] = ()
    refuse: Tuple[int, ...] = ()
    admit: Tuple[int, ...] = ()
    read_ahead: bool = False
    prefill: Tuple[Tuple[int, int], ...] = ()
    step: Optional[StepPlan] = None
    mix_decided: bool = False


def plan_turn(state: TurnState, limits: ScheduleLimits) -> TurnPlan:
    """This turn's plan (see the module docstring)."""
    drop = tuple(q.id for q in state.waiting if q.cancelled)
    ended = [r for r in state.prefilling + state.ready + state.running if r.cancelled]
    reserved = state.reserved - sum(r.request.kv_tokens for r in ended)
    admit, refuse = _admission([q for q in state.waiting if not q.cancelled], reserved, limits)
    if admit:
        # A turn that admits does only that: the next one, at once, plans the admitted rows'
        # prefill with the rest (their prompts' stored prefixes are known only once they start).
        return TurnPlan(drop, tuple(r.id for r in ended), refuse, admit)
    prefilling = [r for r in state.prefilling if not r.cancelled]
    ready = [r for r in state.ready if not r.cancelled]
    running = [r for r in state.running if not r.cancelled]
    free_rows = max(limits.max_batch - len(running) - len(ready), 0)
    mix, mix_decided = False, False
    if (running or ready) and free_rows > 0 and limits.mixed_prefill and prefilling:
        mix, mix_decided = mixes(state.mix)
    read_ahead = state.unread and bool(prefilling or ready or state.first_unread)
    prefill = () if mix or not prefilling else prefill_chunk(prefilling, limits)
    chunked = dict(prefill)
    ready += [r for r in prefilling if r.id in chunked and chunked[r.id] >= len(r.todo)]
    step = None
    if running or ready:
        join = ready[:max(limits.max_batch - len(running), 0)]
        if state.pipelined and not join and state.all_in_flight and not read_ahead:
            read_ahead = True  # every row's last token is in flight: read it, send nothing
        else:
            enter = prefilling[:free_rows] if mix else []
            chunks = _mixed_chunks(running + enter, limits.mixed_prefill)
            carrying = {rid for rid, _ in chunks}
            step = StepPlan(join=tuple(r.id for r in join), enter=tuple(r.id for r in enter), chunks=chunks,
                            drafts=_drafts([r for r in running + join if r.id not in carrying], state.speculation))
    return TurnPlan(drop, tuple(r.id for r in ended), refuse, admit, read_ahead, prefill, step, mix_decided)


def _admission(waiting: Sequence[Queued], reserved: int, limits: ScheduleLimits) -> Tuple[Tuple[int, ...], ...]:
    """(who starts, who is refused): the oldest while the budget has room; then, of those still
    waiting, the newest past max_queued."""
    admit: List[int] = []
    for queued in waiting:
        if limits.kv_budget and reserved + queued.kv_tokens > limits.kv_budget:
            break  # the head waits for room, and the rest behind it
        reserved += queued.kv_tokens
        admit.append(queued.id)
    still = waiting[len(admit):]
    return tuple(admit), tuple(q.id for q in still[limits.max_queued:])


def prefill_chunk(prefilling: Sequence[Row], limits: ScheduleLimits) -> Tuple[Tuple[int, int], ...]:
    """One chunk of each of the oldest prompts, (row id, tokens), for one padded forward of at
    most prefill_step tokens: the rows share it evenly, a short prompt takes only what it needs."""
    oldest = prefilling[:limits.prompt_concurrency]
    width = min(max(len(r.todo) for r in oldest), max(limits.prefill_step // len(oldest), 1))
    count = max(1, min(len(oldest), limits.prefill_step // width))
    return tuple((r.id, min(len(r.todo), width)) for r in oldest[:count])


def mixes(estimates: MixEstimates) -> Tuple[bool, bool]:
    """(whether a turn with prompts to prefill and rows to decode mixes them in the decode step,
    whether that was a measured decision): the cheaper per prompt token as measured
    (serve/engine/mixing.py), the other tried once every PROBE_EVERY decisions; until both are
    measured, the missing one is. Policy "always" mixes whenever there is something to mix."""
    if estimates.policy == "always":
        return True, False
    if estimates.separate_per_token is None or not estimates.decode_timed:
        return False, False  # measure the separate forwards (and a plain decode step) first
    decision = estimates.decisions + 1
    probe = decision % PROBE_EVERY == 1
    if estimates.mixed_per_token is None:
        # Tried on the first decision and every PROBE_EVERY after, until a mixed step can be
        # set beside a decode step of its width.
        return probe, True
    cheaper = estimates.mixed_per_token < estimates.separate_per_token
    return ((not cheaper) if probe and decision > 1 else cheaper), True


def _mixed_chunks(rows: Sequence[Row], width: int) -> Tuple[Tuple[int, int], ...]:
    """The prompt tokens each row still prefilling carries in a mixed step."""
    return tuple((r.id, min(width, len(r.todo))) for r in rows if r.todo)


def _drafts(rows: Sequence[Row], speculation: Optional[Speculation]) -> Tuple[Tuple[int, int], ...]:
    """The drafts each drafting row of `rows` (the step's decode rows) proposes this round."""
    if speculation is None:
        return ()
    sizes = ((r.id, speculation.round_size(r.request.num_draft_tokens, r.room()))
             for r in rows if r.drafter is not None)
    return tuple((rid, k) for rid, k in sizes if k > 0)
