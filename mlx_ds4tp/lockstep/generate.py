"""One generation and what it measures: the single-process reference, and the pair's
generation as one session of the lockstep protocol (what `ds4tp run` runs).

The pair's generation is the serving sessions used for one sequence: SESSION_CREATE, the
prompt but its last token as SYNC chunks, one DECODE (the prompt's last token is the first
step's input, as in mlx_lm.generate; both ranks then sample for themselves, each step built
while the last computes: lockstep.pipelined), SESSION_DESTROY. The session decodes on its own
cache, so its tokens are the single process's, token for token.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Callable, Collection, List, Optional, Sequence

from .. import gate_ops
from .compute import PREFILL_STEP, argmax_token, forward, make_cache, prefill
from .pipelined import DecodePlan
from .sampling import SamplingOptions
from .sessions import LeaderSessions


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
    processed as the pair processes it (prefill)."""
    cache = make_cache(model)
    stats = GenerationStats(prompt_tokens=len(prompt_tokens))
    t0 = time.perf_counter()
    stats.tokens.append(argmax_token(prefill(model, prompt_tokens, cache)))
    stats.prompt_sec = time.perf_counter() - t0
    t1 = time.perf_counter()
    while len(stats.tokens) < max_tokens and stats.tokens[-1] not in eos:
        stats.tokens.append(argmax_token(forward(model, [stats.tokens[-1]], cache)))
        stats.decode_tokens += 1
    stats.decode_sec = time.perf_counter() - t1
    return stats


def pair_generate(sessions: LeaderSessions, prompt: Sequence[int], max_tokens: int,
                  sampling: SamplingOptions = SamplingOptions(), *,
                  on_token: Optional[Callable[[int], None]] = None, eos: Collection[int] = frozenset(),
                  debug_hash: int = 0, session: int = 1, prefill_step: int = PREFILL_STEP,
                  seed: Optional[int] = None) -> GenerationStats:
    """The leader's side of one generation on the pair, as one session (see the module
    docstring), sampled as mlx-lm samples with `sampling`. Every `debug_hash` decode tokens
    the logits' hashes are compared with the worker's, and the tokens' at the end
    (LockstepDivergence stops both). seed: the random stream of a sampled generation whose
    options carry none (default: a fresh one)."""
    if not prompt:
        raise ValueError("the prompt encodes to zero tokens; give a non-empty prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    prompt = list(prompt)
    stats = GenerationStats(prompt_tokens=len(prompt))
    if sampling.seed is not None:
        seed = sampling.seed
    elif seed is None:
        seed = secrets.randbits(63)
    sessions.create(session)
    t0 = time.perf_counter()
    head = prompt[:-1]
    for start in range(0, len(head), prefill_step):
        sessions.prefill(session, head[start:start + prefill_step])
    first = {}

    def seen(token: int) -> None:
        if not first:  # the prompt's last token went through with the first step
            first["at"] = time.perf_counter()
            first["exchanged"] = sessions.group.exchange_seconds()
        if on_token is not None:
            on_token(token)

    plan = DecodePlan.for_prompt(session, sessions.table.step_count + 1, prompt, max_tokens, sampling,
                                 seed, eos, debug_hash)
    stats.tokens = sessions.decode(plan, on_token=seen).tokens
    end = time.perf_counter()
    stats.prompt_sec = first["at"] - t0
    stats.decode_tokens = len(stats.tokens) - 1
    stats.decode_sec = end - first["at"]
    stats.decode_exchange_sec = sessions.group.exchange_seconds() - first["exchanged"]
    sessions.destroy(session)
    return stats
