"""Stop requests: `kill` (SIGTERM) as Ctrl-C (SIGINT), so a command's finally blocks run and
what it started (a peer rank told to stop, a bench's ranks and busy core, files being written)
is not left behind it; and which signal it was, so the command can say why it stopped."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, Optional

_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}
_received: Optional[int] = None  # the first stop signal, for stop_reason
_shielded = False  # a stop under way: later signals are recorded, not raised


def _interrupt(signum: int, frame: Any) -> None:
    global _received
    if _received is None:
        _received = signum
    if not _shielded:
        raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread (elsewhere: nothing, as
    only the main thread may set a handler)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM both raise KeyboardInterrupt in the main thread, and
    stop_reason names the first; inside `shielded()` they are only recorded. Elsewhere than
    the main thread: nothing (only it may set a handler)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _NAMES:
            signal.signal(sig, _interrupt)


def stop_reason() -> str:
    """The stop signal received first ("SIGTERM", "SIGINT (Ctrl-C)"), or "Ctrl-C" when the
    interrupt came another way (Python's own SIGINT handler)."""
    return _NAMES.get(_received, "Ctrl-C") if _received is not None else "Ctrl-C"


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A stop under way: a second Ctrl-C or SIGTERM does not cut it short (every wait of a stop
    has its own timeout); the signals are recorded only."""
    global _shielded
    before, _shielded = _shielded, True
    try:
        yield
    finally:
        _shielded = before


__all__ = ["shielded", "stop_on_signals", "stop_on_sigterm", "stop_reason"]
