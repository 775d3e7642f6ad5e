"""`ds4tp bench`: gate latency of our transports against the baselines (a bare socket exchange,
MLX's ring all_sum), both ranks on this machine; with --model, decode and prefill tok/s of a
model; with --serve, `ds4tp serve`'s throughput for 1 to 8 clients. With --role, one rank of a
two-machine gate bench (the other machine runs the same line with the other role)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional, Tuple

from ..base.stopping import stop_on_sigterm
from ..link.wire import GATE_MAX_BYTES
from .draft_args import add_draft_args, check_num_draft_tokens
from .model_arg import DEMO, add_model_arg, model_path
from .pair_args import (
    LOCKSTEP_NEEDS_PAIR,
    add_pair_args,
    add_transport_args,
    address_from_args,
    check_at_least,
    link_from_args,
    refuse_mlx,
)
from .split_args import add_split_arg, split_from_args

HELP = "gate latency: tcp, rdma and the baselines (--model: tok/s; --serve: serving)"
ROLE_HELP = ("run one rank of a two-machine gate bench (the other machine runs the other role); "
             "default: both ranks on 127.0.0.1")
# The bench's own --transport value: every transport of the pair, one after the other.
ALL = "all"
TRANSPORT_HELP = ("all (default): tcp, rdma on --rdma-device (default the emulated 'ucsim') and the "
                  "baselines; tcp or rdma: that one and the baselines; mlx: MLX's own group alone "
                  "(its ring, both ranks here); auto (only with --role): what the pair picks. "
                  "--serve uses tcp unless rdma is given")


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp bench`."""
    add_transport_args(p, TRANSPORT_HELP, "verbs device (e.g. rdma_en1) or 'ucsim'; default: 'ucsim' "
                       "with both ranks here, the first device with an active port with --role",
                       extra_choice=ALL, default=ALL)
    p.add_argument("--bytes", type=int, default=16384,
                   help=f"bytes per gate exchange, a multiple of 4 up to {GATE_MAX_BYTES} "
                        "(default 16384)")
    p.add_argument("--iters", type=int, default=5000, help="timed exchanges per contender (default 5000; "
                   "--ranks: 16 KiB all_sums per group, default 1000, a tenth of them at 1 MiB)")
    p.add_argument("--ranks", default=None, metavar="N[,N...]",
                   help="all_sum p50/p99 at 16 KiB and 1 MiB over groups of N ranks here (e.g. "
                        "2,3,4): ours over tcp and rdma (ucsim) and MLX's ring at the same N; with "
                        "--model: decode tok/s of the model over N ranks, ours (tcp) beside mlx-lm's "
                        "shard() on MLX's ring")
    p.add_argument("--ring", action="store_true",
                   help="with --ranks: ours again over each mesh's ring alone (topology ring: rank k "
                        "linked to k+1 and the last to 0, the other links idle), beside the full mesh")
    p.add_argument("--json", action="store_true", help="one JSON record per line")
    add_model_arg(p, "time decode tok/s of this mlx-lm model instead (a directory, `demo`, or a "
                  "preset built once: 150m, moe-1g): single process, our pair (tcp, rdma) and "
                  "mlx-lm's shard() on MLX's ring; with --serve: the model served", required=False)
    add_split_arg(p)
    add_draft_args(p, "with --model, timed against plain pair decode and mlx-lm's single-machine "
                      "speculative decoding (a directory, `demo` or a preset)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="decode length for --model and --serve; --soak: the most a request asks "
                        "for, each drawing 1..N (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="prompt length for --model: prompt processing (prefill) is timed too (default 512)")
    p.add_argument("--rounds", type=int, default=3,
                   help="--model: run every contender this many times, in rotating order, and "
                        "report the median; --serve: rounds per client count (default 3)")
    p.add_argument("--slow-worker", action="store_true",
                   help="--model: two different Macs stood in for on this Linux machine: our tcp "
                        "pairs run with the leader alone on CPU 0 and the worker on CPU 1 beside a "
                        "busy process (with --split auto|A:B: the share against even)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="latency histogram per transport (needs matplotlib)")
    p.add_argument("--serve", action="store_true",
                   help="`ds4tp serve` on 127.0.0.1: aggregate tok/s and time to first token "
                        "for 1, 2, 4 and 8 concurrent clients (--model, default the demo model)")
    p.add_argument("--url", default=None, metavar="http://HOST:PORT",
                   help="--serve: measure this running `ds4tp serve` instead of starting one")
    p.add_argument("--api-key", default=None, help="--serve --url: the server's API key")
    p.add_argument("--poll-cluster", action="store_true",
                   help="--serve: each client count also measured while GET /cluster is polled every "
                        "second (the cluster page open), interleaved with the plain rounds")
    p.add_argument("--disk-cache", action="store_true",
                   help="--serve: time to first token of a --prompt-tokens prompt cold, with its prefix "
                        "in memory, and from --prompt-cache-dir after both ranks restart (checked "
                        "against a cold server's answer)")
    p.add_argument("--disk-soak", type=float, default=0.0, metavar="SECONDS",
                   help="--disk-cache: then a load run of SECONDS over many distinct prefixes: the "
                        "directories' largest size against --disk-bytes, the leader's memory each minute")
    p.add_argument("--disk-bytes", type=int, default=2 * 10**6, metavar="BYTES",
                   help="--disk-soak: each rank's --prompt-cache-disk-bytes (default 2000000)")
    _add_soak_args(p)
    add_pair_args(p, ROLE_HELP)


def main(args: argparse.Namespace) -> int:
    """Check the flags once, then run the bench they ask for."""
    from ..bench import report

    # Killed (SIGTERM), the bench stops as on Ctrl-C: the ranks and the busy core it started go too.
    stop_on_sigterm()
    if args.bytes <= 0 or args.bytes % 4:
        raise SystemExit(f"ds4tp bench: --bytes {args.bytes} must be a positive multiple of 4")
    if args.bytes > GATE_MAX_BYTES:
        raise SystemExit(f"ds4tp bench: --bytes {args.bytes} is over the {GATE_MAX_BYTES}-byte gate limit")
    check_at_least("bench", (("--iters", args.iters, 1),))
    address = address_from_args(args, "bench")
    if address is not None and (args.serve or args.model):
        raise SystemExit("ds4tp bench: --role is for the two-machine gate bench; --model and "
                         "--serve run both ranks here")
    for given, needed, why in (
            (args.url, args.serve, "--url needs --serve"),
            (args.soak or args.restart_worker or args.client_counts, args.serve,
             "--soak, --restart-worker and --client-counts need --serve"),
            (args.ring, args.ranks is not None, "--ring times groups of --ranks N,.. over their ring; "
             "give --ranks (e.g. --ranks 3,4 --ring)")):
        if given and not needed:
            raise SystemExit(f"ds4tp bench: {why}")
    if args.plot and (args.serve or args.model or address is not None):
        raise SystemExit("ds4tp bench: --plot draws the gate bench run with both ranks here "
                         "(no --model, --serve or --role)")
    if args.ranks is not None:
        return _ranks(args, address)
    if args.serve:
        refuse_mlx(args, "bench --serve", LOCKSTEP_NEEDS_PAIR)
        return _serve(args)
    if address is None and args.transport == "auto":
        raise SystemExit("ds4tp bench: --transport auto is what a two-machine pair picks (with "
                         "--role); with both ranks here give tcp, rdma, mlx or all")
    if args.model:
        return _model(args, report)
    if address is not None:
        refuse_mlx(args, "bench --role", "its ranks are started by MLX's launcher, not joined with "
                   "--role (both ranks here, `ds4tp bench --transport mlx` times MLX's ring)")
        link = link_from_args(args, address, "bench", transport="auto" if args.transport == ALL else None)
        return report.gate_rank_report(link, args.bytes, args.iters, args.json)
    transports = ("tcp", "rdma") if args.transport == ALL else (args.transport,)
    return report.gates_report(transports, args.rdma_device, args.bytes, args.iters, args.json,
                               args.plot)


def _ranks(args: argparse.Namespace, address) -> int:
    from ..bench import ranks as bench_ranks

    try:
        sizes = bench_ranks.check_sizes(args.ranks)
    except ValueError as exc:
        raise SystemExit(f"ds4tp bench: {exc}") from None
    if address is not None or args.serve:
        raise SystemExit("ds4tp bench: --ranks runs every rank here; not with --role or --serve")
    if args.model:
        from ..bench.model_ranks import model_ranks_report

        if args.ring:
            raise SystemExit("ds4tp bench: --ring times the all_sums of --ranks; not with --model")
        check_at_least("bench", (("--max-tokens", args.max_tokens, 2), ("--rounds", args.rounds, 1),
                                 ("--prompt-tokens", args.prompt_tokens, 1)))
        if args.transport not in (ALL, "tcp"):
            raise SystemExit(f"ds4tp bench: --model with --ranks runs our ranks over tcp; --transport "
                             f"{args.transport} is not taken here: give tcp (or leave it out)")
        return model_ranks_report(_model_dir("--model", args.model), sizes, args.max_tokens,
                                  args.prompt_tokens, args.rounds, args.json)
    if args.transport not in (ALL, "tcp", "rdma"):
        raise SystemExit(f"ds4tp bench: --ranks with --transport {args.transport}: give tcp, rdma or "
                         "all (MLX's ring runs beside them anyway)")
    transports = ("tcp", "rdma") if args.transport == ALL else (args.transport,)
    iters = 1000 if args.iters == 5000 else args.iters
    return bench_ranks.ranks_report(sizes, transports, args.rdma_device, iters, args.json, args.ring)


def _model_dir(flag: str, value: str) -> str:
    """The model directory a --model / --draft-model value names: a directory, `demo`, or a
    preset built once ("150m", "moe-1g"); exits naming the value and the choices otherwise."""
    from ..bench.model import bench_model_dir
    from ..link.identity import model_identity
    from ..synthetic import tiny_model

    model = str(model_path(value)) if value == DEMO else bench_model_dir(value)
    try:
        model_identity(model)
    except FileNotFoundError as exc:
        presets = ", ".join(sorted({**tiny_model.PRESETS, **tiny_model.MOE_PRESETS}))
        raise SystemExit(f"ds4tp bench: {flag} {value}: {exc}; or give `demo` or a preset built "
                         f"once: {presets}") from None
    return model


def _model(args: argparse.Namespace, report) -> int:
    check_at_least("bench", (("--max-tokens", args.max_tokens, 2), ("--rounds", args.rounds, 1),
                             ("--prompt-tokens", args.prompt_tokens, 1)))
    model = _model_dir("--model", args.model)
    if args.draft_model or args.prompt_lookup:
        from ..bench.speculative import speculative_report

        check_at_least("bench", (("--prompt-lookup", args.prompt_lookup, 0),))
        check_num_draft_tokens("bench", args.num_draft_tokens)
        if args.transport not in ("tcp", ALL):
            raise SystemExit("ds4tp bench: the speculative bench runs the pair over tcp; give --transport tcp")
        draft = _model_dir("--draft-model", args.draft_model) if args.draft_model else None
        return speculative_report(model, draft, args.prompt_lookup, args.num_draft_tokens, args.max_tokens,
                                  args.rounds, args.prompt_tokens, args.json)
    from ..bench.model import ModelBench

    split = split_from_args(args, "bench")
    if args.slow_worker and args.transport not in ("tcp", ALL):
        raise SystemExit("ds4tp bench: --slow-worker places our tcp pairs; give --transport tcp")
    if args.slow_worker and not {0, 1} <= set(getattr(os, "sched_getaffinity", lambda _: ())(0)):
        raise SystemExit("ds4tp bench: --slow-worker pins the ranks to CPUs 0 and 1, which this "
                         "process cannot use (it needs Linux and two CPUs)")
    bench = ModelBench(model, args.transport, args.rdma_device, args.max_tokens, args.rounds,
                       args.prompt_tokens, str(split.share), args.slow_worker)
    return report.model_report(bench, args.json)


def _serve_transport(args: argparse.Namespace) -> Tuple[str, Optional[str]]:
    """The serving benches' transport (tcp unless rdma is given) and its device (ucsim for rdma
    unless --rdma-device names one)."""
    transport = "tcp" if args.transport in (ALL, "auto") else args.transport
    return transport, args.rdma_device or ("ucsim" if transport == "rdma" else None)


def _serve(args: argparse.Namespace) -> int:
    from ..bench import serve as serve_bench

    if args.soak or args.restart_worker or args.client_counts:
        return _soak(args)
    if args.disk_cache:
        return _disk_cache(args)
    if args.disk_soak:
        raise SystemExit("ds4tp bench: --disk-soak goes with --serve --disk-cache")
    check_at_least("bench", (("--max-tokens", args.max_tokens, 2), ("--rounds", args.rounds, 1)))
    transport, device = _serve_transport(args)
    model = model_path(args.model) if args.model and not args.url else None
    run = serve_bench.ServeRun(args.max_tokens, args.rounds, args.poll_cluster)
    return serve_bench.serve_report(args.url, model, transport, device, run, args.api_key, args.json)


def _disk_cache(args: argparse.Namespace) -> int:
    from ..bench import disk_cache

    if args.url:
        raise SystemExit("ds4tp bench: --disk-cache restarts a pair it starts itself; not with --url")
    check_at_least("bench", (("--prompt-tokens", args.prompt_tokens, 2), ("--max-tokens", args.max_tokens, 1),
                             ("--disk-soak", args.disk_soak, 0), ("--disk-bytes", args.disk_bytes, 1)))
    return disk_cache.report(Path(_model_dir("--model", args.model or DEMO)), _serve_transport(args)[0],
                             args.prompt_tokens, args.max_tokens, args.disk_soak, args.disk_bytes, args.json)


def _add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                   help="--serve: a load run of SECONDS against the pair (or --url on this "
                        "machine): --clients looping over greedy streamed completions checked "
                        "against mlx-lm, some cancelled mid-stream, some bad requests that must get a "
                        "4xx; exit status 1 when anything failed")
    p.add_argument("--clients", type=int, default=32, help="--soak: concurrent clients (default 32)")
    p.add_argument("--cancel-share", type=float, default=0.10, metavar="P",
                   help="--soak: share of requests closed mid-stream (default 0.10)")
    p.add_argument("--bad-share", type=float, default=0.05, metavar="P",
                   help="--soak: share of bad requests, each must get a 4xx (default 0.05)")
    p.add_argument("--restart-worker", action="store_true",
                   help="--soak: SIGKILL the worker at mid-run, start it again, time the outage "
                        "(not with --url)")
    p.add_argument("--seed", type=int, default=0, help="--soak: seed of the requests drawn (default 0)")
    p.add_argument("--variants", type=int, default=16, metavar="N",
                   help="--soak: distinct (prompt, max_tokens) drawn from, each checked against one "
                        "mlx-lm reference (default 16)")
    p.add_argument("--request-timeout", type=float, default=120.0, metavar="SEC",
                   help="--soak: a request not done after SEC is hung, a failure (default 120)")
    p.add_argument("--context-length", type=int, default=0, metavar="N",
                   help="--soak: prompts reach up to N tokens with their answer (default: the "
                        "server's context, from the model's config)")
    p.add_argument("--client-counts", default=None, metavar="1,4,8,32",
                   help="--soak: also the tok/s of this many clients against the pair and against "
                        "mlx_lm.server on the same model (--rounds each)")


def _soak(args: argparse.Namespace) -> int:
    from ..bench import soak, soak_pair

    if not args.soak:
        raise SystemExit("ds4tp bench: --restart-worker and --client-counts go with --soak SECONDS")
    if args.url and args.restart_worker:
        raise SystemExit("ds4tp bench: --restart-worker restarts a worker the bench started; not with --url")
    if args.url and not args.model:
        raise SystemExit("ds4tp bench: --soak --url needs --model, the served model, for mlx-lm's "
                         "reference answers")
    if not args.soak > 0 or not 0 <= args.cancel_share <= 1 or not 0 <= args.bad_share <= 1 \
            or args.cancel_share + args.bad_share > 1 or not args.request_timeout > 0:
        raise SystemExit("ds4tp bench: --soak and --request-timeout must be positive, --cancel-share "
                         "and --bad-share shares in [0, 1] adding up to at most 1")
    try:
        counts = [int(c) for c in args.client_counts.split(",")] if args.client_counts else []
    except ValueError:
        raise SystemExit(f"ds4tp bench: --client-counts {args.client_counts}: give counts like 1,4,8,32") from None
    check_at_least("bench", (("--clients", args.clients, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--variants", args.variants, 1), ("--rounds", args.rounds, 1),
                             ("--context-length", args.context_length, 0),
                             *(("--client-counts", c, 1) for c in counts)))
    transport, device = _serve_transport(args)
    opts = soak.SoakOptions(args.soak, args.clients, args.max_tokens, args.cancel_share,
                            args.bad_share, args.restart_worker, args.seed, args.variants,
                            args.request_timeout, args.context_length or None,
                            client_counts=counts, rounds=args.rounds)
    if args.url:
        try:
            soak_pair.loopback_host(args.url)
        except ValueError as exc:
            raise SystemExit(f"ds4tp bench: {exc}") from None
    return soak.soak_report(args.url, model_path(args.model or DEMO), transport, device,
                            args.api_key, opts, args.json)
