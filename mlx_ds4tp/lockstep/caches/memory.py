"""How many KV cache tokens a rank's machine can hold: the default of `ds4tp serve`'s
--max-kv-tokens.

Each rank reckons its own: the machine's memory (capped by DS4_TP_MEMORY_LIMIT_BYTES), less what
this process holds once its part of the weights is loaded (its resident memory), less a headroom
for MLX's buffers, the activations of a forward and the system, divided by the bytes one cache
token takes on this rank. Two different Macs split unevenly hold different parts of every cache
in different memories, so the leader asks the worker for its figure (KV_ROOM) and admits no more
than the smaller of the two.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

from ...split.measure import memory_limit

# What stays free besides the caches: a share of the machine (macOS starts compressing and
# swapping well before memory is full) and a floor for a prefill chunk's activations.
HEADROOM_SHARE = 0.25
HEADROOM_MIN_BYTES = 2 << 30


def total_memory() -> int:
    """This machine's physical memory in bytes (0 when it cannot be read)."""
    try:
        if sys.platform == "darwin":
            return int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True,
                                      text=True, timeout=5).stdout.strip())
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def resident_memory() -> int:
    """This process's resident memory in bytes (0 when it cannot be read)."""
    try:
        if sys.platform == "darwin":
            out = subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True,
                                 text=True, timeout=5).stdout
            return int(out.strip()) * 1024
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return 0


def kv_bytes_per_token(model, kv_bits: int = 0, kv_group_size: int = 64, probe: int = 256) -> float:
    """Bytes one cache token takes on this rank, read off the cache of a forward over `probe`
    tokens that is built and never evaluated: shapes are known without running anything, so
    no gate is met and no memory is used. Fixed-size state (recurrent layers) is spread over
    the probe, which over-counts it for long sessions: a bound, never an underestimate for
    the attention layers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..compute import make_cache

    cache = make_cache(model)
    if kv_bits:
        from .quantized_cache import quantize_session_cache

        cache = quantize_session_cache(cache, kv_bits, kv_group_size)
    model(mx.zeros((1, probe), dtype=mx.int32), cache=cache)
    arrays = [a for layer in cache for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)]
    return sum(a.nbytes for a in arrays) / probe


def default_kv_budget(model, kv_bits: int = 0, kv_group_size: int = 64,
                      total: Optional[int] = None, resident: Optional[int] = None) -> tuple:
    """(tokens, explanation): the KV budget this rank's machine affords (None when its memory
    cannot be read; 0 when it is full), and how it was reckoned."""
    if total is None:
        total, limit = total_memory(), memory_limit()
        total = min(total, limit) if total and limit else (total or limit)
    resident = resident_memory() if resident is None else resident
    per_token = kv_bytes_per_token(model, kv_bits, kv_group_size)
    if not total or per_token <= 0:
        return None, "no KV budget: this machine's memory could not be read"
    headroom = max(int(total * HEADROOM_SHARE), HEADROOM_MIN_BYTES)
    free = total - resident - headroom
    tokens = max(int(free // per_token), 0)
    gib = 1 << 30
    return tokens, (f"KV budget {tokens} tokens ({per_token / 1024:.1f} KiB a token on this machine): "
                    f"{total / gib:.1f} GiB of memory, {resident / gib:.1f} GiB held with the weights, "
                    f"{headroom / gib:.1f} GiB kept free; set --max-kv-tokens to change it")
