"""The sampling flags of `ds4tp run` (what it samples with) and `ds4tp serve` (the defaults of
a request that names none), turned into one SamplingOptions value here."""

from __future__ import annotations

import argparse
from typing import Optional

from ..lockstep.sampling.options import SamplingOptions


def add_sampling_args(p: argparse.ArgumentParser, seed_default: Optional[int] = None) -> None:
    """--temp, --top-p, --top-k, --min-p, --repetition-penalty and --seed."""
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling threshold (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=0.0,
                   help="mlx-lm's repetition penalty over the last 20 tokens (0 = off)")
    p.add_argument("--seed", type=int, default=seed_default,
                   help="random seed for sampling" + (f" (default {seed_default})"
                                                      if seed_default is not None else ""))


# SamplingOptions' field names as the flags spell them.
_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
          "repetition_penalty": "--repetition-penalty", "seed": "--seed",
          "repetition_context_size": "--repetition-context-size"}


def options_from_args(args: argparse.Namespace) -> SamplingOptions:
    """SamplingOptions from the flags of add_sampling_args; SystemExit naming a bad flag."""
    options = SamplingOptions(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                              min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              seed=args.seed)
    try:
        options.check()
    except ValueError as exc:
        field = str(exc).split("=")[0]
        raise SystemExit(f"ds4tp: {_FLAGS.get(field, field)}: {exc}") from None
    return options
