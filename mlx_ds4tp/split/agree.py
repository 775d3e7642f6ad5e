"""Both ranks of a pair load with the same share: the leader's. Once a join, before any weight
is read, the leader resolves its `--split` (auto: split/auto.py on both hellos' figures), logs
it and sends it (SPLIT); the worker takes it. A worker started with a different share is told
the leader's and logs both; one that already holds a split model (a --rejoin worker) refuses a
leader whose share differs, since its weights cannot change under it."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..base.log import log
from ..collectives.backend import PairGroup
from ..collectives.mesh import MeshGroup
from ..errors import HelloMismatchError
from ..link.config import LinkSettings
from ..link.hello import hear_share, tell_share
from .apply import ModelCuts
from .auto import ModelNeed, choose_share_among, figures_line
from .measure import measure_rank
from .share import EVEN, SplitSettings, SplitShare


def agree_share(group: Any, split: SplitSettings, need: ModelNeed,
                held: Optional[SplitShare] = None) -> SplitShare:
    """The share this rank loads with, the same on both ranks (resolved, never "auto").

    held: the share this rank's model is already split by (a leader taking a worker back sends
    it as it is; a --rejoin worker refuses any other). ShareRefusedError (leader) or TransportError
    (worker, with the leader's message) when the model fits no share, before any weight is read.
    """
    if isinstance(group, MeshGroup):
        return _agree_in_mesh(group, split, need, held)
    if not isinstance(group, PairGroup):
        if split.share.auto:
            raise ValueError("--split auto needs a pair of our own (--transport auto, tcp or rdma): "
                             "MLX's own group carries no figures; give --split even or A:B")
        return held or split.share
    pair = group.pair
    if pair.rank == 0:
        share = held or _leader_share(pair, split, need)
        tell_share(pair.control, share.parts or (1, 1))
        return share
    parts = hear_share(pair.control)
    share = EVEN if len(set(parts)) == 1 else SplitShare(tuple(parts))
    leader, mine = pair.peer_hello.figures, pair.mine.figures
    figures = (f" ({figures_line('leader', leader)}; {figures_line('worker', mine)})"
               if leader.measured and mine.measured else "")
    log(f"split {share}: the leader's share{figures}")
    if held is not None and held != share:
        raise HelloMismatchError(f"this worker's model is split {held} and the leader's share is "
                                 f"{share}; start the leader with --split {held}, or restart the worker")
    if split.given and split.share != share and not split.share.auto:
        log(f"split: this side asked for {split.share}; the leader's share ({share}) decides")
    return share


def _agree_in_mesh(group: MeshGroup, split: SplitSettings, need: ModelNeed,
                   held: Optional[SplitShare]) -> SplitShare:
    """agree_share over a mesh of N ranks: the leader resolves its share and sends it (SPLIT,
    one part per rank) on each worker's link, in rank order; each worker takes it."""
    size, pairs = group.size(), group.mesh.pairs
    if group.rank() == 0:
        share = held or _mesh_leader_share(group, split, need)
        for peer in range(1, size):
            tell_share(pairs[peer].control, share.parts or (1,) * size)
        return share
    parts = hear_share(pairs[0].control, size)
    share = EVEN if len(set(parts)) == 1 else SplitShare(tuple(parts))
    log(f"split {share}: the leader's share, rank {group.rank()} of {size}")
    if held is not None and held != share:
        raise HelloMismatchError(f"this worker's model is split {held} and the leader's share is "
                                 f"{share}; start the leader with --split {held}, or restart the worker")
    if split.given and split.share != share and not split.share.auto:
        log(f"split: this side asked for {split.share}; the leader's share ({share}) decides")
    return share


def _mesh_leader_share(group: MeshGroup, split: SplitSettings, need: ModelNeed) -> SplitShare:
    size, pairs = group.size(), group.mesh.pairs
    if not split.share.auto:
        log(f"split {split.share}: the leader's share, sent to the {size - 1} workers")
        return split.share
    figures = [pairs[1].mine.figures] + [pairs[peer].peer_hello.figures for peer in range(1, size)]
    log("split auto: " + "; ".join(figures_line(f"rank {r}", f) for r, f in enumerate(figures)))
    try:
        share = choose_share_among(figures, need, **model_parts(need, size))
    except ValueError as exc:
        for peer in range(1, size):
            pairs[peer].control.send_error(f"split auto: {exc}")
        raise
    log(f"split auto: {share} (rank 0's part first), sent to the {size - 1} workers")
    return share


def _leader_share(pair: Any, split: SplitSettings, need: ModelNeed) -> SplitShare:
    if not split.share.auto:
        log(f"split {split.share}: the leader's share, sent to the worker")
        return split.share
    mine, theirs = pair.mine.figures, pair.peer_hello.figures
    log(f"split auto: {figures_line('leader', mine)}; {figures_line('worker', theirs)}")
    try:
        share = choose_share_among([mine, theirs], need, **model_parts(need, 2))
    except ValueError as exc:
        pair.control.send_error(f"split auto: {exc}")
        raise
    log(f"split auto: {share} (rank 0's part first), sent to the worker")
    return share


def model_cuts(need: ModelNeed) -> dict:
    """choose_share's view of what the model's counts allow (none without the model's path)."""
    if need.path is None:
        return {}
    cuts = ModelCuts(need.path)
    return {"granules": cuts.granules, "kept": cuts.kept}


def model_parts(need: ModelNeed, size: int) -> dict:
    """choose_share_among's view, for `size` ranks, of what the model's counts allow (none
    without the model's path): the granules, and each rank's part of the weights a share keeps."""
    if need.path is None:
        return {}
    cuts = ModelCuts(need.path)
    return {"granules": cuts.granules, "parts": lambda share: cuts.parts(share, size)}


def with_figures(link: LinkSettings, split: SplitSettings) -> LinkSettings:
    """`link` with this rank's figures measured, when it measures them (SplitSettings.measures),
    so its hello carries them."""
    if not split.measures(link.address.role):
        return link
    return dataclasses.replace(link, figures=measure_rank(split.memory_limit))


__all__ = ["agree_share", "model_cuts", "model_parts", "with_figures"]
