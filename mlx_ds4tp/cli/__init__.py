"""The ``ds4tp`` command line (``python -m mlx_ds4tp`` is the same)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence, Tuple

from .. import transport as tr


def _add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=("leader", "worker"),
                   help="run one rank only (two machines); default: both ranks on 127.0.0.1")
    p.add_argument("--listen", nargs=2, metavar=("HOST", "PORT"), help="leader: address to listen on")
    p.add_argument("--coordinator", nargs=2, metavar=("HOST", "PORT"), help="worker: the leader's address")
    p.add_argument("--rdma-device", default=None, help="verbs device (e.g. rdma_en1) or 'ucsim'")
    p.add_argument("--secret", default=None,
                   help="shared secret both ranks must hold (default DS4_TP_SECRET; the variable "
                        "keeps it out of `ps`)")


def parse_address(pair: Optional[Sequence[str]], flag: str) -> Optional[Tuple[str, int]]:
    """(HOST, PORT) of a `--listen HOST PORT` style flag; exits naming the flag when PORT
    is not an integer."""
    if pair is None:
        return None
    host, port = pair
    try:
        return host, int(port)
    except ValueError:
        raise SystemExit(f"ds4tp: {flag} {host} {port}: PORT must be an integer, e.g. 9911") from None


def _check_role_args(args) -> None:
    if args.role == "leader" and (args.listen is None or args.coordinator is not None):
        raise SystemExit("ds4tp: --role leader needs --listen HOST PORT (and no --coordinator)")
    if args.role == "worker" and (args.coordinator is None or args.listen is not None):
        raise SystemExit("ds4tp: --role worker needs --coordinator HOST PORT (and no --listen)")
    if args.role is None and (args.listen or args.coordinator):
        raise SystemExit("ds4tp: --listen/--coordinator need --role leader|worker")


def cmd_bench(args) -> int:
    from ..bench import report as bench

    if args.bytes <= 0 or args.bytes % 4:
        raise SystemExit(f"ds4tp bench: --bytes {args.bytes} must be a positive multiple of 4")
    if args.bytes > tr.GATE_MAX_BYTES:
        raise SystemExit(f"ds4tp bench: --bytes {args.bytes} is over the {tr.GATE_MAX_BYTES}-byte gate limit")
    if args.iters < 1:
        raise SystemExit(f"ds4tp bench: --iters {args.iters} must be >= 1")
    if args.serve:
        from ..bench import serve as serve_bench

        return serve_bench.main(args)
    if args.model:
        from ..link.identity import model_identity

        if args.max_tokens < 2:
            raise SystemExit(f"ds4tp bench: --max-tokens {args.max_tokens} must be >= 2")
        from ..bench.model import bench_model_dir

        args.model = bench_model_dir(args.model)  # a preset name ("moe-1g") is built first
        model_identity(args.model)  # raises a clear error when PATH is not a model directory
        if args.rounds < 1:
            raise SystemExit(f"ds4tp bench: --rounds {args.rounds} must be >= 1")
        if args.prompt_tokens < 1:
            raise SystemExit(f"ds4tp bench: --prompt-tokens {args.prompt_tokens} must be >= 1")
        return bench.main(args)
    _check_role_args(args)
    address = None
    if args.role is not None:
        address = parse_address(args.listen or args.coordinator, "--listen/--coordinator")
    return bench.main(args, address)


# ============================================================================
# run: one rank of a two-machine generation
# ============================================================================


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp run` (examples/pair_generate.py takes the same)."""
    from ..lockstep.sampling import add_sampling_args

    p.add_argument("--model", required=True,
                   help="an mlx-lm model directory or a Hugging Face repo id already downloaded "
                        "(the same model on both machines)")
    p.add_argument("--prompt", default=None, help="leader: the prompt text")
    p.add_argument("--max-tokens", type=int, default=128)
    add_sampling_args(p, seed_default=0)
    p.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto")
    p.add_argument("--rdma-gid-index", type=int, default=None)
    p.add_argument("--debug-hash", type=int, default=0, metavar="N",
                   help="compare a hash of the logits every N tokens; stop on divergence")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    _add_pair_args(p)


def check_run_args(args) -> Tuple[str, int]:
    """The flags of one `ds4tp run` rank checked; returns its listen/coordinator address."""
    if args.role is None:
        raise SystemExit("ds4tp run: give --role leader --listen HOST PORT or "
                         "--role worker --coordinator HOST PORT (`ds4tp demo` runs both here)")
    _check_role_args(args)
    address = parse_address(args.listen or args.coordinator, "--listen/--coordinator")
    if args.role == "leader" and not args.prompt:
        raise SystemExit("ds4tp run: the leader needs --prompt TEXT")
    if args.max_tokens < 1:
        raise SystemExit(f"ds4tp run: --max-tokens {args.max_tokens} must be >= 1")
    if args.debug_hash < 0:
        raise SystemExit(f"ds4tp run: --debug-hash {args.debug_hash} must be >= 0")
    from ..checkpoint.source import resolve_model_arg
    from ..lockstep.sampling import options_from_args

    options_from_args(args)
    args.model = str(resolve_model_arg(args.model))
    return address


def cmd_run(args) -> int:
    from ..lockstep import run as pair_run

    return pair_run.run(args, check_run_args(args))


# ============================================================================
# serve: an OpenAI-compatible HTTP server on the pair
# ============================================================================


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp serve` (HTTP flags named as mlx_lm.server names them)."""
    from ..lockstep.sampling import add_sampling_args

    p.add_argument("--model", required=True, help="an mlx-lm model directory or a Hugging Face "
                   "repo id already downloaded (the same model on both machines)")
    p.add_argument("--host", default="127.0.0.1", help="leader: HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="leader: HTTP port (default 8080)")
    p.add_argument("--api-key", default=None,
                   help="leader: require 'Authorization: Bearer KEY' on the API endpoints")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="answer length when a request gives no max_tokens")
    p.add_argument("--max-batch", type=int, default=32,
                   help="most sessions decoded together in one step (the rest wait)")
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt tokens per prefill chunk between decode steps (mlx-lm's default)")
    p.add_argument("--prompt-cache-size", type=int, default=10,
                   help="most stored prompt caches kept for reuse (LRU; 0 = no reuse)")
    p.add_argument("--debug-hash", type=int, default=0, metavar="N",
                   help="compare a hash of the logits with the worker every N decode steps")
    p.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto")
    p.add_argument("--rdma-gid-index", type=int, default=None)
    add_sampling_args(p)
    _add_pair_args(p)


def cmd_serve(args) -> int:
    from ..serve import pair as serve_main
    from ..checkpoint.source import resolve_model_arg
    from ..lockstep.sampling import options_from_args

    if args.role is None:
        raise SystemExit("ds4tp serve: give --role leader --listen HOST PORT (it serves HTTP on "
                         "--host/--port) or --role worker --coordinator HOST PORT")
    _check_role_args(args)
    address = parse_address(args.listen or args.coordinator, "--listen/--coordinator")
    for flag, value, low in (("--max-tokens", args.max_tokens, 1), ("--max-batch", args.max_batch, 1),
                             ("--prefill-step-size", args.prefill_step_size, 1),
                             ("--prompt-cache-size", args.prompt_cache_size, 0),
                             ("--debug-hash", args.debug_hash, 0), ("--port", args.port, 0)):
        if value < low:
            raise SystemExit(f"ds4tp serve: {flag} {value} must be >= {low}")
    options_from_args(args)
    return serve_main.run(args, address, resolve_model_arg(args.model))


def cmd_demo(args) -> int:
    from . import demo

    if args.max_tokens < 1:
        raise SystemExit(f"ds4tp demo: --max-tokens {args.max_tokens} must be >= 1")
    return demo.demo(args)


def cmd_doctor(args) -> int:
    from . import doctor

    return doctor.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4tp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="gate latency: tcp, rdma and the baselines")
    bench.add_argument("--transport", choices=("tcp", "rdma", "all", "auto"), default="all")
    bench.add_argument("--bytes", type=int, default=16384)
    bench.add_argument("--iters", type=int, default=5000)
    bench.add_argument("--json", action="store_true", help="one JSON record per line")
    bench.add_argument("--model", default=None, help="also time decode tok/s of this mlx-lm model "
                       "(a directory, or a preset built once: 150m, moe-1g): single process, our "
                       "pair (tcp, rdma) and mlx-lm's shard() on MLX's ring")
    bench.add_argument("--max-tokens", type=int, default=64, help="decode length for --model")
    bench.add_argument("--prompt-tokens", type=int, default=512,
                       help="prompt length for --model: prompt processing (prefill) is timed too")
    bench.add_argument("--rounds", type=int, default=3,
                       help="--model: run every contender this many times, in rotating order, "
                            "and report the median (default 3)")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="latency histogram per transport (needs matplotlib)")
    bench.add_argument("--serve", action="store_true",
                       help="`ds4tp serve` on 127.0.0.1: aggregate tok/s and time to first token "
                            "for 1, 2, 4 and 8 concurrent clients (--model, default the demo model)")
    bench.add_argument("--url", default=None, metavar="http://HOST:PORT",
                       help="--serve: measure this running `ds4tp serve` instead of starting one")
    bench.add_argument("--api-key", default=None, help="--serve --url: the server's API key")
    _add_pair_args(bench)
    bench.set_defaults(func=cmd_bench)

    run = sub.add_parser("run", help="one rank of a two-machine generation")
    add_run_args(run)
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the pair")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="both ranks on 127.0.0.1 with a small synthetic model")
    demo.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto")
    demo.add_argument("--rdma-device", default=None, help="'ucsim' for the emulated Thunderbolt device")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--prompt", default="The two machines agree that")
    demo.set_defaults(func=cmd_demo)

    doc = sub.add_parser("doctor", help="check what a pair needs and say what to fix")
    doc.add_argument("--peer", nargs=2, metavar=("HOST", "PORT"),
                     help="run a short gate round trip against `ds4tp doctor --listen` on the peer")
    doc.add_argument("--listen", nargs=2, metavar=("HOST", "PORT"),
                     help="wait for the peer's `ds4tp doctor --peer` and answer its gates")
    doc.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto")
    doc.add_argument("--rdma-device", default=None)
    doc.add_argument("--secret", default=None, help="shared secret (default DS4_TP_SECRET)")
    doc.add_argument("--model", default=None, metavar="PATH",
                     help="with --peer/--listen: compare this model directory's fingerprint with "
                          "the peer's at the hello and print both")
    doc.set_defaults(func=cmd_doctor)
    return parser


def report_errors(fn: Callable[[], int]) -> int:
    """fn's exit code; a transport, value or runtime error becomes one
    `ds4-tp: error:` line on stderr and exit code 1, Ctrl-C exit code 130."""
    try:
        return fn()
    except KeyboardInterrupt:
        return 130
    except (tr.TransportError, ValueError, RuntimeError) as exc:
        print(f"ds4-tp: error: {exc}", file=sys.stderr)
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `ds4tp` command: parse argv (default sys.argv) and run the subcommand."""
    args = build_parser().parse_args(argv)
    return report_errors(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
