"""What a rank measures at start for `--split auto` (carried by its hello): the memory it may
use and its speed on the work that bounds decode.

Decode streams every weight once a token: on a Mac that is memory bandwidth, on a CPU-only
machine compute. Either way matrix-vector products over buffers larger than any cache (128 MiB
in all: an M-series Ultra's system cache is 96 MiB) are the same work, so their bytes a second
stand for the rank's decode speed. They are computed as decode computes them: a vector times
layer-sized weights transposed (what nn.Linear does), many in one graph evaluated once a pass
(a token's gates are in its graph). One 128 MiB product instead measured 0.9 GB/s here against
2.4 GB/s for this, nearer the rate at which the model's decode streams its weights. It runs
for MEASURE_SEC, and at least MIN_PASSES passes, on MLX's default device.
"""

from __future__ import annotations

import os
import sys
import time

from ..link.hello import RankFigures

MEASURE_SEC = 0.3
MIN_PASSES = 3
_PIECES, _SIDE = 32, 1024  # float32: 32 pieces of 4 MiB, 128 MiB
MEMORY_LIMIT_ENV = "DS4_TP_MEMORY_LIMIT_BYTES"


def matvec_speed(seconds: float = MEASURE_SEC) -> int:
    """Bytes a second of float32 vector-times-weights products over 128 MiB, timed for `seconds`."""
    import mlx.core as mx

    pieces = [mx.ones((_SIDE, _SIDE), dtype=mx.float32) for _ in range(_PIECES)]
    vector = mx.ones((1, _SIDE), dtype=mx.float32)

    def one_pass() -> None:
        mx.eval([vector @ piece.T for piece in pieces])

    mx.eval(pieces, vector)
    one_pass()  # allocated and the kernels warm before the clock
    passes, start = 0, time.perf_counter()
    while True:
        one_pass()
        passes += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and passes >= MIN_PASSES:
            break
    return int(passes * _PIECES * _SIDE * _SIDE * 4 / elapsed)


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


def memory_limit() -> int:
    """DS4_TP_MEMORY_LIMIT_BYTES: a cap on what this rank reports it may use (0: none)."""
    raw = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
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


def measure_rank(limit: int = 0) -> RankFigures:
    """This rank's figures: its usable memory (capped at `limit` when that is smaller, or when
    the machine's cannot be read) and matvec_speed."""
    memory = usable_memory()
    if limit and (not memory or limit < memory):
        memory = limit
    return RankFigures(memory_bytes=memory, speed=matvec_speed())


__all__ = ["MEMORY_LIMIT_ENV", "matvec_speed", "measure_rank", "memory_limit", "usable_memory"]
