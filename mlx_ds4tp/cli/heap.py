"""The C heap of a long-running `ds4tp serve` on Linux: a bounded number of glibc arenas.

glibc gives each thread that meets a locked heap an arena of its own, up to eight per core,
and an arena's free pages stay resident while any chunk in them lives. The HTTP server runs a
thread per connection, so after a burst of clients the leader's resident memory kept the
burst's arenas: five rounds of 32 clients against one server left it idle at 107, 129, 125,
124 and 126 MiB; with MALLOC_ARENA_MAX=2 in its environment, 112, 107, 107, 106 and 107.
glibc reads that variable once, when the process starts (a mallopt at run time came too late:
145-160 MiB), so the command starts itself again with it set: exec keeps the process id, so
whoever started the server still holds it. A value the user set is kept.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Callable, Dict, Optional, Sequence

ARENA_ENV = "MALLOC_ARENA_MAX"
ARENAS = "2"


def bounded_arenas_argv(argv: Sequence[str], environ: Dict[str, str], *, system: str,
                        libc: str, orig_argv: Sequence[str], executable: str) -> Optional[list]:
    """The command line to exec so the server runs with bounded arenas, or None when there is
    nothing to do: not `serve`, not glibc, or the variable already set (by the user, or by the
    exec itself, so it happens once)."""
    if not argv or argv[0] != "serve" or system != "Linux" or libc != "glibc":
        return None
    if ARENA_ENV in environ or not executable or len(orig_argv) < 2:
        return None
    return [executable, *orig_argv[1:]]


def exec_with_bounded_arenas(argv: Sequence[str],
                             execve: Callable[[str, list, dict], None] = os.execve) -> None:
    """Start this `ds4tp serve` again with MALLOC_ARENA_MAX set, where that bounds its heap
    (bounded_arenas_argv); returns only when nothing is to be done."""
    command = bounded_arenas_argv(argv, os.environ, system=platform.system(),
                                  libc=platform.libc_ver()[0], orig_argv=getattr(sys, "orig_argv", []),
                                  executable=sys.executable)
    if command is None:
        return
    env = dict(os.environ, **{ARENA_ENV: ARENAS})
    sys.stdout.flush()
    sys.stderr.flush()
    execve(command[0], command, env)
