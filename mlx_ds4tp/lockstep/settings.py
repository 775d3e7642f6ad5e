"""What one `ds4tp run` generates, as cli.run resolves its flags: typed settings that
lockstep.run takes instead of the argparse namespace."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..checkpoint.parts_cache import PartsSettings
from ..split.share import SplitSettings
from .sampling.options import SamplingOptions

# Tokens drafted a round, at most: a VERIFY_BATCH row holds the input token and this many drafts
# (lockstep/protocol/commands/limits.py's MAX_VERIFY_WIDTH). The one bound every door checks (the flags, a request's
# num_draft_tokens, the speculative generation).
MAX_DRAFT_TOKENS = 64


def draft_tokens_problem(k: int, least: int = 1) -> str:
    """What is wrong with drafting `k` tokens a round ("" when nothing): `least` is 1 for a
    setting that drafts, 0 where 0 means "no drafts" (a request's num_draft_tokens)."""
    if k < least:
        return f"{k} must be >= {least}"
    if k > MAX_DRAFT_TOKENS:
        return f"{k} must be <= {MAX_DRAFT_TOKENS}"
    return ""


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """How the leader drafts for speculative decoding: a draft model's directory, prompt
    lookup's n-gram size, or recorded_draft, a JSON file of tokens drafted as the known
    continuation (the bench's ceiling); none of them: it decodes one token a step."""

    draft_model: Optional[str] = None
    prompt_lookup: int = 0
    num_draft_tokens: int = 3
    recorded_draft: Optional[str] = None

    @property
    def drafts(self) -> bool:
        return bool(self.draft_model or self.prompt_lookup or self.recorded_draft)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What one `ds4tp run` leader generates (the worker reads none of it but the model).

    tokens_out: the leader writes the prompt's and the generated tokens, the prompt and decode
    rates and the gate latency there as JSON (the local pair reads it). stop_at_eos=False
    decodes max_tokens whatever the model says (the bench). prompt_tokens > 0: the prompt is
    the text's tokens repeated to that many (bench_prompt), without the chat template, after a
    warm-up generation on its first tokens. split: this rank's --split (the leader's decides)."""

    prompt: str = ""
    max_tokens: int = 128
    chat: bool = True
    sampling: SamplingOptions = SamplingOptions()
    debug_hash: int = 0
    stop_at_eos: bool = True
    prompt_tokens: int = 0
    tokens_out: Optional[str] = None
    draft: DraftSettings = DraftSettings()
    split: SplitSettings = SplitSettings()
    parts: PartsSettings = PartsSettings()  # a worker without --model: where its part is kept
