"""The one writer of diagnostics: stderr, prefixed ``ds4-tp:``; results go to stdout."""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """Write one diagnostic line to stderr with the project prefix.

    One write per line: print() writes the text and the newline separately,
    so two threads' lines (two ranks in one process) could run together."""
    sys.stderr.write(f"ds4-tp: {message}\n")
    sys.stderr.flush()
