"""--split, defined here once for `ds4tp run`, `serve`, `bench` and the spawned ranks, and its
one check, which turns it (and DS4_TP_MEMORY_LIMIT_BYTES) into a SplitSettings."""

from __future__ import annotations

import argparse

from ..split.measure import MEMORY_LIMIT_ENV, memory_limit
from ..split.share import SplitSettings, SplitShare

SPLIT_HELP = ("the share of the model each machine holds, rank 0's part first: 'even' (default), "
              "'A:B' (e.g. 3:1: the leader keeps three quarters of every split count; the nearest "
              "share the model's counts allow is used and logged), or 'auto': each rank measures "
              "its usable memory and its speed on a matrix-vector product at start, and the leader "
              "picks the share that makes both finish each token together and fits both memories "
              "(machines within 10%% of each other split evenly; a model that fits no share is "
              f"refused before loading; {MEMORY_LIMIT_ENV} caps what a rank reports). The leader's "
              "share decides: the worker loads what the leader sends, and logs it when its own "
              "--split differs (a worker needs no --split)")


def add_split_arg(p: argparse.ArgumentParser) -> None:
    """--split even|auto|A:B (default: even on the leader, the leader's on the worker)."""
    p.add_argument("--split", default=None, metavar="even|auto|A:B", help=SPLIT_HELP)


def split_from_args(args: argparse.Namespace, command: str) -> SplitSettings:
    """The checked SplitSettings of --split and DS4_TP_MEMORY_LIMIT_BYTES; a bad value exits
    naming it and the fix."""
    try:
        share = SplitShare.parse(args.split) if args.split is not None else SplitShare()
        if len(share.parts) > 2:
            raise ValueError(f"--split {args.split} names {len(share.parts)} parts for a pair; "
                             f"give two, rank 0's first (e.g. 3:1)")
        return SplitSettings(share, given=args.split is not None, memory_limit=memory_limit())
    except ValueError as exc:
        raise SystemExit(f"ds4tp {command}: {exc}") from None
