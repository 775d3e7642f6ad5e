"""`ds4tp run`: one rank of a generation split over 2 to 8 machines (--ranks N, default 2). The
leader tokenizes the prompt, samples and streams the text on stdout; every worker runs the same
forward passes on its part, in lockstep. Each machine runs its own rank (`ds4tp demo` runs them
all on this one)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional, Tuple

from ..link.config import LinkSettings
from ..lockstep.settings import DraftSettings, RunSettings
from .draft_args import add_draft_args, check_draft_args
from .pair_args import add_lockstep_rank_args, check_at_least, lockstep_join
from .parts_args import add_model_or_part_args, model_or_part, parts_from_args
from .sampling_args import add_sampling_args, options_from_args
from .split_args import add_split_arg, split_from_args

HELP = "one rank of a generation split over 2 to 8 machines"
ROLE_HELP = ("this process's rank, 'leader' (rank 0: --prompt; prints the text) or 'worker' "
             "(rank 1 and up); without --listen/--coordinator the rank with --prompt leads and the "
             "others find it (--interface); run every other rank on its own machine")


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp run` (examples/pair_generate.py takes the same)."""
    add_model_or_part_args(p)
    p.add_argument("--prompt", default=None, help="leader: the prompt text (required there)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    add_sampling_args(p, seed_default=0)
    add_split_arg(p)
    p.add_argument("--debug-hash", type=int, default=0, metavar="N",
                   help="compare a hash of the logits with the worker every N tokens and stop on "
                        "divergence (default 0: off)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="feed the prompt as raw text (default: the model's chat template, when it has one)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="leader: the answer is JSON that validates against this JSON Schema file "
                        "(constrained decoding on every rank; compact JSON)")
    add_draft_args(p, "the ranks verify the drafts in one forward a round")
    add_lockstep_rank_args(p, ROLE_HELP)


def check_args(args: argparse.Namespace) -> Tuple[LinkSettings, Optional[str], RunSettings]:
    """The flags of one `ds4tp run` rank checked once and resolved: the rank's link settings,
    the model's directory (None: a worker that receives its part) and what the leader generates.
    Bad flags exit naming the flag."""
    # Finding its peer, the rank with the prompt leads; the other works for the first such leader.
    want = "lead" if args.role == "leader" or (args.prompt and args.role != "worker") else "work"
    join = lockstep_join(args, "run", want, " --prompt TEXT")
    if (join.address.role == "leader" or (join.discovery and join.discovery.want == "lead")) and not args.prompt:
        raise SystemExit("ds4tp run: the leader needs --prompt TEXT")
    check_at_least("run", (("--max-tokens", args.max_tokens, 1), ("--debug-hash", args.debug_hash, 0)))
    check_draft_args("run", args)
    sampling = options_from_args(args)
    if args.json_schema:
        sampling = dataclasses.replace(sampling, grammar=_schema_grammar(args.json_schema))
    if (args.draft_model or args.prompt_lookup) and sampling.processed:
        raise SystemExit("ds4tp run: speculative decoding (--draft-model, --prompt-lookup) takes no "
                         "--repetition-penalty or --json-schema here: leave it out")
    draft = DraftSettings(args.draft_model, args.prompt_lookup, args.num_draft_tokens)
    settings = RunSettings(prompt=args.prompt or "", max_tokens=args.max_tokens,
                           chat=not args.no_chat_template, sampling=sampling,
                           debug_hash=args.debug_hash, draft=draft, split=split_from_args(args, "run", join.ranks),
                           parts=parts_from_args(args, "run"))
    path = model_or_part(args, "run", "worker" if want == "work" else args.role)
    return join.link, None if path is None else str(path), settings


def _schema_grammar(path: str) -> str:
    """The grammar of a --json-schema file; exits naming the file and what is wrong."""
    from ..lockstep.errors import GrammarError
    from ..lockstep.sampling.grammar import json_schema_grammar

    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
        return json_schema_grammar(schema)
    except (OSError, ValueError, GrammarError) as exc:
        raise SystemExit(f"ds4tp run: --json-schema {path}: {exc}; give a file holding one JSON Schema "
                         "object") from None


def main(args: argparse.Namespace) -> int:
    from ..lockstep.run import run_rank

    return run_rank(*check_args(args))
