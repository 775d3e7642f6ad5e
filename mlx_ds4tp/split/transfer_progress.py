"""A part's transfer progress on stderr, on both sides: bytes, rate and time left; a bar redrawn in
place on a terminal, a log line every LOG_EVERY_S seconds otherwise (logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional

from ..base.log import log

LOG_EVERY_S = 5.0


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class TransferProgress:
    """Call add(n) as bytes pass and done() at the end; `what` names the transfer in every line
    ("receiving rank 1's part from the leader"). clock is a seam for the tests."""

    WIDTH = 30

    def __init__(self, what: str, total: int, tty: Optional[bool] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.total = what, total
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.clock = clock
        self.start = self.last = clock()
        self.bytes = 0

    def line(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.bytes / elapsed
        left = (self.total - self.bytes) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f} s left" if left != float("inf") else "time left unknown"
        pct = self.bytes / self.total if self.total else 1.0
        return f"{self.what}: {_size(self.bytes)} of {_size(self.total)} ({pct:.0%}), {_size(rate)}/s, {eta}"

    def add(self, n: int) -> None:
        self.bytes += n
        now = self.clock()
        if self.tty:
            if now - self.last >= 0.1:
                self.last = now
                frac = self.bytes / self.total if self.total else 1.0
                filled = int(frac * self.WIDTH)
                sys.stderr.write(f"\rds4-tp: [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.line()}   ")
                sys.stderr.flush()
        elif now - self.last >= LOG_EVERY_S:
            self.last = now
            log(self.line())

    def done(self) -> float:
        """End the bar; log the whole transfer's figures; the seconds it took."""
        if self.tty:
            sys.stderr.write("\n")
        elapsed = self.clock() - self.start
        rate = self.bytes / elapsed if elapsed > 0 else 0.0
        log(f"{self.what}: {_size(self.bytes)} in {elapsed:.1f} s ({_size(rate)}/s)")
        return elapsed


__all__ = ["TransferProgress"]
