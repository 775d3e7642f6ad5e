"""Sampling options shared by `ds4tp run` and `ds4tp serve` (the flags that make them are
mlx_ds4tp.cli.sampling_args), mlx-lm's logits processors for them, and OpenAI's logprobs entry.
The one sampler that draws with them is lockstep.sampling.row_sampling.RowSampler.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Tuple

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
    # Constrained decoding: a grammar the draws must follow (lockstep.sampling.grammar; "" for none).
    grammar: str = ""

    def check(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        for name, within, rule in _BOUNDS:
            value = getattr(self, name)
            if not within(value):
                raise ValueError(f"{name}={value} {rule}")
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}]={bias} must be in [-100, 100]")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a grammar's text, not {type(self.grammar).__name__}")

    @property
    def processed(self) -> bool:
        """True when a logits processor (penalty, bias, a grammar's mask) changes the logits
        before sampling."""
        return bool(self.repetition_penalty or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.grammar)

    @property
    def greedy(self) -> bool:
        """Argmax of the raw distribution: no temperature, no processor."""
        return self.temperature == 0 and not self.processed


# Each numeric field's range, as SamplingOptions.check names it: (field, in range?, the rule).
_BOUNDS = (
    ("temperature", lambda v: v >= 0, "must be >= 0 (0 is greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", lambda v: v >= 0, "must be >= 0 (0 keeps every token)"),
    ("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ("repetition_penalty", lambda v: v >= 0, "must be >= 0 (0 is off)"),
    ("repetition_context_size", lambda v: v >= 1, "must be >= 1"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2] (0 is off)"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2] (0 is off)"),
    ("presence_context_size", lambda v: v >= 1, "must be >= 1"),
    ("frequency_context_size", lambda v: v >= 1, "must be >= 1"),
)


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


def options_to_json(options: SamplingOptions) -> bytes:
    """The options as the SAMPLER command carries them to the worker."""
    return json.dumps(dataclasses.asdict(options)).encode()


def options_from_json(data: bytes) -> SamplingOptions:
    """options_to_json's inverse; ValueError naming what is wrong."""
    try:
        fields = json.loads(data.decode("utf-8"))
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields.get("logit_bias", ()))
        options = SamplingOptions(**fields)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"sampling options {data[:200]!r} do not parse: {exc}") from None
    options.check()
    return options


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
