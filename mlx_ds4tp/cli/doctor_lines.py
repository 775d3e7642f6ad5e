"""The lines `ds4tp doctor` prints, one a check: `[  ok] what: detail`, `[warn] ...` (works, but
slower or degraded) or `[FAIL] ...` (cannot run, with the fix). Its own module so the pair's
checks (doctor.py) and the N ranks' (doctor_mesh.py) print alike without importing each other."""

from __future__ import annotations

from typing import Tuple

OK, WARN, FAIL = "ok", "warn", "FAIL"
# (status, what was checked): the doctor counts the FAILs by name at the end.
Check = Tuple[str, str]


def line(status: str, what: str, detail: str) -> Check:
    """Print one check's line now (flushed: a doctor that then hangs has said how far it got)."""
    print(f"[{status:>4}] {what}: {detail}", flush=True)
    return status, what
