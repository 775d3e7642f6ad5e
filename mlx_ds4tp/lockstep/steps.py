"""Pair runs: the leader owns tokenization, the chat template and sampling and
drives the worker in lockstep over the control channel.

Commands (control frames): SESSION_CREATE (acked), SYNC (the prompt's tokens:
both ranks prefill), EVAL (one token: both ranks decode it), HASH (both ranks
compare a hash of the logits; acked), SESSION_DESTROY, STOP. Both ranks run
the same forward passes in the same order, so their gates pair up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import select
import struct
import time
from contextlib import nullcontext
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .. import gate_ops
from .. import transport as tr
from ..split.layers import gates_skipped
from ..link.wire import ACK_PAYLOAD as ACK
from ..link.wire import EVAL_PAYLOAD as EVAL
from ..link.wire import HASH_PAYLOAD as HASH
from ..link.wire import SESSION_PAYLOAD as SESSION
from ..link.wire import SYNC_HEADER
from ..errors import LockstepDivergence, TransportError

F = tr.FrameType


def logits_hash(logits: mx.array) -> int:
    """64-bit hash of the logits' bytes (identical on both ranks when in step)."""
    mx.eval(logits)
    return int.from_bytes(hashlib.blake2b(memoryview(logits).cast("B"), digest_size=8).digest(), "little")


def make_cache(model) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def forward(model, tokens: List[int], cache) -> mx.array:
    """Last position's logits (float32) for tokens appended to the cache."""
    logits = model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)
    last = logits[0, -1].astype(mx.float32)
    mx.eval(last)
    return last


# mlx-lm's generate_step default (prefill_step_size): the prompt's prefix enters the cache in
# chunks of this many tokens, so a long prompt's attention scores never take more memory than
# one chunk's.
PREFILL_STEP = 2048


def fill_cache(model, tokens: Sequence[int], cache, step: int = PREFILL_STEP) -> None:
    """Append tokens to the cache, computing nothing past the last block.

    mlx-lm's generate_step calls the whole model on the prefix and evaluates only the cache,
    so MLX never runs the lazy vocabulary projection. A split model's logits gather is eager
    (its bytes leave when it is called), so here the prefix goes through the inner model
    (`model.model`: embedding and blocks, which every supported family has) and the projection
    and the gather of every position's logits are never built. Both ranks call this with the
    same tokens, so their gates pair up chunk by chunk."""
    if step < 1:
        raise ValueError(f"prefill step {step} must be >= 1")
    inner = model.model
    # The last block's output is never read here: only its keys and values enter the cache.
    # Its gates are skipped so the eager exchange does not force the rest of it (gates_skipped).
    layers = getattr(inner, "layers", None)
    last_block = gates_skipped(layers[-1]) if isinstance(layers, (list, tuple)) and layers else nullcontext()
    with last_block:
        for start in range(0, len(tokens), step):
            inner(mx.array(tokens[start:start + step], dtype=mx.int32)[None], cache)
            mx.eval([c.state for c in cache])


def prefill(model, tokens: Sequence[int], cache, step: int = PREFILL_STEP) -> mx.array:
    """The prompt into the cache; returns the last position's logits (float32).

    As mlx-lm's generate_step: every token but the last only fills the cache (fill_cache),
    the last one is the one full forward, whose logits pick the first generated token."""
    if len(tokens) == 0:
        raise ValueError("the prompt has zero tokens; prefill needs at least one")
    fill_cache(model, tokens[:-1], cache, step)
    return forward(model, tokens[-1:], cache)


def greedy_generate(model, prompt_tokens: List[int], max_tokens: int, eos=frozenset()) -> "GenerationStats":
    """A plain single-model greedy generation (tokens, prompt and decode seconds): the
    reference the pair must match, and the single-process benchmark. The prompt is
    processed as the pair processes it (prefill)."""
    sample = make_sampler(0.0)
    cache = make_cache(model)
    stats = GenerationStats(prompt_tokens=len(prompt_tokens))
    t0 = time.perf_counter()
    stats.tokens.append(sample(prefill(model, prompt_tokens, cache)))
    stats.prompt_sec = time.perf_counter() - t0
    t1 = time.perf_counter()
    while len(stats.tokens) < max_tokens and stats.tokens[-1] not in eos:
        stats.tokens.append(sample(forward(model, [stats.tokens[-1]], cache)))
        stats.decode_tokens += 1
    stats.decode_sec = time.perf_counter() - t1
    return stats


# ============================================================================
# Leader
# ============================================================================


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


def make_sampler(temp: float) -> Callable[[mx.array], int]:
    if temp <= 0:
        return lambda logits: int(mx.argmax(logits).item())
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

    sample = mlx_lm_sampler(temp=temp)
    return lambda logits: int(sample(logits[None])[0].item())


class Leader:
    """Rank 0: tokenizes, samples, and tells the worker what to compute."""

    def __init__(self, group: gate_ops.Group, model, tokenizer, debug_hash: int = 0):
        self.group = group
        self.control = group.pair.control
        self.model = model
        self.tokenizer = tokenizer
        self.debug_hash = debug_hash
        self._session = 0

    def _ack(self, what: str) -> None:
        _, payload = self.control.recv(F.COMMAND_ACK)
        if len(payload) < ACK.size:
            raise tr.FrameError(f"COMMAND_ACK payload is {len(payload)} bytes, need at least {ACK.size}")
        session, status = ACK.unpack_from(payload)
        if status != 0:
            message = payload[ACK.size :].decode("utf-8", "replace")
            raise TransportError(f"the worker failed {what}: {message}")

    def encode(self, prompt: str, chat: bool = True) -> List[int]:
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True))
        return list(tok.encode(prompt))

    def generate(self, prompt_tokens: List[int], max_tokens: int, sampler: Callable[[mx.array], int],
                 on_token: Optional[Callable[[int], None]] = None,
                 stop_at_eos: bool = True) -> GenerationStats:
        if not prompt_tokens:
            raise ValueError("the prompt encodes to zero tokens; give a non-empty prompt")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        self._session += 1
        session = self._session
        stats = GenerationStats(prompt_tokens=len(prompt_tokens))
        self.control.send(F.SESSION_CREATE, SESSION.pack(session, max_tokens, 0))
        self._ack("to create a session")
        cache = make_cache(self.model)
        t0 = time.perf_counter()
        self.control.send(F.SYNC, SYNC_HEADER.pack(session, len(prompt_tokens), 0)
                          + np.asarray(prompt_tokens, dtype="<i4").tobytes())
        logits = self._step(prompt_tokens, cache, prefill)
        stats.prompt_sec = time.perf_counter() - t0
        eos = set(getattr(self.tokenizer, "eos_token_ids", None) or []) if stop_at_eos else set()
        t1 = time.perf_counter()
        exchanged = self.group.exchange_seconds()
        for seq in range(1, max_tokens + 1):
            token = sampler(logits)
            stats.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos or seq == max_tokens:
                break
            self.control.send(F.EVAL, EVAL.pack(session, seq, token, 0))
            logits = self._step([token], cache, forward)
            stats.decode_tokens += 1
            if self.debug_hash and seq % self.debug_hash == 0:
                self._check_hash(session, seq, logits)
        stats.decode_sec = time.perf_counter() - t1
        stats.decode_exchange_sec = self.group.exchange_seconds() - exchanged
        self.control.send(F.SESSION_DESTROY, SESSION.pack(session, 0, 0))
        return stats

    def _step(self, tokens: List[int], cache, compute: Callable = forward) -> mx.array:
        """One forward (or prefill) in lockstep with the worker; if the gates fail, prefer
        the worker's own explanation (an ERROR frame) over our 'peer closed'."""
        try:
            return compute(self.model, tokens, cache)
        except TransportError as exc:
            reason = _peer_error(self.control)
            if reason:
                raise TransportError(f"{exc}; the worker reported: {reason}") from None
            raise

    def _check_hash(self, session: int, seq: int, logits: mx.array) -> None:
        mine = logits_hash(logits)
        self.control.send(F.HASH, HASH.pack(session, seq, mine))
        _, payload = self.control.recv(F.HASH)
        _, pseq, theirs = _unpack(HASH, payload, F.HASH)
        if theirs != mine:
            raise LockstepDivergence(f"LOCKSTEP DIVERGENCE at seq {seq}: local {mine:016x} peer {theirs:016x}")

    def stop(self) -> None:
        try:
            self.control.send(F.STOP)
        except TransportError:
            pass


def _peer_error(control: tr.ControlChannel) -> Optional[str]:
    try:
        r, _, _ = select.select([control.sock], [], [], 0.5)
        if not r:
            return None
        ftype, payload = control.recv(F.ERROR, timeout=0.5)
        return payload.decode("utf-8", "replace")
    except (TransportError, OSError):
        return None


# ============================================================================
# Worker
# ============================================================================


class Worker:
    """Rank 1: computes what the leader says, in the same order, until STOP."""

    def __init__(self, group: gate_ops.Group, model):
        self.group = group
        self.control = group.pair.control
        self.model = model
        self.sessions: dict = {}
        self.last_logits: Optional[mx.array] = None
        # Token ids come off the wire and index the embedding, which MLX does
        # not bounds-check (an id past the table reads other memory or
        # crashes), so the worker checks them against the vocabulary.
        self.vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)

    def _wait_command(self) -> tuple:
        """Idle between prompts without a deadline, but notice a dead leader
        at once (EOF makes the socket readable). Inside a session the leader's
        next command is one sampling step away: wait at most the timeout
        (DS4_TP_TIMEOUT_SEC), so a stopped leader or a pulled cable mid-
        generation is an error, never a hang."""
        if self.sessions:
            self.control.poll_readable()
            try:
                return self.control.recv()
            except tr.TransportTimeoutError as exc:
                raise tr.TransportTimeoutError(
                    f"the leader sent no command for {self.control.timeout:g} s in the middle of a "
                    f"generation (DS4_TP_TIMEOUT_SEC): it is stopped or unreachable ({exc})"
                ) from None
        sock = self.control.sock
        while True:
            r, _, _ = select.select([sock], [], [], 1.0)
            if r:
                return self.control.recv()

    def serve(self) -> int:
        """Returns the number of prompts served; raises on any failure."""
        served = 0
        while True:
            ftype, payload = self._wait_command()
            if ftype == F.STOP:
                return served
            if ftype == F.SESSION_CREATE:
                session, _, _ = _unpack(SESSION, payload, ftype)
                self.sessions[session] = make_cache(self.model)
                self.control.send(F.COMMAND_ACK, ACK.pack(session, 0))
            elif ftype == F.SYNC:
                session, count, _ = _unpack_prefix(SYNC_HEADER, payload, ftype)
                tokens = np.frombuffer(payload, dtype="<i4", offset=SYNC_HEADER.size)
                if len(tokens) != count or count == 0:
                    raise tr.FrameError(f"SYNC says {count} tokens but carries {len(tokens)} "
                                        "(a prompt needs at least one)")
                self._check_tokens(tokens, ftype)
                self.last_logits = prefill(self.model, tokens.tolist(), self._cache(session))
            elif ftype == F.EVAL:
                session, seq, token, _ = _unpack(EVAL, payload, ftype)
                self._check_tokens(np.array([token]), ftype)
                self.last_logits = forward(self.model, [token], self._cache(session))
            elif ftype == F.HASH:
                session, seq, theirs = _unpack(HASH, payload, ftype)
                mine = logits_hash(self.last_logits) if self.last_logits is not None else 0
                self.control.send(F.HASH, HASH.pack(session, seq, mine))
                if mine != theirs:
                    raise LockstepDivergence(
                        f"LOCKSTEP DIVERGENCE at seq {seq}: local {mine:016x} peer {theirs:016x}")
            elif ftype == F.SESSION_DESTROY:
                session, _, _ = _unpack(SESSION, payload, ftype)
                self.sessions.pop(session, None)
                served += 1
            else:
                raise tr.FrameError(f"the worker cannot execute a {ftype.name} frame here")

    def _check_tokens(self, tokens: np.ndarray, ftype) -> None:
        if self.vocab and (tokens.min() < 0 or tokens.max() >= self.vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab)][0])
            raise tr.FrameError(
                f"{ftype.name} carries token id {bad}, outside the model's vocabulary [0, {self.vocab}): "
                "the leader runs another model or the frame is corrupt"
            )

    def _cache(self, session: int):
        cache = self.sessions.get(session)
        if cache is None:
            raise tr.FrameError(f"session {session} does not exist (no SESSION_CREATE for it)")
        return cache


def _unpack(fmt: struct.Struct, payload: bytes, ftype) -> tuple:
    if len(payload) != fmt.size:
        raise tr.FrameError(f"{ftype.name} payload is {len(payload)} bytes, expected {fmt.size}")
    return fmt.unpack(payload)


def _unpack_prefix(fmt: struct.Struct, payload: bytes, ftype) -> tuple:
    if len(payload) < fmt.size or (len(payload) - fmt.size) % 4:
        raise tr.FrameError(f"{ftype.name} payload of {len(payload)} bytes is malformed")
    return fmt.unpack_from(payload)
