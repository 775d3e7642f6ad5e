"""Both ranks of a pair load with the same share: the leader's. Once a join, before any weight
is read, the leader resolves its `--split` (auto: split/auto.py on both hellos' figures), logs
it and sends it (SPLIT); the worker takes it. A worker started with a different share is told
the leader's and logs both; one that already holds a split model (a --rejoin worker) refuses a
leader whose share differs, since its weights cannot change under it."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..base.log import log
from ..errors import HelloMismatchError
from ..link.config import LinkSettings
from ..link.hello import hear_share, tell_share
from .apply import ModelCuts
from .auto import ModelNeed, choose_share_among, figures_line
from .measure import measure_rank
from .share import EVEN, SplitSettings, SplitShare


def agree_share(group: Any, split: SplitSettings, need: ModelNeed,
                held: Optional[SplitShare] = None) -> SplitShare:
    """The share this rank loads with, the same on every rank (resolved, never "auto"): the
    leader resolves its share and sends it (SPLIT, one part per rank) on each worker's link, in
    rank order; each worker takes it.

    held: the share this rank's model is already split by (a leader taking a worker back sends
    it as it is; a --rejoin worker refuses any other). ShareRefusedError (leader) or TransportError
    (worker, with the leader's message) when the model fits no share, before any weight is read.
    """
    if not callable(getattr(group, "link_to", None)):
        if split.share.auto:
            raise ValueError("--split auto needs a group of our own (--transport auto, tcp or rdma): "
                             "MLX's own group carries no figures; give --split even or A:B")
        return held or split.share
    size, rank = group.size(), group.rank()
    if rank == 0:
        share = held or _leader_share(group, split, need)
        for peer in range(1, size):
            tell_share(group.link_to(peer).control, share.parts or (1,) * size)
        return share
    link = group.link_to(0)
    parts = hear_share(link.control, size)
    share = EVEN if len(set(parts)) == 1 else SplitShare(tuple(parts))
    leader, mine = link.peer_hello.figures, link.mine.figures
    figures = (f" ({figures_line('rank 0', leader)}; {figures_line(f'rank {rank}', mine)})"
               if leader.measured and mine.measured else "")
    log(f"split {share}: the leader's share, rank {rank} of {size}{figures}")
    if held is not None and held != share:
        raise HelloMismatchError(f"rank {rank}'s model is split {held} and the leader's share is "
                                 f"{share}; start the leader with --split {held}, or restart rank {rank}")
    if split.given and split.share != share and not split.share.auto:
        log(f"split: this side asked for {split.share}; the leader's share ({share}) decides")
    return share


def _leader_share(group: Any, split: SplitSettings, need: ModelNeed) -> SplitShare:
    size = group.size()
    workers = ", ".join(f"rank {peer}" for peer in range(1, size))
    if not split.share.auto:
        log(f"split {split.share}: the leader's share, sent to {workers}")
        return split.share
    links = [group.link_to(peer) for peer in range(1, size)]
    figures = [links[0].mine.figures] + [link.peer_hello.figures for link in links]
    log("split auto: " + "; ".join(figures_line(f"rank {r}", f) for r, f in enumerate(figures)))
    try:
        share = choose_share_among(figures, need, **model_parts(need, size))
    except ValueError as exc:
        for link in links:
            link.control.send_error(f"split auto: {exc}")
        raise
    log(f"split auto: {share} (rank 0's part first), sent to {workers}")
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
