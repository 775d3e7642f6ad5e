"""The ``ds4tp`` command line (``python -m mlx_ds4tp`` is the same)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence

from . import transport as tr


def _add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=("leader", "worker"),
                   help="run one rank only (two machines); default: both ranks on 127.0.0.1")
    p.add_argument("--listen", nargs=2, metavar=("HOST", "PORT"), help="leader: address to listen on")
    p.add_argument("--coordinator", nargs=2, metavar=("HOST", "PORT"), help="worker: the leader's address")
    p.add_argument("--rdma-device", default=None, help="verbs device (e.g. rdma_en1) or 'ucsim'")
    p.add_argument("--secret", default=None,
                   help="shared secret both ranks must hold (default DS4_TP_SECRET; the variable "
                        "keeps it out of `ps`)")


def _address(pair: Optional[Sequence[str]], flag: str):
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


def _print_records(records: List[dict], as_json: bool, keep_samples: bool = False) -> None:
    """keep_samples: a spawned rank passes its raw samples up to the parent."""
    for rec in records:
        if not keep_samples:
            rec = {k: v for k, v in rec.items() if k != "samples_us"}
        if as_json:
            print(json.dumps(rec), flush=True)
        elif "p50_us" in rec:
            print(f"{rec['name']:>22}  {rec['bytes']:>7} B  p50 {rec['p50_us']:8.1f} us  "
                  f"p99 {rec['p99_us']:8.1f} us  ({rec['iters']} iters)", flush=True)
        else:
            match = ("(gates skipped: the bound for any transport)" if rec["tokens_match"] is None
                     else f"tokens_match={rec['tokens_match']}")
            spread = ""
            if len(rec.get("tok_s_rounds", ())) > 1:
                spread = "  (rounds: " + " ".join(f"{t:.1f}" for t in rec["tok_s_rounds"]) + ")"
            print(f"{rec['name']:>22}  {rec['tok_s']:8.1f} tok/s  {match}{spread}", flush=True)


def cmd_bench(args) -> int:
    from . import bench

    if args.serve:
        return _bench_serve(args)
    if args.bytes <= 0 or args.bytes % 4:
        raise SystemExit(f"ds4tp bench: --bytes {args.bytes} must be a positive multiple of 4")
    if args.bytes > tr.GATE_MAX_BYTES:
        raise SystemExit(f"ds4tp bench: --bytes {args.bytes} is over the {tr.GATE_MAX_BYTES}-byte gate limit")
    if args.iters < 1:
        raise SystemExit(f"ds4tp bench: --iters {args.iters} must be >= 1")
    if args.ceiling_rank:
        if not args.model or args.role is None:
            raise SystemExit("ds4tp bench: --ceiling-rank needs --model and --role (bench --model spawns it)")
        _check_role_args(args)
        _, port = _address(args.listen or args.coordinator, "--listen/--coordinator")
        _print_records(bench.ceiling_rank(args.role, port, args.model, args.max_tokens), True)
        return 0
    if args.ring_rank:
        if args.model:
            _print_records(bench.ring_model_rank(args.model, args.max_tokens), True)
        else:
            _print_records(bench.ring_rank(args.bytes, args.iters), True, keep_samples=True)
        return 0
    if args.model:
        if args.max_tokens < 2:
            raise SystemExit(f"ds4tp bench: --max-tokens {args.max_tokens} must be >= 2")
        model_identity_check(args.model)
        if args.rounds < 1:
            raise SystemExit(f"ds4tp bench: --rounds {args.rounds} must be >= 1")
        records = bench.model_bench(args.model, args.transport, args.rdma_device, args.max_tokens,
                                    rounds=args.rounds)
        _print_records(records, args.json)
        if not args.json:
            _print_model_ratios(records)
        return 0
    _check_role_args(args)
    if args.role is not None:
        transport = args.transport if args.transport != "all" else "auto"
        host, port = _address(args.listen or args.coordinator, "--listen/--coordinator")
        records = bench.run_rank(args.role, host, port, transport, args.rdma_device, args.bytes,
                                 args.iters, secret=args.secret)
        if args.role == "leader":
            _print_records(records, args.json, keep_samples=True)
        return 0
    if args.plot:
        # The ranks this process spawns send their raw samples back.
        os.environ[bench.EMIT_SAMPLES_ENV] = "1"
    records: List[dict] = []
    if args.transport in ("tcp", "all"):
        records += bench.spawn_transport("tcp", None, args.bytes, args.iters)
    if args.transport in ("rdma", "all"):
        device = args.rdma_device or "ucsim"
        records += bench.spawn_transport("rdma", device, args.bytes, args.iters)
    records += bench.spawn_ring(args.bytes, args.iters)
    _print_records(records, args.json)
    if not args.json:
        _print_ratios(records)
    if args.plot:
        bench.plot_histograms(records, args.plot)
        tr.log(f"latency histogram written to {args.plot}")
    return 0


def _bench_serve(args) -> int:
    from . import serve_bench

    if args.max_tokens < 2:
        raise SystemExit(f"ds4tp bench: --max-tokens {args.max_tokens} must be >= 2")
    transport = "tcp" if args.transport in ("all", "auto") else args.transport
    device = args.rdma_device or ("ucsim" if transport == "rdma" else None)
    if args.url:
        records = serve_bench.measure_all(args.url.rstrip("/"), args.max_tokens, rounds=args.rounds,
                                          api_key=args.api_key)
    else:
        model = _resolve_model(args.model) if args.model else serve_bench.default_model()
        records = serve_bench.serve_bench(model, transport, device, args.max_tokens,
                                          rounds=args.rounds)
    serve_bench.print_records(records, args.json)
    return 0


def model_identity_check(path: str) -> None:
    from .pair_run import model_identity

    model_identity(path)  # raises a clear error when PATH is not a model directory


def _print_model_ratios(records: List[dict]) -> None:
    by_name = {r["name"]: r for r in records}
    for base in ("single", "mlx-lm-ring"):
        if base not in by_name or not by_name[base]["tok_s"]:
            continue
        for name, rec in by_name.items():
            if name != base and name.startswith("tp2"):
                print(f"{name:>22}  = {rec['tok_s'] / by_name[base]['tok_s']:.2f}x {base}")
    ceiling = by_name.get("tp2-compute-ceiling")
    if ceiling and ceiling["tok_s"]:
        for name, rec in by_name.items():
            if name.startswith("tp2") and name != ceiling["name"]:
                print(f"{name:>22}  = {rec['tok_s'] / ceiling['tok_s']:.2f}x the compute ceiling")


def _print_ratios(records: List[dict]) -> None:
    by_name = {r["name"]: r for r in records if "p50_us" in r}
    floor = by_name.get("raw-floor")
    ring = by_name.get("mlx-ring")
    for name, rec in by_name.items():
        parts = []
        if floor and name != "raw-floor":
            parts.append(f"{rec['p50_us'] / floor['p50_us']:.2f}x raw-floor")
        if ring and name != "mlx-ring":
            parts.append(f"{rec['p50_us'] / ring['p50_us']:.2f}x mlx-ring")
        if parts:
            print(f"{name:>22}  p50 = " + ", ".join(parts))


# ============================================================================
# run: one rank of a two-machine generation
# ============================================================================


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp run` (examples/pair_generate.py takes the same)."""
    from .sampling import add_sampling_args

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
    p.add_argument("--tokens-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bench-no-eos", action="store_true", help=argparse.SUPPRESS)
    _add_pair_args(p)


def cmd_run(args) -> int:
    from . import pair_run

    if args.role is None:
        raise SystemExit("ds4tp run: give --role leader --listen HOST PORT or "
                         "--role worker --coordinator HOST PORT (`ds4tp demo` runs both here)")
    _check_role_args(args)
    address = _address(args.listen or args.coordinator, "--listen/--coordinator")
    if args.role == "leader" and not args.prompt:
        raise SystemExit("ds4tp run: the leader needs --prompt TEXT")
    if args.max_tokens < 1:
        raise SystemExit(f"ds4tp run: --max-tokens {args.max_tokens} must be >= 1")
    if args.debug_hash < 0:
        raise SystemExit(f"ds4tp run: --debug-hash {args.debug_hash} must be >= 0")
    args.model = str(_resolve_model(args.model))
    return pair_run.run(args, address)


def _resolve_model(model: str):
    from .model_source import resolve_model

    try:
        return resolve_model(model)
    except FileNotFoundError as exc:
        raise SystemExit(f"ds4tp: {exc}") from None


def cmd_serve(args) -> int:
    from . import serve
    from .sampling import options_from_args

    if args.role is None:
        raise SystemExit("ds4tp serve: give --role leader --listen HOST PORT (it serves HTTP on "
                         "--host/--port) or --role worker --coordinator HOST PORT")
    _check_role_args(args)
    address = _address(args.listen or args.coordinator, "--listen/--coordinator")
    for flag, value, low in (("--max-tokens", args.max_tokens, 1), ("--max-batch", args.max_batch, 1),
                             ("--prefill-step-size", args.prefill_step_size, 1),
                             ("--prompt-cache-size", args.prompt_cache_size, 0),
                             ("--debug-hash", args.debug_hash, 0),
                             ("--port", args.port, 0)):
        if value < low:
            raise SystemExit(f"ds4tp serve: {flag} {value} must be >= {low}")
    options_from_args(args)
    return serve.run(args, address, _resolve_model(args.model))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp serve` (HTTP flags named as mlx_lm.server names them)."""
    from .sampling import add_sampling_args

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


def cmd_demo(args) -> int:
    from . import pair_run

    if args.max_tokens < 1:
        raise SystemExit(f"ds4tp demo: --max-tokens {args.max_tokens} must be >= 1")
    return pair_run.demo(args)


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
    bench.add_argument("--model", default=None, help="also time decode tok/s of this mlx-lm model: "
                       "single process, our pair (tcp, rdma) and mlx-lm's shard() on MLX's ring")
    bench.add_argument("--max-tokens", type=int, default=64, help="decode length for --model")
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
    bench.add_argument("--ring-rank", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--ceiling-rank", action="store_true", help=argparse.SUPPRESS)
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
    doc.set_defaults(func=cmd_doctor)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (tr.TransportError, ValueError, RuntimeError) as exc:
        print(f"ds4-tp: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
