"""The speculative-decoding flags `ds4tp run` and `ds4tp serve` share, and their one check."""

from __future__ import annotations

import argparse

from ..lockstep.settings import draft_tokens_problem
from .model_arg import model_path
from .pair_args import check_at_least


def add_draft_args(p: argparse.ArgumentParser, where: str) -> None:
    """--draft-model, --prompt-lookup and --num-draft-tokens; `where`: how the drafts are
    verified (the command's own words, ending the draft model's help)."""
    p.add_argument("--draft-model", default=None, metavar="PATH|REPO",
                   help="leader: speculative decoding with this small model of the same vocabulary "
                        f"(whole, on the leader): {where}")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="leader: speculative decoding drafting from the last N-gram's earlier "
                        "occurrence in the prompt and the text so far (no draft model; 0: off)")
    p.add_argument("--num-draft-tokens", type=int, default=3, metavar="K",
                   help="tokens drafted a round with --draft-model or --prompt-lookup (default 3, "
                        "mlx-lm's)")


def check_num_draft_tokens(command: str, k: int) -> None:
    """Exit naming --num-draft-tokens when `k` is out of the one range (lockstep/settings.py)."""
    problem = draft_tokens_problem(k)
    if problem:
        raise SystemExit(f"ds4tp {command}: --num-draft-tokens {problem}")


def check_draft_args(command: str, args: argparse.Namespace) -> None:
    """Exit naming the flag when the drafting flags are out of range or contradict; the draft
    model's path resolved as --model is."""
    check_at_least(command, (("--prompt-lookup", args.prompt_lookup, 0),))
    check_num_draft_tokens(command, args.num_draft_tokens)
    if args.draft_model and args.prompt_lookup:
        raise SystemExit(f"ds4tp {command}: --draft-model and --prompt-lookup are two ways to draft; "
                         "give one")
    if args.draft_model:
        args.draft_model = str(model_path(args.draft_model))
