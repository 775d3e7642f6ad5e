"""A part's transfer progress on stderr, on both sides: bytes, rate and time left; a bar redrawn in
place on a terminal, a log line every LOG_EVERY_S seconds otherwise (logs stay readable). The
leader's transfers under way are also listed for its /health (parts_in_flight)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Dict, Optional

from ..base.log import log

LOG_EVERY_S = 5.0

_lock = threading.Lock()
_sending: Dict[int, "TransferProgress"] = {}  # the leader's transfers under way, by the receiving rank


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
                 clock: Callable[[], float] = time.monotonic, to_rank: Optional[int] = None):
        """to_rank: the leader sending that rank its part (listed by parts_in_flight until done
        or closed)."""
        self.what, self.total = what, total
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.clock = clock
        self.start = self.last = clock()
        self.bytes = 0
        self.to_rank = to_rank
        if to_rank is not None:
            with _lock:
                _sending[to_rank] = self

    def rate(self) -> float:
        return self.bytes / max(self.clock() - self.start, 1e-9)

    def line(self) -> str:
        rate = self.rate()
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
                sys.stderr.write(f"\rds4-tp: {self._bar()}   ")
                sys.stderr.flush()
        elif now - self.last >= LOG_EVERY_S:
            self.last = now
            log(self.line())

    def _bar(self) -> str:
        """The terminal's one line: this transfer's bar, or, while the leader sends several
        workers their parts at once (split/part_delivery.py), each one's share done, one line
        for all (bars of their own would overwrite each other in place)."""
        with _lock:
            under_way = sorted(_sending.items()) if self.to_rank is not None else []
        if len(under_way) > 1:
            done = sum(p.bytes for _, p in under_way)
            total = sum(p.total for _, p in under_way)
            rate = sum(p.rate() for _, p in under_way)
            each = ", ".join(f"rank {rank} {p.bytes / p.total if p.total else 1.0:.0%}" for rank, p in under_way)
            left = f"{(total - done) / rate:.0f} s left" if rate > 0 else "time left unknown"
            return f"sending {len(under_way)} parts: {each}; {_size(done)} of {_size(total)}, {_size(rate)}/s, {left}"
        frac = self.bytes / self.total if self.total else 1.0
        filled = int(frac * self.WIDTH)
        return f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.line()}"

    def close(self) -> None:
        """No longer under way (parts_in_flight leaves it out); done() closes too."""
        if self.to_rank is not None:
            with _lock:
                if _sending.get(self.to_rank) is self:
                    del _sending[self.to_rank]

    def done(self) -> float:
        """End the bar; log the whole transfer's figures; the seconds it took."""
        self.close()
        if self.tty:
            sys.stderr.write("\n")
        elapsed = self.clock() - self.start
        rate = self.bytes / elapsed if elapsed > 0 else 0.0
        log(f"{self.what}: {_size(self.bytes)} in {elapsed:.1f} s ({_size(rate)}/s)")
        return elapsed


def parts_in_flight() -> dict:
    """{"parts_sending": [...]} while this leader sends a worker its part (each: the rank, bytes
    sent and in all, bytes a second, seconds left), for /health; {} otherwise."""
    with _lock:
        under_way = sorted(_sending.items())
    if not under_way:
        return {}
    out = []
    for rank, progress in under_way:
        rate = progress.rate()
        left = (progress.total - progress.bytes) / rate if rate > 0 else None
        out.append({"rank": rank, "bytes": progress.bytes, "total_bytes": progress.total,
                    "bytes_per_s": round(rate), "seconds_left": None if left is None else round(left, 1)})
    return {"parts_sending": out}


__all__ = ["TransferProgress", "parts_in_flight"]
