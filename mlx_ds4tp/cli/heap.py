"""The C heap of a long-running `ds4tp serve` on Linux: one glibc arena.

glibc gives each thread that meets a locked heap an arena of its own, up to eight per core,
and an arena's free pages stay resident while any chunk in them lives. The HTTP server runs a
thread per connection, so after a burst of clients the leader's resident memory kept the
burst's arenas: five rounds of 32 clients against one server left it idle at 107, 129, 125,
124 and 126 MiB; with MALLOC_ARENA_MAX=2 in its environment, 112, 107, 107, 106 and 107.

Two arenas still left the 10-minute soak's leader idle at 0.99x to 1.55x its start. The
server hands memory back once idle (lockstep.table.release_memory), and malloc_trim gives
back the free pages inside every arena but shrinks only the main arena's free top. A second
arena's top is given back only when a free leaves more than the trim threshold there, and
glibc raises that threshold after large frees, to up to 64 MiB. After a worker rejoined, the
engine's new thread allocated in the second arena, and in one soak that arena had grown to
240 MiB with 11 in use. Fixing the thresholds instead (arrays past 256 KiB mapped on their
own, tops past 1 MiB trimmed at once) held the memory to 1.00x but cost a quarter of the
throughput (164 against 214 tok/s): every large array was mapped and faulted in afresh.
With one arena the whole heap is the main arena, whose free memory, top included, the idle
trim hands back; the same soak ended at 1.01x, at 221 tok/s. The threads allocate under one
lock, which the GIL already all but serialises.

glibc reads the variable once, when the process starts (a mallopt of the arena count at run
time came too late: 145-160 MiB), so the command starts itself again with it set: exec keeps
the process id, so whoever started the server still holds it. A value the user set is kept.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Callable, Dict, Optional, Sequence

HEAP_ENV = {"MALLOC_ARENA_MAX": "1"}


def bounded_heap_argv(argv: Sequence[str], environ: Dict[str, str], *, system: str,
                      libc: str, orig_argv: Sequence[str], executable: str) -> Optional[list]:
    """The command line to exec so the server runs with a bounded heap, or None when there is
    nothing to do: not `serve`, not glibc, or every variable already set (by the user, or by
    the exec itself, so it happens once)."""
    if not argv or argv[0] != "serve" or system != "Linux" or libc != "glibc":
        return None
    if all(name in environ for name in HEAP_ENV) or not executable or len(orig_argv) < 2:
        return None
    return [executable, *orig_argv[1:]]


def bounded_heap_environ(environ: Dict[str, str]) -> Dict[str, str]:
    """`environ` with each heap variable the user did not set."""
    return {**HEAP_ENV, **environ}


def exec_with_bounded_heap(argv: Sequence[str],
                           execve: Callable[[str, list, dict], None] = os.execve) -> None:
    """Start this `ds4tp serve` again with the heap variables set, where they bound its heap
    (bounded_heap_argv); returns only when nothing is to be done."""
    command = bounded_heap_argv(argv, os.environ, system=platform.system(),
                                libc=platform.libc_ver()[0], orig_argv=getattr(sys, "orig_argv", []),
                                executable=sys.executable)
    if command is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    execve(command[0], command, bounded_heap_environ(dict(os.environ)))
