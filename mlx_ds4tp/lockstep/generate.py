"""One generation and what it measures: the single-process reference, and the pair's
generation as a batch of one (lockstep.batch, what `ds4tp run` runs): SESSION_CREATE, the
prompt but its last token as PREFILL_BATCH chunks, then the batch's steps (pipelined, or
speculative rounds when it drafts), HASH of the tokens sampled, and SESSION_DESTROY. A batch
of one row is the session's own cache (lockstep.protocol.decode_batch), so its tokens are the single
process's, token for token.

Decode is pipelined as mlx-lm's generate_step is (docs/two-macs.md, `ds4tp run`): step n+1 is
queued, its input this rank's own sample of step n (EVAL_PENDING), before step n's token is
read. Both ranks stop at the same token because the leader stops sending steps; where the
token read is an end of sequence, the step after it is already running on both, and is
finished before the session ends.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Collection, List, Optional, Sequence

import mlx.core as mx

from .. import gate_ops
from .batch import Batch, BatchSettings, StepPlan
from .compute import PREFILL_STEP, fill_cache, forward, make_cache
from .protocol.sessions import LeaderSessions
from .request import GenerationRequest
from .sampling.options import SamplingOptions
from .speculative import Speculation


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_sec: float = 0.0
    decode_tokens: int = 0
    decode_sec: float = 0.0
    # Of decode_sec, the time this rank spent in gates, bulk exchanges and signature checks,
    # waiting for the peer included (gate_ops.Group.exchange_seconds).
    decode_exchange_sec: float = 0.0
    tokens: List[int] = dataclasses.field(default_factory=list)
    # Speculative decoding: tokens drafted, drafts accepted, verify rounds (0 when it did not draft).
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    def exchange_ms_per_token(self) -> float:
        return self.decode_exchange_sec / self.decode_tokens * 1e3 if self.decode_tokens else 0.0

    def line(self, group: gate_ops.Group) -> str:
        """The closing stats line of `ds4tp run`."""
        p50, p99 = group.gate_latency_us()
        prompt_tps = self.prompt_tokens / self.prompt_sec if self.prompt_sec else 0.0
        decode_tps = self.decode_tokens / self.decode_sec if self.decode_sec else 0.0
        share = self.decode_exchange_sec / self.decode_sec * 100 if self.decode_sec else 0.0
        head = (f"prompt {self.prompt_tokens} tokens {prompt_tps:.1f} tok/s | decode {self.decode_tokens} "
                f"tokens {decode_tps:.1f} tok/s | transport {group.transport}")
        return (
            f"{head} | gate p50 {p50:.1f} us "
            f"p99 {p99:.1f} us | exchanges {self.exchange_ms_per_token():.2f} ms/token "
            f"({share:.0f}% of decode, waits for the peers included)"
        )


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> List[int]:
    """The prompt's tokens: through the model's chat template when it has one and `chat`."""
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def bench_prompt(tokenizer, text: str, count: int) -> List[int]:
    """`text`'s tokens repeated (and cut) to exactly `count` tokens: a prompt of a chosen
    length that every contender of the model bench feeds alike."""
    if count < 1:
        raise ValueError(f"a prompt of {count} tokens: give at least 1")
    base = list(tokenizer.encode(text)) or [0]
    return (base * (count // len(base) + 1))[:count]


def greedy_generate(model, prompt_tokens: List[int], max_tokens: int, eos=frozenset()) -> GenerationStats:
    """A plain single-model greedy generation (tokens, prompt and decode seconds): the
    reference the pair must match, and the single-process benchmark. The prompt is
    processed as the pair processes it: all but its last token only fill the cache, the last
    one's logits pick the first generated token (mlx-lm's generate_step)."""
    if not prompt_tokens:
        raise ValueError("the prompt has zero tokens; give a non-empty prompt")
    cache = make_cache(model)
    stats = GenerationStats(prompt_tokens=len(prompt_tokens))
    t0 = time.perf_counter()
    fill_cache(model, prompt_tokens[:-1], cache)
    stats.tokens.append(int(mx.argmax(forward(model, prompt_tokens[-1:], cache)).item()))
    stats.prompt_sec = time.perf_counter() - t0
    t1 = time.perf_counter()
    while len(stats.tokens) < max_tokens and stats.tokens[-1] not in eos:
        stats.tokens.append(int(mx.argmax(forward(model, [stats.tokens[-1]], cache)).item()))
        stats.decode_tokens += 1
    stats.decode_sec = time.perf_counter() - t1
    return stats


def pair_generate(sessions: LeaderSessions, prompt: Sequence[int], max_tokens: int,
                  sampling: SamplingOptions = SamplingOptions(), *,
                  on_token: Optional[Callable[[int], None]] = None, eos: Collection[int] = frozenset(),
                  debug_hash: int = 0, speculation: Optional[Speculation] = None) -> GenerationStats:
    """The leader's side of one generation on the pair, a batch of one (see the module
    docstring), sampled as mlx-lm samples with `sampling` (options without a seed draw from a
    fresh one); `speculation`: it drafts (its stats then count the drafts and rounds). Every
    `debug_hash` decode steps the logits' hashes are compared with the worker's, and the
    sampled tokens' at the end (LockstepDivergenceError stops both)."""
    stats = GenerationStats(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    batch = Batch(sessions, BatchSettings(debug_hash=debug_hash), speculation)
    rid = batch.insert(GenerationRequest(tuple(prompt), max_tokens, sampling))
    row = batch.row(rid)
    while row.todo:
        batch.prefill([(rid, PREFILL_STEP)])
    join: tuple = (rid,)  # the first step takes the prefilled row in
    first_at = first_exchanged = None
    if speculation is not None:  # every round is a decode round, the first one too
        first_at, first_exchanged = time.perf_counter(), sessions.group.exchange_seconds()
    done = False
    while not done:
        if batch.all_in_flight():
            out = batch.read_ahead()  # its last token is in flight: no step to send
        else:
            k = speculation.round_size(None, row.room()) if row.drafter is not None else 0
            out = batch.step(StepPlan(join=join, drafts=((rid, k),) if k else ()))
            join = ()
        if out is None:
            continue  # the first pipelined step: sent, nothing read yet
        result = out.results[0]
        if result.tokens is None:
            raise RuntimeError(f"the generation's sampler failed: {result.error}")
        if first_at is None:
            first_at, first_exchanged = time.perf_counter(), sessions.group.exchange_seconds()
        used = 0
        for token in result.tokens:
            used += 1
            stats.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos or len(stats.tokens) >= max_tokens:
                done = True
                break
        batch.commit(out, [used])
    sessions.check_hash(rid)
    stats.prompt_sec = first_at - t0
    # The first token came with the prompt; a speculative round's all count as decoded.
    stats.decode_tokens = len(stats.tokens) - (1 if speculation is None else 0)
    stats.decode_sec = time.perf_counter() - first_at
    stats.decode_exchange_sec = sessions.group.exchange_seconds() - first_exchanged
    stats.drafted, stats.accepted = batch.stats["drafted_tokens"], batch.stats["accepted_tokens"]
    stats.rounds = batch.stats["decode_steps"] if speculation is not None else 0
    batch.remove(rid)
    return stats
