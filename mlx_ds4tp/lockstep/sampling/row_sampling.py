"""The one sampler of `ds4tp run` and `ds4tp serve`: mlx-lm's processors and filters, drawn
lazily with an explicit random key, the same on both ranks.

Each session's sampler lives in both ranks' tables (SAMPLER), so every row of a decode step is
sampled on both inside the step's graph and the next step takes this rank's own sample
(EVAL_PENDING): the pipelined decode of lockstep.generate and `ds4tp serve`. Where the leader
alone must see the tokens first (a verify round, a mixed step), it draws with the same class.

Both ranks hold the same logits bits, so the same sampler gives the same token if it draws
the same random numbers. MLX has one global generator, and its state can be put back only
eagerly (mx.random.seed takes an int), so a session's stream here is an explicit key chain:
`key, sub = split(key)` per draw, then categorical with `sub`. That is the chain mx.random's
global state follows after mx.random.seed(seed), so a seeded request draws exactly what it
draws alone in mlx-lm (mlx-lm's speculative decoding too: its draft tokens and its verify
rows are draws of one stream). The processors see the token history and the raw logits, the
filters (top_p, min_p, top_k, mlx-lm's own functions in make_sampler's order) the normalised
log-probabilities (logits - logsumexp), as in mlx_lm.generate; only the draw with an explicit
key is written here.

A constrained session (options.grammar) also masks its row: every token outside what its
grammar allows next is -inf after the processors, before the log-probabilities, on both ranks
alike (lockstep.sampling.grammar: each rank's own matcher, advanced with the tokens it drew itself).
The mask of a draw needs the row's last token on the host, so a constrained row reads its last
token at its next draw: the step's forward is queued first (DecodeBatch.step), so the wait
overlaps the forward, and the other rows stay pipelined.
"""

from __future__ import annotations

import secrets
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from .grammar import RowGrammar
from .options import SamplingOptions, mlx_processors, processor_context


def stream_seed(options: SamplingOptions) -> int:
    """The random stream a session draws from: its options' seed, else a fresh one."""
    return options.seed if options.seed is not None else secrets.randbits(63)


def seed_of_key(key: mx.array) -> int:
    """The seed whose key is `key`: mx.random.key(s) is [s >> 32, s & 0xffffffff], so a stream
    can start from any state of MLX's generator."""
    hi, lo = (int(v) for v in key.tolist())
    return (hi << 32) | lo


class RowSampler:
    """One session's sampler, lazy, identical on both ranks (see the module docstring).
    keep_logprobs: keep the normalised log-probabilities of the last draw (a request that
    asked for logprobs). grammar: the matcher of options.grammar (Grammars.row), at its start."""

    def __init__(self, options: SamplingOptions, context: Sequence[int], seed: int, vocab: int,
                 keep_logprobs: bool = False, grammar: Optional[RowGrammar] = None):
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        self.options = options
        self.processors = mlx_processors(options)
        self.keep = max(1, processor_context(options))
        self.history = mx.array(list(context)[-self.keep:], dtype=mx.int32)
        self.key = mx.random.key(seed) if options.temperature > 0 else None
        # make_sampler's chain and order. mlx-lm refuses a top_k of the whole vocabulary (and
        # an exception inside its compiled sampler leaves MLX unable to run it again in this
        # process); keeping every token is what such a top_k means, so it is off.
        o = options
        self.filters = []
        if 0 < o.top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, o.top_p))
        if o.min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, o.min_p, 1))
        if 0 < o.top_k < (vocab or 1 << 62):
            self.filters.append(lambda x: apply_top_k(x, o.top_k))
        self.keep_logprobs = keep_logprobs
        self.last_logprobs: Optional[mx.array] = None
        if bool(options.grammar) != (grammar is not None):
            raise ValueError("a constrained sampler needs its grammar's matcher, and only it has one")
        self.grammar = grammar
        self._unmatched: Optional[mx.array] = None  # the last token drawn, not yet read
        self._unread: Optional[int] = None  # its value, not yet in the matcher

    def catch_up(self) -> None:
        """Read the last token a constrained sampler drew (waiting for its step): outside the
        draw, so a failed step's error is the step's, not this row's sampling error."""
        if self._unmatched is not None:
            self._unread, self._unmatched = int(self._unmatched.item()), None

    def probabilities(self, logits: mx.array) -> mx.array:
        """The distribution each row's token is drawn from ([rows, vocab] float32): the filters
        over the normalised log-probabilities, at the temperature; for a sampler without
        processors or a grammar (the rows a speculative round verifies, lockstep.sampling.acceptance)."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        for keep in self.filters:
            logprobs = keep(logprobs)
        return mx.softmax(logprobs * (1.0 / self.options.temperature), axis=-1)

    def draw_from(self, probs: mx.array) -> mx.array:
        """Tokens ([rows] int32, lazy) drawn from rows of probabilities, the next numbers of
        this sampler's stream."""
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(mx.log(probs), key=sub).reshape(-1).astype(mx.int32)

    def uniform(self, count: int) -> mx.array:
        """`count` numbers uniform in [0, 1), the next of this sampler's stream."""
        self.key, sub = mx.random.split(self.key)
        return mx.random.uniform(shape=(count,), key=sub)

    def draw(self, logits: mx.array) -> mx.array:
        """Tokens ([rows] int32, lazy) from rows of logits ([rows, vocab]): a session's next
        token from its one row, or a verify round's target at each of its positions, all in
        one draw as mlx-lm draws them. The processors follow one sequence, so only one row
        may pass through them."""
        if self.processors:
            if logits.shape[0] != 1:
                raise ValueError(f"a sampler with logits processors draws one row at a time, not "
                                 f"{logits.shape[0]}: speculative decoding takes no penalties or bias")
            for processor in self.processors:
                logits = processor(self.history, logits)
        if self.grammar is not None:
            if logits.shape[0] != 1:
                raise ValueError(f"a constrained sampler draws one row at a time, not {logits.shape[0]}")
            self.catch_up()
            if self._unread is not None:
                token, self._unread = self._unread, None
                self.grammar.consume(token)
            logits = mx.where(self.grammar.allowed(), logits, -mx.inf)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.keep_logprobs:
            self.last_logprobs = logprobs[-1]
        if self.key is None:
            token = mx.argmax(logprobs, axis=-1)
        else:
            for keep in self.filters:
                logprobs = keep(logprobs)
            self.key, sub = mx.random.split(self.key)
            token = mx.random.categorical(logprobs * (1.0 / self.options.temperature), key=sub)
        token = token.reshape(-1).astype(mx.int32)
        if self.processors:
            self.history = mx.concatenate([self.history, token])[-self.keep:]
        if self.grammar is not None:
            self._unmatched = token
        return token


def sample_batch(logits: mx.array, samplers: List[RowSampler], errors: Dict[int, str]) -> mx.array:
    """Each row's token ([rows] int32, lazy) of a decode step's logits ([rows, vocab]). Greedy
    rows without processors share one argmax; the others draw one by one. A row whose sampler
    fails gets token 0 (a valid id, since the next step may feed it) and its error in `errors`
    by row, on both ranks alike; the leader then fails that request alone."""
    logits = logits.astype(mx.float32)
    plain = [i for i, s in enumerate(samplers) if s.options.greedy]
    tokens = None
    if plain:
        # mlx-lm's greedy sampler over the normalised log-probabilities, one op for all the rows.
        picked = logits if len(plain) == logits.shape[0] else logits[mx.array(plain)]
        logprobs = picked - mx.logsumexp(picked, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1).astype(mx.int32)
        for j, i in enumerate(plain):
            if samplers[i].keep_logprobs:
                samplers[i].last_logprobs = logprobs[j]
        if len(plain) == len(samplers):
            return tokens  # the steady greedy batch: one array, no row taken apart
    drawn = {}
    for i, sampler in enumerate(samplers):
        if sampler.options.greedy:
            continue
        try:
            drawn[i] = sampler.draw(logits[i:i + 1])
        except Exception as exc:  # noqa: BLE001 - one request's sampler, reported to it alone
            errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
            drawn[i] = mx.zeros((1,), dtype=mx.int32)
    if tokens is None:
        return drawn[0] if len(drawn) == 1 else mx.concatenate([drawn[i] for i in range(len(samplers))])
    at = {i: j for j, i in enumerate(plain)}
    return mx.concatenate([tokens[at[i]:at[i] + 1] if i in at else drawn[i] for i in range(len(samplers))])
