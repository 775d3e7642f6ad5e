"""The C heap of a long-running `ds4tp serve` on Linux: two glibc arenas, fixed thresholds.

glibc gives each thread that meets a locked heap an arena of its own, up to eight per core,
and an arena's free pages stay resident while any chunk in them lives. The HTTP server runs a
thread per connection, so after a burst of clients the leader's resident memory kept the
burst's arenas: five rounds of 32 clients against one server left it idle at 107, 129, 125,
124 and 126 MiB; with MALLOC_ARENA_MAX=2 in its environment, 112, 107, 107, 106 and 107.

Two arenas still left the 10-minute soak's leader idle at 0.99x to 1.55x its start. The
server hands memory back once idle (lockstep.table.release_memory), and malloc_trim gives
back the free pages inside every arena but shrinks only the main arena's free top. Another
arena's top is given back only when a free leaves more than the trim threshold there, and
after large frees glibc raises that threshold with its mmap threshold, to up to 64 MiB.
After a worker rejoined, the engine's allocations moved to the second arena, and in one soak
it had grown to 240 MiB with 11 in use. So both thresholds are fixed: the mmap threshold at
32 MiB, the most glibc would raise it to, so arrays are reused from the heap as before, and
the trim threshold at 1 MiB, so a free top past it is handed back when a chunk is freed; the
same soak, the allocations again moving to the second arena, ended at 1.003x. An mmap
threshold of 256 KiB also held the memory but cost a quarter of the throughput (every large
array mapped and faulted in afresh), and one arena measured 0.87x-1.00x the throughput of two
at one to eight clients (the engine thread and MLX's threads allocating under one lock),
where these thresholds measured 0.90x-1.03x and 0.92x-1.01x, within this machine's noise.

glibc reads these variables once, when the process starts (a mallopt of the arena count at
run time came too late: 145-160 MiB), so the command starts itself again with them set: exec
keeps the process id, so whoever started the server still holds it. Values the user set are
kept.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Callable, Dict, Optional, Sequence

HEAP_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 20),
}


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
