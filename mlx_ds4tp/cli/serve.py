"""`ds4tp serve`: an OpenAI-compatible HTTP server on 2 to 8 ranks (--ranks N, default 2). The
leader serves HTTP on --host/--port and drives the generation; every worker runs the same
forward passes on its part. Each machine runs its own rank; the ranks find each other on the
Thunderbolt link (--interface), the first to wait for workers leads, and each worker prints the
leader's URL. Ctrl-C or SIGTERM stops any rank cleanly (exit 0, one line saying why); the others
say so and wait for it to come back, except a worker started with --role and no --rejoin, which
stops with its leader. Scripts may name the roles and addresses instead; a pair on one machine,
both on 127.0.0.1:

    ds4tp serve --model demo --role worker --coordinator 127.0.0.1 9911 &
    ds4tp serve --model demo --role leader --listen 127.0.0.1 9911

then ask http://127.0.0.1:8080/v1 for model "demo" (GET /v1/models lists the id served).
"""

from __future__ import annotations

import argparse

from ..lockstep.protocol.commands.limits import MAX_PREFILL_ROWS, MAX_VERIFY_WIDTH
from ..lockstep.settings import DraftSettings
from ..serve.limits import ServeLimits
from ..serve.settings import HttpSettings, ServedModel, ServeSettings
from .draft_args import add_draft_args, check_draft_args
from .model_arg import default_served_name
from .pair_args import add_lockstep_rank_args, check_at_least, lockstep_join
from .parts_args import add_model_or_part_args, model_or_part, parts_from_args
from .sampling_args import add_sampling_args, options_from_args
from .split_args import add_split_arg, split_from_args

HELP = "an OpenAI-compatible HTTP server on 2 to 8 ranks"
DEFAULT_DISK_BYTES = 20 * 10**9
ROLE_HELP = ("this process's rank, 'leader' (rank 0; serves HTTP on --host/--port) or 'worker' "
             "(rank 1 and up); without --listen/--coordinator the ranks find each other (--interface) "
             "and the first to wait for workers leads, unless --role says")


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp serve` (HTTP flags named as mlx_lm.server names them)."""
    add_model_or_part_args(p)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="leader: the model id /v1/models lists and requests name (default: 'demo' "
                        "for --model demo, the repo id for a Hugging Face repo id, the directory's "
                        "name for a path); requests may also name --model as given")
    p.add_argument("--host", default="127.0.0.1", help="leader: HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="leader: HTTP port (default 8080)")
    p.add_argument("--api-key", default=None,
                   help="leader: require 'Authorization: Bearer KEY' on the API endpoints")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="answer length when a request gives no max_tokens (default 512)")
    p.add_argument("--max-batch", type=int, default=32,
                   help="most sessions decoded together in one step; the rest wait (default 32)")
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt tokens per prefill chunk between decode steps (mlx-lm's default, 2048)")
    p.add_argument("--prompt-concurrency", type=int, default=8, metavar="N",
                   help="most prompts prefilled together in one padded forward, one chunk of each "
                        "(mlx_lm.server's flag and default, 8; at most 256)")
    p.add_argument("--prompt-cache-size", type=int, default=10,
                   help="most stored prompt caches kept for reuse (LRU; 0 = no reuse; default 10)")
    p.add_argument("--mixed-prefill", type=int, default=0, metavar="N",
                   help="prompts still prefilling ride in the decode steps, N prompt tokens each a step "
                        "(the seed's mixed batch: one pass over the weights for both, cheaper where "
                        "decode is bound by memory bandwidth, as on a Mac; default 0: prompts are "
                        "prefilled in forwards of their own, between decode steps)")
    p.add_argument("--mixed-prefill-when", choices=("cheaper", "always"), default="cheaper",
                   help="with --mixed-prefill: mix where the leader measured it cheaper per prompt "
                        "token than a prefill forward of its own, turn by turn (default), or always")
    p.add_argument("--max-kv-tokens", type=int, default=None, metavar="N",
                   help="KV budget: a request starts only while the sessions under way reserve at most "
                        "N cache tokens (prompt + max_tokens each); the others wait (default: what "
                        "the Mac's memory holds less the weights and a quarter kept free, logged at "
                        "start; 0: no budget)")
    p.add_argument("--max-queued", type=int, default=64, metavar="N",
                   help="requests that may wait for room in the KV budget; past them a request gets 429 with "
                        "Retry-After (default 64)")
    p.add_argument("--keepalive-sec", type=float, default=10.0, metavar="SEC",
                   help="a streamed answer that has not started after SEC seconds (a long prefill, "
                        "a full batch) starts with its status line and an SSE comment, repeated "
                        "every SEC seconds, so proxies and clients do not time out (default 10)")
    p.add_argument("--header-timeout-sec", type=float, default=10.0, metavar="SEC",
                   help="leader: a connection whose request line and headers have not all arrived SEC "
                        "seconds after it opened (or after its last answer) is closed, and a request "
                        "whose body has not all arrived SEC seconds after its headers is answered 408 "
                        "(default 10)")
    p.add_argument("--keep-alive-timeout-sec", type=float, default=5.0, metavar="SEC",
                   help="leader: a kept-alive connection idle for SEC seconds after its last answer is "
                        "closed (default 5)")
    p.add_argument("--kv-bits", type=int, default=0, metavar="BITS",
                   help="leader: quantize the KV caches to BITS (mlx-lm's QuantizedKVCache: 2, 3, 4, 5, "
                        "6 or 8; default 0: float); batching stays on (the leader tells the worker)")
    p.add_argument("--kv-group-size", type=int, default=64, metavar="N",
                   help="leader: the KV quantization's group size (32, 64 or 128; default 64, "
                        "mlx-lm's); the model's head size must be a multiple of it")
    p.add_argument("--prompt-cache-bytes", type=_size, default=0, metavar="SIZE",
                   help="leader: most bytes the stored prompt caches take on each machine, e.g. 4GB "
                        "or 512MB (least recently used dropped first; default 0: bounded by "
                        "--prompt-cache-size only)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="every rank, each its own directory: every stored prompt cache is written there "
                        "as soon as it is stored, in the background (this machine's part of it, in "
                        "mlx-lm's prompt-cache files; a stop of any kind, kill -9 too, keeps what was "
                        "written), and a later request or a restarted server loads its longest stored "
                        "prefix from there instead of recomputing it (default: memory only)")
    p.add_argument("--prompt-cache-disk-bytes", type=_size, default=None, metavar="SIZE",
                   help="with --prompt-cache-dir: most bytes its files take, e.g. 50GB (least "
                        f"recently used removed first; default {DEFAULT_DISK_BYTES // 10**9}GB)")
    add_draft_args(p, "greedy sessions verify their drafts in the decode batch (a request's "
                      "num_draft_tokens asks for fewer, 0 for none)")
    p.add_argument("--rejoin", action="store_true",
                   help="worker: when the leader stops or dies, wait for a leader on the same "
                        "address and serve it, instead of exiting (the leader always takes a "
                        "rank back: when one dies it keeps serving HTTP, answering 503, "
                        "until the group forms again)")
    p.add_argument("--shrink-after", type=float, default=None, metavar="SEC",
                   help="leader: when a worker is lost and not back within SEC seconds, the ranks "
                        "left serve on without it if their memory holds the model (each loads a "
                        "bigger part), and the group grows back when it returns (default 30, or "
                        "half DS4_TP_TIMEOUT_SEC when that is less; 0: never, wait for it; below "
                        "DS4_TP_TIMEOUT_SEC, which the workers wait for the leader's word within)")
    p.add_argument("--debug-hash", type=int, default=0, metavar="N",
                   help="compare a hash of the logits with the worker every N decode steps "
                        "(default 0: off)")
    add_split_arg(p)
    add_sampling_args(p)
    add_lockstep_rank_args(p, ROLE_HELP)
    p.epilog = ("The sampling flags are the defaults of a request that gives none of its own.\n"
                "Every rank takes the same --model, or a worker none: it receives its part from the leader.")


def _size(text: str) -> int:
    """A byte count as mlx_lm.server takes it: 123, 1.5GB, 512MB, 2G, 800M (powers of ten)."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
    number = text.strip().upper()
    number = number[:-1] if number.endswith(("KB", "MB", "GB")) else number
    digits = number.rstrip("KMG")
    try:
        value = float(digits) * units[number[len(digits):]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with "
                                         "KB, MB or GB (e.g. 4GB)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be >= 0")
    return int(value)


def main(args: argparse.Namespace) -> int:
    """Check the flags once, then run this rank of `ds4tp serve`."""
    from ..serve import serving_rank as serve_rank

    return serve_rank.run(check_args(args))


def check_args(args: argparse.Namespace) -> ServeSettings:
    """The flags of one `ds4tp serve` rank checked once, as the settings it runs with; bad
    flags exit naming the flag."""
    want = {"leader": "lead", "worker": "work", None: "any"}[args.role]
    join = lockstep_join(args, "serve", want, " (it serves HTTP on --host/--port)",
                         f"http://{args.host}:{args.port}/v1")
    check_at_least("serve", (("--max-tokens", args.max_tokens, 1), ("--port", args.port, 0),
                             ("--max-kv-tokens", args.max_kv_tokens if args.max_kv_tokens is not None else 0, 0)))
    if args.rejoin and join.address.role != "worker" and join.discovery is None:
        raise SystemExit("ds4tp serve: --rejoin is the worker's (--role worker); the leader always "
                         "takes a restarted worker back")
    shrink_after = _shrink_after(args, join)
    if args.port > 65535:
        raise SystemExit(f"ds4tp serve: --port {args.port} must be <= 65535")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise SystemExit("ds4tp serve: --served-model-name must not be empty")
    check_draft_args("serve", args)
    limits = _limits(args)
    sampling = options_from_args(args)
    path = model_or_part(args, "serve", args.role)  # None: a worker that receives its part
    name = args.served_model_name or (default_served_name(args.model) if args.model else "the leader's model")
    served = ServedModel(path, name, aliases=(args.model, str(path)) if path is not None else (),
                         draft=DraftSettings(args.draft_model, args.prompt_lookup, args.num_draft_tokens))
    for flag, value in (("--header-timeout-sec", args.header_timeout_sec),
                        ("--keep-alive-timeout-sec", args.keep_alive_timeout_sec)):
        if not value > 0:
            raise SystemExit(f"ds4tp serve: {flag} {value}: give a positive number of seconds")
    if join.address.role != "worker" and not args.api_key:
        _warn_open_api(args.host, args.port)
    http = HttpSettings(args.host, args.port, args.api_key, args.keepalive_sec, args.max_tokens, sampling,
                        header_timeout_sec=args.header_timeout_sec,
                        keep_alive_timeout_sec=args.keep_alive_timeout_sec)
    return ServeSettings(join.link, served, limits, http, kv_budget_from_memory=args.max_kv_tokens is None,
                         rejoin=args.rejoin or (join.discovery is not None and join.address.role != "leader"),
                         split=split_from_args(args, "serve", join.ranks), parts=parts_from_args(args, "serve"),
                         shrink_after=shrink_after)


DEFAULT_SHRINK_AFTER_SEC = 30.0


def _shrink_after(args: argparse.Namespace, join) -> float:
    """--shrink-after checked: a number of seconds, 0 (never) or above, below the timeout the
    workers wait for the leader's word within; 0 on a worker (the leader's decides). A rank
    found by discovery keeps it: any of them may lead."""
    import math

    from ..link.config import default_timeout

    timeout = float(join.link.timeout or default_timeout())
    value = args.shrink_after
    if value is None:
        value = min(DEFAULT_SHRINK_AFTER_SEC, timeout / 2)
    if not math.isfinite(value) or value < 0:
        raise SystemExit(f"ds4tp serve: --shrink-after {value:g}: give the seconds a lost worker has to "
                         "come back before the ranks left serve without it (e.g. 30), or 0 for never")
    if value >= timeout and join.address.role != "worker":
        raise SystemExit(f"ds4tp serve: --shrink-after {value:g} is not below the timeout the workers wait "
                         f"for the leader's word within (DS4_TP_TIMEOUT_SEC, {timeout:g} s): give "
                         f"--shrink-after below {timeout:g}, or raise DS4_TP_TIMEOUT_SEC on every rank")
    if join.address.role == "worker":
        return 0.0
    return value


def _warn_open_api(host: str, port: int) -> None:
    """One warning line when the HTTP face, keyless, listens where others reach it (anything
    but loopback): every prompt and answer is theirs to read and send."""
    from ..base.log import log
    from ..link.exposure import address_exposure

    exposure = address_exposure("leader", host, port, frozenset())
    if not exposure.private:
        log(f"WARNING: the HTTP API on {exposure.address} ({exposure.where}) has no --api-key: "
            "anyone who reaches it can send prompts and read the answers; give --api-key KEY to "
            "require 'Authorization: Bearer KEY'")


def _limits(args: argparse.Namespace) -> ServeLimits:
    """The engine's limits from the flags; exits naming a flag out of range."""
    from ..lockstep.caches.session_caches import KV_BITS, KV_GROUP_SIZES

    check_at_least("serve", (("--max-batch", args.max_batch, 1),
                             ("--prefill-step-size", args.prefill_step_size, 1),
                             ("--prompt-concurrency", args.prompt_concurrency, 1),
                             ("--prompt-cache-size", args.prompt_cache_size, 0),
                             ("--debug-hash", args.debug_hash, 0), ("--max-queued", args.max_queued, 1)))
    if args.kv_bits and args.kv_bits not in KV_BITS:
        raise SystemExit(f"ds4tp serve: --kv-bits {args.kv_bits}: give one of "
                         f"{', '.join(map(str, KV_BITS))} (or 0 for a float cache)")
    if args.kv_group_size not in KV_GROUP_SIZES:
        raise SystemExit(f"ds4tp serve: --kv-group-size {args.kv_group_size}: give one of "
                         f"{', '.join(map(str, KV_GROUP_SIZES))}")
    if not 0 <= args.mixed_prefill <= MAX_VERIFY_WIDTH:
        raise SystemExit(f"ds4tp serve: --mixed-prefill {args.mixed_prefill} must be 0 to "
                         f"{MAX_VERIFY_WIDTH} (a decode step's rows carry at most that many tokens)")
    if args.prompt_concurrency > MAX_PREFILL_ROWS:
        raise SystemExit(f"ds4tp serve: --prompt-concurrency {args.prompt_concurrency} must be <= "
                         f"{MAX_PREFILL_ROWS} (the rows one prefill command carries)")
    disk_bytes = args.prompt_cache_disk_bytes
    if disk_bytes is not None and not args.prompt_cache_dir:
        raise SystemExit("ds4tp serve: --prompt-cache-disk-bytes bounds --prompt-cache-dir; give the "
                         "directory too")
    if disk_bytes == 0:
        raise SystemExit("ds4tp serve: --prompt-cache-disk-bytes 0 leaves no room; give a size such "
                         "as 20GB, or serve without --prompt-cache-dir")
    return ServeLimits(prompt_cache_size=args.prompt_cache_size,
                       prompt_cache_bytes=args.prompt_cache_bytes, prefill_step=args.prefill_step_size,
                       prompt_cache_dir=args.prompt_cache_dir,
                       prompt_cache_disk_bytes=(disk_bytes or DEFAULT_DISK_BYTES) if args.prompt_cache_dir else 0,
                       prompt_concurrency=args.prompt_concurrency, max_batch=args.max_batch,
                       kv_budget=args.max_kv_tokens or 0, max_queued=args.max_queued,
                       kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                       mixed_prefill=args.mixed_prefill, mixed_when=args.mixed_prefill_when,
                       debug_hash=args.debug_hash)
