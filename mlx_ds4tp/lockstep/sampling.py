"""Sampling options shared by `ds4tp run` and `ds4tp serve`, and the per-session sampler
(the flags that make the options are mlx_ds4tp.cli.sampling_args).

The samplers and logits processors are mlx-lm's own (`mlx_lm.sample_utils`), fed exactly what
`mlx_lm.generate` feeds them: the processors see the token history and the raw logits, the
sampler sees the normalised log-probabilities (logits - logsumexp). Greedy and seeded output
is then token for token what mlx-lm produces for the same model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """What one generation samples with; the defaults are greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: Tuple[Tuple[int, float], ...] = ()  # (token id, bias) pairs
    seed: Optional[int] = None

    def check(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty < 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be >= 0 (0 is off)")
        if self.repetition_context_size < 1:
            raise ValueError(f"repetition_context_size={self.repetition_context_size} must be >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2] (0 is off)")
        for name in ("presence_context_size", "frequency_context_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}]={bias} must be in [-100, 100]")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")

    @property
    def processed(self) -> bool:
        """True when a logits processor (penalty, bias) changes the logits before sampling."""
        return bool(self.repetition_penalty or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Argmax of the raw distribution: no temperature, no processor."""
        return self.temperature == 0 and not self.processed


def mlx_processors(options: SamplingOptions) -> list:
    """mlx_lm.server's logits processors, with its arguments: the same penalties and bias
    give the same tokens."""
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(
        logit_bias=dict(options.logit_bias) or None,
        repetition_penalty=options.repetition_penalty or None,
        repetition_context_size=options.repetition_context_size,
        presence_penalty=options.presence_penalty or None,
        presence_context_size=options.presence_context_size,
        frequency_penalty=options.frequency_penalty or None,
        frequency_context_size=options.frequency_context_size)


def processor_context(options: SamplingOptions) -> int:
    """How many of the latest tokens the processors look at (0: none does)."""
    sizes = [(options.repetition_penalty, options.repetition_context_size),
             (options.presence_penalty, options.presence_context_size),
             (options.frequency_penalty, options.frequency_context_size)]
    return max([size for on, size in sizes if on], default=0)


def mlx_sampler(options: SamplingOptions, vocab: int) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for the options (it takes normalised log-probabilities)."""
    from mlx_lm.sample_utils import make_sampler

    # mlx-lm refuses top_k >= vocabulary (and an exception inside its compiled sampler
    # leaves MLX unable to run it again in this process); keeping every token is what
    # such a top_k means, so it is off.
    top_k = options.top_k if options.top_k < vocab else 0
    return make_sampler(options.temperature, top_p=options.top_p, min_p=options.min_p, top_k=top_k)


def options_to_json(options: SamplingOptions) -> bytes:
    """The options as the lockstep DECODE command carries them to the worker."""
    import json

    return json.dumps(dataclasses.asdict(options)).encode()


def options_from_json(data: bytes) -> SamplingOptions:
    """options_to_json's inverse; ValueError naming what is wrong."""
    import json

    try:
        fields = json.loads(data.decode("utf-8"))
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields.get("logit_bias", ()))
        options = SamplingOptions(**fields)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"sampling options {data[:200]!r} do not parse: {exc}") from None
    options.check()
    return options


def _seed_of_key(key: mx.array) -> int:
    """The seed whose key is `key`: mx.random.key(s) is [s >> 32, s & 0xffffffff], so any
    key of MLX's generator can be put back as the global state with mx.random.seed."""
    hi, lo = (int(v) for v in key.tolist())
    return (hi << 32) | lo


class SessionSampler:
    """One session's sampling: mlx-lm's processors and sampler, its token history, and (when
    seeded) its own random stream, so a seeded session draws exactly the numbers it would draw
    alone after mx.random.seed(seed), however many other sessions sample in between."""

    def __init__(self, options: SamplingOptions, prompt_tokens: List[int], *, keep_logprobs: bool = False):
        self.options = options
        self.history = list(prompt_tokens)
        self.sampler: Optional[Callable[[mx.array], mx.array]] = None
        self.processors = mlx_processors(options)
        self._rng_seed = options.seed
        # keep_logprobs: the normalised log-probabilities the last token was drawn from ([vocab]),
        # for a request that asked for logprobs.
        self.keep_logprobs = keep_logprobs
        self.last_logprobs: Optional[mx.array] = None

    def sample(self, logits: mx.array) -> int:
        """The next token from one row of logits ([1, vocab]); records it in the history."""
        if self.processors:
            context = mx.array(self.history, dtype=mx.int32)
            for processor in self.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.keep_logprobs:
            self.last_logprobs = logprobs.reshape(-1)
        if self.sampler is None:
            self.sampler = mlx_sampler(self.options, logits.shape[-1])
        if self._rng_seed is not None and self.options.temperature > 0:
            # MLX has one global generator: put this session's state in, draw, take it out.
            mx.random.seed(self._rng_seed)
            token = self.sampler(logprobs)
            mx.eval(token)
            self._rng_seed = _seed_of_key(mx.random.state[0])
        else:
            token = self.sampler(logprobs)
        value = int(token.reshape(-1)[0].item())
        self.history.append(value)
        return value


def shared_argmax(logits: mx.array, rows: List[int]) -> Tuple[mx.array, mx.array]:
    """The normalised log-probabilities of `rows` of a batch's logits ([rows, vocab]) and their
    argmax: what mlx-lm's greedy sampler takes and gives, one op for all the greedy rows."""
    picked = logits if len(rows) == logits.shape[0] else logits[mx.array(rows)]
    logprobs = picked - mx.logsumexp(picked, axis=-1, keepdims=True)
    return logprobs, mx.argmax(logprobs, axis=-1)


def sample_rows(logits: mx.array, samplers: List[SessionSampler],
                errors: Optional[Dict[int, str]] = None) -> List[Optional[int]]:
    """One token per row of a decode batch ([rows, vocab]). Rows that decode greedily with no
    processor share one argmax over the normalised log-probabilities (what mlx-lm's greedy
    sampler takes); the others sample one by one. With `errors`, a row whose own sampler
    fails gets None and its error there, and the other rows go on; without, it raises."""
    tokens: List[Optional[int]] = [None] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.options.greedy]
    if greedy:
        logprobs, best = shared_argmax(logits, greedy)
        for row, (i, token) in enumerate(zip(greedy, best.tolist())):
            tokens[i] = int(token)
            samplers[i].history.append(int(token))
            if samplers[i].keep_logprobs:
                samplers[i].last_logprobs = logprobs[row]
    for i, s in enumerate(samplers):
        if tokens[i] is not None:
            continue
        try:
            tokens[i] = s.sample(logits[i : i + 1])
        except Exception as exc:  # noqa: BLE001 - one request's sampler, reported to it alone
            if errors is None:
                raise
            errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    return tokens


def logprob_item(tokenizer, logprobs: mx.array, token: int, top: int) -> dict:
    """OpenAI's logprobs entry for one generated token: its text, log-probability and UTF-8
    bytes, and the `top` most likely tokens (most likely first) with theirs."""
    def entry(tid: int, value: float) -> dict:
        text = tokenizer.decode([tid])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8")), "id": tid}

    item = entry(token, float(logprobs[token].item()))
    best = []
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        best = [entry(int(t), float(v)) for t, v in zip(ids[order].tolist(), values[order].tolist())]
    item["top_logprobs"] = best
    return item
