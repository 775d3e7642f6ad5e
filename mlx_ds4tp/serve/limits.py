"""How much `ds4tp serve` takes on at once: the serving limits, resolved once from the command
line (cli/serve.py) and handed to the engine as one object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ServeLimits:
    """The engine's limits; defaults are `ds4tp serve`'s."""

    prompt_cache_size: int = 10      # stored prompt caches kept for reuse
    prompt_cache_bytes: int = 0      # their bound in bytes (0: count only)
    prompt_cache_dir: Optional[str] = None  # evicted and shut-down caches go here (None: memory only)
    prompt_cache_disk_bytes: int = 0         # the directory's bound in bytes (> 0 with a directory)
    prefill_step: int = 2048         # prompt tokens a session prefills per turn
    prompt_concurrency: int = 8      # prompts prefilled together in one padded forward
    max_batch: int = 32              # sessions decoded together
    kv_budget: int = 0               # tokens reserved by sessions under way (0: no budget)
    max_queued: int = 64             # requests waiting for admission
    kv_bits: int = 0                 # a fresh session's KV quantization (0: float)
    kv_group_size: int = 64
    mixed_prefill: int = 0           # prompt tokens a prefilling session carries in a decode step
    mixed_when: str = "cheaper"      # "cheaper" | "always"
    debug_hash: int = 0              # compare the logits' hash every N steps (0: never)
