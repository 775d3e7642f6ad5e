"""A serving group formed again at another size (serve/resize.py decides when): the RESIZE a
leader sends each member (the new size, the member's rank in it, the share), the share the
ranks left take (the leader's started share scaled to them), whether their memory holds the
model at that share, and the bring-up of one rank into the new group: joined at its new rank,
the share agreed (SPLIT, as at a first start), its new part loaded (from its own disk, or
received from the leader by a worker without --model). A group of one is the leader alone: the
whole model, no links."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from .. import gate_ops
from ..base.log import log
from ..errors import FrameError
from ..link.config import Regrouping
from ..link.hello import RankFigures
from ..link.wire import MAX_MESH_SIZE, RESIZE_HEAD
from ..split.agree import agree_share, model_parts
from ..split.auto import MARGIN_SHARE, RESERVE_BYTES, ModelNeed, memory_caps
from ..split.part_delivery import load_rank_part
from ..split.share import EVEN, SplitSettings, SplitShare
from .join_and_load import Joined

_GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Regroup:
    """The group a member joins next: its size, this member's rank in it, the share (EVEN or
    one part per rank, rank 0's first)."""

    size: int
    rank: int
    share: SplitShare

    def pack(self) -> bytes:
        parts = self.share.parts
        return RESIZE_HEAD.pack(self.size, self.rank, len(parts)) + b"".join(
            p.to_bytes(2, "little") for p in parts)

    @classmethod
    def unpack(cls, payload: bytes) -> "Regroup":
        if len(payload) < RESIZE_HEAD.size:
            raise FrameError(f"RESIZE payload is {len(payload)} bytes, need {RESIZE_HEAD.size}")
        size, rank, count = RESIZE_HEAD.unpack_from(payload)
        body = payload[RESIZE_HEAD.size:]
        if len(body) != 2 * count or count not in (0, size):
            raise FrameError(f"RESIZE names {count} share parts in {len(body)} bytes for {size} ranks")
        if not 0 < rank < size <= MAX_MESH_SIZE:
            raise FrameError(f"RESIZE gives this worker rank {rank} of {size}")
        parts = tuple(int.from_bytes(body[i:i + 2], "little") for i in range(0, len(body), 2))
        if parts and min(parts) == 0:
            raise FrameError(f"RESIZE's share {parts} leaves a rank with nothing")
        return cls(size, rank, SplitShare(parts) if parts else EVEN)


def share_of(started: SplitShare, started_size: int, members: Sequence[int]) -> SplitShare:
    """The share of the ranks `members` (their places in the started group, in order): the
    started share's parts of those ranks (even stays even), reduced."""
    if not started.parts:
        return EVEN
    parts = [started.parts[r] for r in members] if len(started.parts) == started_size else [1] * len(members)
    if len(parts) < 2 or len(set(parts)) == 1:
        return EVEN
    return SplitShare.parse(":".join(map(str, parts)))


def memory_refusal(need: ModelNeed, figures: Sequence[RankFigures], share: SplitShare) -> Optional[str]:
    """Why the ranks whose memories `figures` gives (their new order) cannot hold the model at
    `share` (weights, the KV budget, a margin and a reserve each, as --split auto counts them),
    or None when each part fits. A rank that measured nothing (0) is not refused for it."""
    size = len(figures)
    if size == 1:
        kept = [1.0]
    elif need.path is not None:
        kept = list(model_parts(need, size)["parts"](share))
    else:
        wanted = share.wanted(size)
        kept = [p / sum(wanted) for p in wanted]
    caps = memory_caps(need, figures)
    short = [r for r, (part, cap, f) in enumerate(zip(kept, caps, figures)) if f.memory_bytes and part > cap]
    if not short:
        return None
    needed = sum(part * need.total * (1 + MARGIN_SHARE) + RESERVE_BYTES for part in kept)
    have = sum(f.memory_bytes for f in figures)
    each = ", ".join(f"rank {r} needs {_size(kept[r] * need.total * (1 + MARGIN_SHARE) + RESERVE_BYTES)} "
                     f"and has {_size(figures[r].memory_bytes)}" for r in short)
    return (f"the {size} rank{'s' if size > 1 else ''} left cannot hold the model: it needs "
            f"{_size(needed)} ({_size(need.weight_bytes)} of weights, {_size(need.kv_bytes)} of KV cache, "
            f"{MARGIN_SHARE:.0%} and {_size(RESERVE_BYTES)} a rank) and they have {_size(have)} ({each}); "
            "start the lost Mac again, or free memory")


def _size(nbytes: float) -> str:
    """Bytes as the refusal names them: GiB with two decimals, MiB below 1 GiB."""
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= _GIB else f"{nbytes / (1 << 20):.1f} MiB"


# A test hook, never set in use: a worker told RESIZE waits until this file exists before it
# joins the new group, so a process-level test puts a restarted rank's JOIN at the leader's
# door ahead of the members' (tests/test_serve_shrink.py) instead of racing them.
TEST_WAIT_FILE_ENV = "DS4_TP_TEST_RESIZE_WAIT_FILE"


def join_regrouped(link_identity: tuple, regroup: Regroup, model_path: Optional[Path], parts) -> Joined:
    """A worker's side: join the leader's new group at regroup.rank (link_identity: what its
    last group was joined with, gate_ops.joined_with), take the leader's share (which must be
    regroup.share) and load this rank's new part. The group is closed when a later step fails."""
    wait_file = os.environ.get(TEST_WAIT_FILE_ENV)
    if wait_file:
        log(f"{TEST_WAIT_FILE_ENV}: test hook: waiting for {wait_file} before joining the group of {regroup.size}")
        deadline = time.monotonic() + 600.0
        while not os.path.exists(wait_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{TEST_WAIT_FILE_ENV}: {wait_file} did not appear within 600 s")
            time.sleep(0.05)
    link, identity = link_identity
    link = dataclasses.replace(link, size=regroup.size, ask_rank=regroup.rank)
    group = gate_ops.init_pair(link, identity)
    return _load(group, SplitSettings(regroup.share), model_path, parts, ModelNeed(0))


def lead_regrouped(link_identity: tuple, share: SplitShare, size: int, model_path: Path, parts,
                   need: ModelNeed, regrouping: Regrouping) -> Joined:
    """The leader's side: its new group of `size` (the members were told RESIZE, and its door
    holds any other rank as `regrouping` says), the share sent (SPLIT) and its part loaded;
    `size` 1: the whole model here, no group."""
    if size == 1:
        from mlx_lm import load

        t0 = time.perf_counter()
        model, tokenizer = load(str(model_path))
        log(f"weights loaded in {time.perf_counter() - t0:.1f} s (rank 0 alone: the whole model)")
        from .one_rank import NoGroup

        return Joined(NoGroup(), model, tokenizer, EVEN)
    link, identity = link_identity
    group = gate_ops.init_pair(dataclasses.replace(link, size=size, ask_rank=None, regrouping=regrouping), identity)
    return _load(group, SplitSettings(share), model_path, parts, need)


def _load(group: Any, split: SplitSettings, model_path: Optional[Path], parts, need: ModelNeed) -> Joined:
    try:
        share = agree_share(group, split, need)
        t0 = time.perf_counter()
        model, tokenizer = load_rank_part(group, model_path, share, parts)
        log(f"weights loaded in {time.perf_counter() - t0:.1f} s (rank {group.rank()} of {group.size()})")
    except BaseException:
        group.close()
        raise
    return Joined(group, model, tokenizer, share)


__all__ = ["Regroup", "join_regrouped", "lead_regrouped", "memory_refusal", "share_of"]
