"""The leader's memo of the parts it sends: what does not change between two transfers of one part
(a second worker of the same share, a transfer resumed after a cut, a worker that re-joins), so
only the first pays for it: the part's file plan, the traced layout of its cut (which indices the
rank keeps: split/apply.py's traced_layout, about 0.25 s a GB of weights on these CPUs, as much
as reading the bytes) and each part file's digest once a send has read that file whole.

Kept in this process's memory by (model directory, each of its files' name, size, mtime, ctime
and inode, rank, size, share), and on the leader's disk by the same key and the code that made
it (split/part_memo_file.py: a leader started again does not plan, trace or hash it again): a
model file replaced or rewritten is a new key, so nothing is reused for other bytes. The ctime
is there because a write changes it and no tool can set it back (a byte flipped in place with
the mtime restored is still a new key); bytes rotting on the disk under unchanged stats are the
worker's to catch, as follows.

A digest from the memo is offered with the file and is what the worker checks
the bytes it receives against: bytes changed under the same stats would not match it, and the
worker refuses them (fetches the file again, then errs) instead of loading them.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Dict, Tuple

from ..collectives.backend import cut_only_group
from .part_memo_file import load_memo, save_memo
from .part_plan import PartPlan, plan_part
from .share import SplitShare
from .units import Layout

MAX_MEMOS = 16  # parts memoized at once (a plan and a layout each: kilobytes to a few MB)


@dataclasses.dataclass
class PartMemo:
    """One part's memo: its plan, the cut-only group its layout was traced for (the cut checks
    that group by identity, so the same object goes with the layout), the layout (traced with
    the plan) and the digests of the part files sent whole so far."""

    plan: PartPlan
    group: Any
    key: Tuple[Any, ...]
    layout: Layout
    digests: Dict[str, str] = dataclasses.field(default_factory=dict)


_memos: Dict[Tuple[Any, ...], PartMemo] = {}
_lock = threading.Lock()


def files_stamp(model_path: Path) -> Tuple[Tuple[str, int, int, int, int], ...]:
    """(name, size, mtime and ctime in ns, inode) of every file at the top of the model's directory."""
    stamp = []
    for path in sorted(Path(model_path).iterdir()):
        if path.is_file():
            st = path.stat()
            stamp.append((path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(stamp)


def part_memo(model_path: Path, rank: int, size: int, share: SplitShare) -> PartMemo:
    """The memo of `rank`'s part (of `size` ranks, `share`) of the model at model_path as its files
    are now: the one kept from before, or a new one with its plan made (no weight read)."""
    model_path = Path(model_path)
    key = (str(model_path.resolve()), files_stamp(model_path), rank, size, str(share))
    with _lock:
        memo = _memos.get(key)
    if memo is not None:
        return memo
    group = cut_only_group(rank, size)
    kept = load_memo(key, group)
    if kept is not None:
        plan, layout, digests = kept
        memo = PartMemo(plan, group, key, layout, digests)
    else:
        plan, layout = plan_part(model_path, group, share)
        memo = PartMemo(plan, group, key, layout)
    with _lock:
        memo = _memos.setdefault(key, memo)
        while len(_memos) > MAX_MEMOS:
            del _memos[next(iter(_memos))]  # the oldest memo first
    return memo


def keep_on_disk(memo: PartMemo) -> None:
    """Write the memo to the leader's disk (a leader started again reads it instead of planning,
    tracing and hashing): after a transfer, with what it learned."""
    save_memo(memo.key, memo.plan, memo.layout, memo.group, memo.digests)


def forget_parts() -> None:
    """Drop every memo in memory, as a leader started again has none (the memo files on its disk
    stay: remove split/part_memo_file.py's memo_dir() too for a first transfer's cost)."""
    with _lock:
        _memos.clear()


__all__ = ["MAX_MEMOS", "PartMemo", "files_stamp", "forget_parts", "keep_on_disk", "part_memo"]
