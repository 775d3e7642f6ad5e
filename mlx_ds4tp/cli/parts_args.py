"""--model left out on a worker (at --coordinator's address or found by discovery), --parts-dir
and --parts-max-gb for run and serve: defined once,
checked into the model's directory (None: this worker receives its part from the leader) and a
PartsSettings (checkpoint/parts_cache.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from ..checkpoint.parts_cache import DEFAULT_PARTS_DIR, PartsSettings
from .model_arg import add_model_arg, model_path


def add_model_or_part_args(p: argparse.ArgumentParser) -> None:
    """--model, which a worker may leave out (it receives its part), and where it keeps that part."""
    add_model_arg(p, required=False)
    p.add_argument("--parts-dir", default=None, metavar="DIR",
                   help=f"a worker without --model: where it keeps the part the leader sends it "
                        f"(default {DEFAULT_PARTS_DIR})")
    p.add_argument("--parts-max-gb", type=float, default=None, metavar="GB",
                   help="a worker without --model: the most its parts directory holds; the least "
                        "recently used parts are removed first (default: no bound)")


def model_or_part(args: argparse.Namespace, command: str, role: Optional[str]) -> Optional[Path]:
    """--model's directory, or None for a worker given none (it receives its part). Exits naming
    the flag when a rank that must hold the model has none."""
    if args.model is not None:
        if args.parts_dir is not None or args.parts_max_gb is not None:
            raise SystemExit(f"ds4tp {command}: --parts-dir and --parts-max-gb are for a worker "
                             "without --model; leave them out or leave --model out")
        return model_path(args.model, download=role == "leader")
    if role != "worker" or getattr(args, "listen", None) is not None:
        raise SystemExit(f"ds4tp {command}: --model is required, but on a worker (--role worker with "
                         "--coordinator HOST PORT, or found by discovery: --role worker --interface NAME"
                         + (", or no --prompt" if command == "run" else "")
                         + "), which then receives its part from the leader")
    return None


def parts_from_args(args: argparse.Namespace, command: str) -> PartsSettings:
    """The PartsSettings the flags give; exits naming the flag when one is out of range."""
    limit = None if args.parts_max_gb is None else int(args.parts_max_gb * 1e9)
    try:
        return PartsSettings(Path(args.parts_dir) if args.parts_dir else DEFAULT_PARTS_DIR, limit)
    except ValueError as exc:
        raise SystemExit(f"ds4tp {command}: {exc}") from None
