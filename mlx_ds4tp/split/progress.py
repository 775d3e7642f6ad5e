"""load_split's progress on stderr."""

from __future__ import annotations

import sys

from ..base.log import log


class LoadingBar:
    """Weights-loading progress on stderr: redrawn in place on a terminal,
    a line per quarter otherwise (logs stay readable)."""

    WIDTH = 30

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last_quarter = -1

    def __call__(self, done: int, total: int, where: str) -> None:
        frac = done / total if total else 1.0
        if self.tty:
            filled = int(frac * self.WIDTH)
            sys.stderr.write(f"\rds4-tp: loading weights [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                             f"{done}/{total} {where[:40]:<40}")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif int(frac * 4) > self.last_quarter:
            self.last_quarter = int(frac * 4)
            log(f"loading weights: {done}/{total} tensors cut ({frac:.0%})")
