"""One generation and what it measures: the single-process reference, and the pair's
generation as one session of the lockstep protocol (what `ds4tp run` runs): SESSION_CREATE,
the prompt but its last token as PREFILL_BATCH chunks, SAMPLER, then one EVAL_BATCH a token
(the prompt's last token is the first step's input, as in mlx_lm.generate), HASH of the tokens
sampled, and SESSION_DESTROY. A batch of one row is the session's own cache
(lockstep.decode_batch), so its tokens are the single process's, token for token.

Decode is pipelined as mlx-lm's generate_step is (docs/two-macs.md, `ds4tp run`): step n+1 is queued, its
input this rank's own sample of step n (EVAL_PENDING), before step n's token is read. Both ranks
stop at the same token because the leader stops sending steps; where the token read is an end
of sequence, the step after it is already running on both, and is finished before the session
ends.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Collection, List, Optional, Sequence

import mlx.core as mx

from .. import gate_ops
from .commands import EVAL_PENDING
from .compute import PREFILL_STEP, fill_cache, forward, make_cache
from .row_sampling import stream_seed
from .sampling import SamplingOptions
from .sessions import LeaderSessions

# The session id a generation on its own runs as (it is destroyed at the end, so the next one
# takes it again).
SESSION = 1


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

    def exchange_ms_per_token(self) -> float:
        return self.decode_exchange_sec / self.decode_tokens * 1e3 if self.decode_tokens else 0.0

    def line(self, group: gate_ops.Group) -> str:
        """The closing stats line of `ds4tp run`."""
        p50, p99 = group.gate_latency_us()
        prompt_tps = self.prompt_tokens / self.prompt_sec if self.prompt_sec else 0.0
        decode_tps = self.decode_tokens / self.decode_sec if self.decode_sec else 0.0
        share = self.decode_exchange_sec / self.decode_sec * 100 if self.decode_sec else 0.0
        return (
            f"prompt {self.prompt_tokens} tokens {prompt_tps:.1f} tok/s | decode {self.decode_tokens} "
            f"tokens {decode_tps:.1f} tok/s | transport {group.transport} | gate p50 {p50:.1f} us "
            f"p99 {p99:.1f} us | exchanges {self.exchange_ms_per_token():.2f} ms/token "
            f"({share:.0f}% of decode, waits for the peer included)"
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


def open_session(sessions: LeaderSessions, prompt: Sequence[int], max_tokens: int) -> None:
    """SESSION_CREATE and the prompt but its last token prefilled (PREFILL_BATCH chunks of
    PREFILL_STEP tokens) on both ranks: the start of every generation on the pair."""
    if not prompt:
        raise ValueError("the prompt encodes to zero tokens; give a non-empty prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    sessions.create(SESSION)
    head = list(prompt[:-1])
    for start in range(0, len(head), PREFILL_STEP):
        sessions.prefill_batch([(SESSION, head[start:start + PREFILL_STEP])])


def pair_generate(sessions: LeaderSessions, prompt: Sequence[int], max_tokens: int,
                  sampling: SamplingOptions = SamplingOptions(), *,
                  on_token: Optional[Callable[[int], None]] = None, eos: Collection[int] = frozenset(),
                  debug_hash: int = 0) -> GenerationStats:
    """The leader's side of one generation on the pair, as one session (see the module
    docstring), sampled as mlx-lm samples with `sampling` (options without a seed draw from a
    fresh one). Every `debug_hash` decode tokens the logits' hashes are compared with the
    worker's, and the sampled tokens' at the end (LockstepDivergence stops both)."""
    prompt = list(prompt)
    stats = GenerationStats(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    open_session(sessions, prompt, max_tokens)
    sessions.sampler(SESSION, sampling, prompt, stream_seed(sampling))
    sessions.step([(SESSION, prompt[-1])])
    first_step = sessions.table.batch.step_count
    while True:
        drawn = sessions.table.batch.pending[SESSION]
        ahead = len(stats.tokens) + 1 < max_tokens
        if ahead:
            sessions.step([(SESSION, EVAL_PENDING)])  # queued before `drawn` is read
            decoded = sessions.table.batch.step_count - first_step  # the token this step makes
            if debug_hash and decoded % debug_hash == 0:
                sessions.check_hash()
        (token,) = sessions.read(drawn)
        if not stats.tokens:  # the prompt's last token went through with the first step
            first_at, first_exchanged = time.perf_counter(), sessions.group.exchange_seconds()
        stats.tokens.append(token)
        if on_token is not None:
            on_token(token)
        if not ahead or token in eos:
            break
    if ahead:  # the step after the end of sequence: both ranks queued it, both finish it
        sessions.read(sessions.table.batch.pending[SESSION])
    sessions.check_hash(SESSION)
    stats.prompt_sec = first_at - t0
    stats.decode_tokens = len(stats.tokens) - 1
    stats.decode_sec = time.perf_counter() - first_at
    stats.decode_exchange_sec = sessions.group.exchange_seconds() - first_exchanged
    sessions.destroy(SESSION)
    return stats
