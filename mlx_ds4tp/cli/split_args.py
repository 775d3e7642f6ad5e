"""--split, defined here once for `ds4tp run`, `serve`, `bench` and the spawned ranks, and its
one check, which turns it (and DS4_TP_MEMORY_LIMIT_BYTES) into a SplitSettings."""

from __future__ import annotations

import argparse
from typing import Optional

from ..split.measure import MEMORY_LIMIT_ENV, memory_limit
from ..split.share import SplitSettings, SplitShare

SPLIT_HELP = ("the share of the model each machine holds, one part per rank, rank 0's first: "
              "'even' (default; from three ranks, the nearest the model's counts allow, e.g. 3:3:2 "
              "for 8 KV heads on 3, logged), 'A:B[:C...]' (e.g. 3:1: the leader keeps three "
              "quarters of every split count; 2:1:1 on three ranks; the nearest share the model's "
              "counts allow is used and logged), or 'auto': each rank measures its usable memory "
              "and its speed on a matrix-vector product at start, and the leader picks the share "
              "that makes all finish each token together and fits every memory (machines within "
              "10%% of each other split evenly; a model that fits no share is refused before "
              f"loading; {MEMORY_LIMIT_ENV} caps what a rank reports). The leader's share decides: "
              "a worker loads what the leader sends, and logs it when its own --split differs (a "
              "worker needs no --split)")


def add_split_arg(p: argparse.ArgumentParser) -> None:
    """--split even|auto|A:B[:C...] (default: even on the leader, the leader's on the worker)."""
    p.add_argument("--split", default=None, metavar="even|auto|A:B[:C...]", help=SPLIT_HELP)


def split_from_args(args: argparse.Namespace, command: str, ranks: Optional[int] = 2) -> SplitSettings:
    """The checked SplitSettings of --split and DS4_TP_MEMORY_LIMIT_BYTES for a group of `ranks`
    (ranks_from_args'; None: the leader's, which a worker cannot check its parts against: the
    leader's share decides anyway); a bad value exits naming it and the fix."""
    try:
        share = SplitShare.parse(args.split) if args.split is not None else SplitShare()
        if share.parts and ranks is not None and len(share.parts) != ranks:
            example = ":".join(["2"] + ["1"] * (ranks - 1))
            raise ValueError(f"--split {args.split} names {len(share.parts)} parts for {ranks} ranks; "
                             f"give one part per rank, rank 0's first (e.g. {example})")
        return SplitSettings(share, given=args.split is not None, memory_limit=memory_limit())
    except ValueError as exc:
        raise SystemExit(f"ds4tp {command}: {exc}") from None
