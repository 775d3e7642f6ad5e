"""What a rank measures at start for `--split auto` (carried by its hello): the memory it may
use and its speed on the work that bounds decode.

Decode streams every weight once a token: on a Mac that is memory bandwidth, on a CPU-only
machine compute. Either way a matrix-vector product over a buffer larger than any cache
(128 MiB: an M-series Ultra's system cache is 96 MiB) is the same work, so its bytes a second
stand for the rank's decode speed. It runs for MEASURE_SEC on MLX's default device.
"""

from __future__ import annotations

import os
import sys
import time

from ..link.hello import RankFigures

MEASURE_SEC = 0.2
_ROWS, _COLS = 8192, 4096  # float32: 128 MiB
MEMORY_LIMIT_ENV = "DS4_TP_MEMORY_LIMIT_BYTES"


def matvec_speed(seconds: float = MEASURE_SEC) -> int:
    """Bytes a second of a float32 matrix-vector product over 128 MiB, timed for `seconds`."""
    import mlx.core as mx

    weights = mx.ones((_ROWS, _COLS), dtype=mx.float32)
    vector = mx.ones((_COLS,), dtype=mx.float32)
    mx.eval(weights, vector, weights @ vector)  # allocated and the kernel warm before the clock
    runs, start = 0, time.perf_counter()
    while True:
        mx.eval(weights @ vector)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    del weights
    return int(runs * _ROWS * _COLS * 4 / elapsed)


def usable_memory() -> int:
    """Bytes this rank may hold: on a Mac, Metal's recommended working set (what the GPU may
    wire); elsewhere the kernel's MemAvailable. 0 when it cannot be read."""
    try:
        if sys.platform == "darwin":
            import mlx.core as mx

            return int(mx.device_info().get("max_recommended_working_set_size", 0))
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError):
        pass
    return 0


def memory_limit(env=None) -> int:
    """DS4_TP_MEMORY_LIMIT_BYTES: a cap on what this rank reports it may use (0: none)."""
    raw = (os.environ if env is None else env).get(MEMORY_LIMIT_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MEMORY_LIMIT_ENV}={raw!r} is not a whole number of bytes; set it to "
                         f"e.g. 8000000000, or unset it") from None
    if value <= 0:
        raise ValueError(f"{MEMORY_LIMIT_ENV}={raw!r} must be above 0 bytes, or unset")
    return value


def measure_rank(limit: int = 0, seconds: float = MEASURE_SEC) -> RankFigures:
    """This rank's figures: its usable memory (capped at `limit` when that is smaller, or when
    the machine's cannot be read) and matvec_speed."""
    memory = usable_memory()
    if limit and (not memory or limit < memory):
        memory = limit
    return RankFigures(memory_bytes=memory, speed=matvec_speed(seconds))


__all__ = ["MEASURE_SEC", "MEMORY_LIMIT_ENV", "matvec_speed", "measure_rank", "memory_limit",
           "usable_memory"]
