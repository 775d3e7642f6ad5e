"""One generation as every layer takes it: what the dialects of `ds4tp serve` parse a body
into, what the engine admits and schedules, what the leader's batch (lockstep/batch.py) decodes,
and what `ds4tp run` generates. Frozen: nothing downstream writes into it (what becomes of a
request travels as the engine's events)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from .sampling.options import SamplingOptions


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """The prompt's tokens, how many it may generate, how it samples; stop: strings that end its
    text (cut off before them); logprobs: None, or how many most likely tokens each generated
    token's logprobs entry lists; num_draft_tokens: drafts a speculative round (None: the
    server's or run's; 0: none)."""

    prompt: Tuple[int, ...]
    max_tokens: int
    options: SamplingOptions = SamplingOptions()
    stop: Tuple[str, ...] = ()
    logprobs: Optional[int] = None
    num_draft_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        # Lists are taken (a parser's, a test's) and kept as tuples, so the value stays frozen.
        object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def kv_tokens(self) -> int:
        """The cache tokens it may come to hold: its prompt and every token it may generate."""
        return len(self.prompt) + self.max_tokens
