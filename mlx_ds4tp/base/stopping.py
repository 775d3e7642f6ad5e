"""`kill` (SIGTERM) as Ctrl-C: a command's finally blocks run, so what it started (a peer rank
told to stop, a bench's ranks and busy core) is not left running behind it."""

from __future__ import annotations

import signal
import threading
from typing import Any


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread (elsewhere: nothing, as
    only the main thread may set a handler)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


__all__ = ["stop_on_sigterm"]
