"""The entry point of a rank that this package spawns on this machine
(`python -m mlx_ds4tp.cli.rank KIND ...`, built by onehost.localpair.rank_command).

Not a user command: the public CLI (`ds4tp`) starts these for the bench and
the demo. Each kind runs one rank and prints its records as JSON lines on
stdout (rank 0's are the ones the parent reads).

    gate        one rank of the transport gate bench (--role, --listen/--coordinator)
    ring-gate   one rank of mx.distributed's ring all_sum (MLX_HOSTFILE, MLX_RANK)
    mesh-gate   one rank of `ds4tp bench --ranks`: our group of --size ranks (rank --rank)
    ring-ranks  one rank of `ds4tp bench --ranks`: MLX's ring at the hostfile's size
    shard-model one rank of mlx-lm's model.shard() over MLX's ring (--transport mlx;
                MLX_HOSTFILE, MLX_RANK) or our pair (--transport tcp|rdma, --role, --listen/--coordinator)
    ceiling     one rank of the compute ceiling (half the model, gates skipped)
    run         one rank of `ds4tp run`, plus --tokens-out FILE and --no-eos
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import report_errors, run as run_command
from .model_arg import add_model_arg
from .pair_args import MLX, add_pair_args, add_transport_args, link_from_args, one_rank_address


def _print_json(records: List[Dict]) -> int:
    """The records as JSON lines (what the parent reads); exit code 0."""
    for rec in records:
        print(json.dumps(rec), flush=True)
    return 0


def _gate(args) -> int:
    from ..bench import gates as bench_gates

    return _print_json(bench_gates.run_rank(one_rank_address(args, "gate", ""), args.transport,
                                            args.rdma_device, args.bytes, args.iters))


def _ring_gate(args) -> int:
    from ..bench import gates as bench_gates

    return _print_json(bench_gates.ring_rank(args.bytes, args.iters))


def _mesh_gate(args) -> int:
    from ..bench import ranks as bench_ranks

    return _print_json(bench_ranks.mesh_rank(args.rank, args.size, args.port, args.transport,
                                             args.rdma_device, args.iters))


def _ring_ranks(args) -> int:
    from ..bench import ranks as bench_ranks

    return _print_json(bench_ranks.ring_rank(args.iters))


def _shard_model(args) -> int:
    from ..bench import model as bench_model

    link = None if args.transport == MLX else \
        link_from_args(args, one_rank_address(args, "shard-model", ""), "shard-model")
    return _print_json(bench_model.shard_model_rank(args.model, args.max_tokens, args.prompt_tokens, link))


def _ceiling(args) -> int:
    from ..bench import model as bench_model

    return _print_json(bench_model.ceiling_rank(one_rank_address(args, "ceiling", ""), args.model,
                                                args.max_tokens, args.prompt_tokens))


def _run(args) -> int:
    from ..lockstep.run import run_rank

    link, model, settings = run_command.check_args(args)
    settings = dataclasses.replace(
        settings, tokens_out=args.tokens_out, stop_at_eos=not args.no_eos, prompt_tokens=args.prompt_tokens,
        draft=dataclasses.replace(settings.draft, recorded_draft=args.recorded_draft))
    return run_rank(link, model, settings)


ROLE_HELP = "this rank: 'leader' (--listen) or 'worker' (--coordinator)"


@dataclasses.dataclass(frozen=True)
class _Kind:
    """A spawned rank's kind: what runs it and which flags it takes (the parent gives them all)."""

    func: Callable[[argparse.Namespace], int]
    counts: Tuple[str, ...]  # required whole-number flags, e.g. --iters
    model: bool = False  # --model
    transport: bool = False  # --transport, --rdma-device, ...
    pair: bool = False  # --role, --listen/--coordinator


_KINDS = {
    "gate": _Kind(_gate, ("--bytes", "--iters"), transport=True, pair=True),
    "ring-gate": _Kind(_ring_gate, ("--bytes", "--iters")),
    "mesh-gate": _Kind(_mesh_gate, ("--rank", "--size", "--port", "--iters"), transport=True),
    "ring-ranks": _Kind(_ring_ranks, ("--iters",)),
    "shard-model": _Kind(_shard_model, ("--max-tokens", "--prompt-tokens"), model=True, transport=True, pair=True),
    "ceiling": _Kind(_ceiling, ("--max-tokens", "--prompt-tokens"), model=True, pair=True),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the spawned ranks' command lines."""
    parser = argparse.ArgumentParser(prog="python -m mlx_ds4tp.cli.rank", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    for kind, spec in _KINDS.items():
        p = sub.add_parser(kind)
        if spec.model:
            add_model_arg(p)
        for flag in spec.counts:
            p.add_argument(flag, type=int, required=True)
        if spec.transport:
            add_transport_args(p)
        if spec.pair:
            add_pair_args(p, ROLE_HELP)
        p.set_defaults(func=spec.func)

    run = sub.add_parser("run")
    run_command.add_args(run)
    run.add_argument("--tokens-out", default=None, metavar="FILE",
                     help="leader: write the tokens record here (JSON); worker: its share and peak "
                          "resident memory")
    run.add_argument("--no-eos", action="store_true", help="decode --max-tokens whatever the model says")
    run.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                     help="leader: the prompt's tokens repeated to N tokens (the model bench)")
    run.add_argument("--recorded-draft", default=None, metavar="FILE",
                     help="leader: draft a known continuation (a JSON list of tokens, e.g. a plain "
                          "run's): speculative decoding's ceiling, every draft accepted (the bench)")
    run.set_defaults(func=_run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one spawned rank; errors are reported as the public CLI reports them."""
    args = build_parser().parse_args(argv)
    return report_errors(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
