"""`ds4tp bench --serve --soak SECONDS`: a bounded load run against `ds4tp serve` on this
machine (a pair the bench starts on 127.0.0.1, or --url of a running one on loopback).

N clients loop until the deadline, each request drawn with a seeded RNG: a greedy streamed
completion of one of a bounded set of (prompt ids, max_tokens) variants, prompts up to the
model's context (some extending another variant's prompt, so the prompt cache's prefix reuse is
exercised); a share of them closed mid-stream; a share of bad requests that must get a 4xx.
Every answer received in full is compared with mlx-lm's own greedy generation for the same
variant, computed once per variant before the run. --restart-worker SIGKILLs the worker at
mid-run and starts it again: requests caught by the outage are `pair_down`, the outage is timed
from the kill to /health 200. Nothing may hang: every request has a timeout.

The record: requests by outcome, errors by kind, mismatches (and the first), time to first
token p50/p99, tok/s per minute of the run (the completion tokens of answers received in full,
spread over each answer's streaming time), the ranks' resident memory after the warm-up and at
the end. The exit status is 1 when anything failed (a mismatch, a hung request, a 5xx or an
acceptance for a bad request, an error of an unexpected kind, a worker that did not rejoin).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import random
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..base.log import log
from ..onehost.localpair import reap
from . import soak_pair
from .served_pair import ServedPair, health
from .soak_client import BAD_KINDS, EXPECTED_KINDS, Outcome, Target, bad_body, bad_request, stream

BUCKET_SEC = 60.0
# A request may still see the pair down this long after /health said 200 again (it was
# refused between the engine taking the worker back and the health probe that saw it).
REJOIN_GRACE_SEC = 2.0


@dataclasses.dataclass
class SoakOptions:
    seconds: float
    clients: int = 32
    max_tokens: int = 64
    cancel_share: float = 0.10
    bad_share: float = 0.05
    restart_worker: bool = False
    seed: int = 0
    variants: int = 16
    request_timeout: float = 120.0
    context_length: Optional[int] = None  # a cap on the prompts' reach; default the server's
    rejoin_timeout: float = 180.0
    client_counts: Sequence[int] = ()
    rounds: int = 1


def make_variants(rng: random.Random, count: int, vocab: int, context: int,
                  max_tokens: int) -> List[Tuple[List[int], int]]:
    """`count` (prompt ids, max_tokens), each fitting the context with its answer: the first
    reaches the context's end, the others' lengths log-uniform; half of those after the second
    extend a prefix of an earlier prompt."""
    variants: List[Tuple[List[int], int]] = []
    for i in range(count):
        n = rng.randint(1, max_tokens)
        room = max(1, context - n)
        length = room if i == 0 else max(1, min(room, int(math.exp(rng.uniform(0, math.log(room))))))
        prompt: List[int] = []
        if i >= 2 and rng.random() < 0.5:
            base = variants[rng.randrange(i)][0]
            prompt = base[:rng.randint(1, min(len(base), length))]
        prompt += [rng.randrange(vocab) for _ in range(length - len(prompt))]
        variants.append((prompt, n))
    return variants


def _client(i: int, target: Target, opts: SoakOptions, variants, vocab: int, server_ctx: int,
            stop_at: float, out: List[Outcome]) -> None:
    rng = random.Random(opts.seed * 1_000_003 + i + 1)
    while time.perf_counter() < stop_at:
        draw = rng.random()
        if draw < opts.bad_share:
            kind = rng.choice(BAD_KINDS)
            outcome = bad_request(target, bad_body(kind, rng, vocab, server_ctx), kind)
        else:
            v = rng.randrange(len(variants))
            ids, n = variants[v]
            cancel = rng.randint(1, max(1, n - 1)) if draw < opts.bad_share + opts.cancel_share else None
            outcome = stream(target, ids, n, cancel)
            outcome.variant = v
        out.append(outcome)
        if outcome.kind in ("pair_down", "busy"):
            time.sleep(0.1)  # a client backs off from a refusal, as a real one would


def _start_clients(target: Target, opts: SoakOptions, variants, vocab: int, server_ctx: int,
                   stop_at: float, out: List[Outcome]) -> List[threading.Thread]:
    """opts.clients _client threads, started, looping until stop_at."""
    threads = [threading.Thread(target=_client, daemon=True,
                                args=(i, target, opts, variants, vocab, server_ctx, stop_at, out))
               for i in range(opts.clients)]
    for t in threads:
        t.start()
    return threads


IDLE_SEC = 2.0


def _warm_up(target: Target, variants, clients: int, out: List[Outcome]) -> None:
    """Every variant, `clients` at a time, about twice a client: first-call compilation, the
    longest prompt's cache, the prompt cache filled and the batch at its full width, before the
    first memory reading (taken idle, as the last one is)."""
    order = list(range(len(variants))) * max(1, -(-2 * clients // len(variants)))
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                if not order:
                    return
                v = order.pop(0)
            outcome = stream(target, *variants[v])
            outcome.variant, outcome.warmup = v, True
            out.append(outcome)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(min(clients, len(order)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * target.timeout * len(variants) + 10)


def _percentile(values: Sequence[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(math.ceil(q / 100 * len(ordered))) - 1)], 2)


def _per_minute(outcomes: Sequence[Outcome], t0: float, t1: float) -> List[float]:
    """tok/s in each BUCKET_SEC of [t0, t1], an answer's tokens spread over its streaming."""
    buckets = [0.0] * max(1, math.ceil((t1 - t0) / BUCKET_SEC))
    for o in outcomes:
        if o.kind != "ok" or not o.tokens:
            continue
        a, b = max(t0, o.first if o.first is not None else o.end), max(t0, o.end)
        if b <= a:
            buckets[min(len(buckets) - 1, int((b - t0) // BUCKET_SEC))] += o.tokens
            continue
        for k in range(len(buckets)):
            lo, hi = t0 + k * BUCKET_SEC, t0 + (k + 1) * BUCKET_SEC
            share = max(0.0, min(b, hi) - max(a, lo)) / (b - a)
            buckets[k] += o.tokens * share
    spans = [min(BUCKET_SEC, t1 - t0 - k * BUCKET_SEC) for k in range(len(buckets))]
    return [round(tokens / span, 1) if span > 0 else 0.0 for tokens, span in zip(buckets, spans)]


def _stored_bytes(base: str, target: Target) -> Optional[int]:
    """KiB of the stored prompt caches on one rank, as the server's /health says."""
    found = (soak_pair.get_json(base, "/health", target.api_key) or {}).get("prompt_cache_bytes")
    return found // 1024 if isinstance(found, int) else None


def _rss(pids: Dict[str, Optional[int]]) -> Dict[str, Optional[int]]:
    return {name: soak_pair.rss_kib(pid) for name, pid in pids.items()}


def run_soak(target: Target, base: str, opts: SoakOptions, model: Path,
             pair: Optional[ServedPair], pids: Dict[str, Optional[int]]) -> Dict[str, Any]:
    """The soak against the healthy server at `base` (`pair`: the one the bench started; pids:
    the leader's and the worker's, None where unknown); its record."""
    vocab, config_ctx = soak_pair.model_limits(model)
    server_ctx = soak_pair.server_context(base, target.api_key) or config_ctx
    reach = min(server_ctx, opts.context_length) if opts.context_length else server_ctx
    rng = random.Random(opts.seed)
    variants = make_variants(rng, opts.variants, vocab, reach, opts.max_tokens)
    refs = soak_pair.references(model, variants)
    outcomes: List[Outcome] = []
    t_warm = time.perf_counter()
    _warm_up(target, variants, opts.clients, outcomes)
    log(f"soak: warm-up of {len(variants)} variants in {time.perf_counter() - t_warm:.1f} s")
    # Then the load itself for a tenth of the run (10 to 60 s), so the caches and the heap have
    # filled at full width before the first memory reading.
    fill = min(60.0, max(10.0, opts.seconds / 10))
    filled: List[Outcome] = []
    for t in _start_clients(target, opts, variants, vocab, server_ctx, time.perf_counter() + fill, filled):
        t.join(fill + 2 * target.timeout + 10)
    for outcome in filled:
        outcome.warmup = True
    outcomes.extend(filled)
    log(f"soak: {len(filled)} requests at full width for {fill:g} s before the first memory reading")
    time.sleep(IDLE_SEC)  # the server hands memory back once idle: read it there, as at the end
    rss_start = _rss(pids)
    stored_start = _stored_bytes(base, target)

    t0 = time.perf_counter()
    stop_at = t0 + opts.seconds
    restart: Dict[str, Any] = {}
    threads = _start_clients(target, opts, variants, vocab, server_ctx, stop_at, outcomes)
    # Steady state: a quarter in, every client has been running and the prompt caches are
    # full; a leak shows as growth from here to the end (the warm-up ran one client at a
    # time, so memory after it is below what 32 clients at once need).
    time.sleep(max(0.0, t0 + opts.seconds / 4 - time.perf_counter()))
    rss_steady = _rss(pids)
    if opts.restart_worker and pair is not None:
        time.sleep(max(0.0, t0 + opts.seconds / 2 - time.perf_counter()))
        restart = pair.restart_worker(opts.rejoin_timeout)
        pids["worker"] = pair.pid("worker")
        log(f"soak: worker restart: {restart.get('outage_s')} s outage "
               f"{'' if restart['rejoined'] else '(no rejoin: ' + restart['why'] + ')'}")
    # A request has its timeout; a thread still running well past the deadline is stuck.
    for t in threads:
        t.join(max(0.0, stop_at + 2 * target.timeout + 10 - time.perf_counter()))
    stuck = sum(t.is_alive() for t in threads)
    t1 = max([stop_at] + [o.end for o in outcomes if not o.warmup])
    time.sleep(IDLE_SEC)
    rss_end = _rss(pids)
    stored_end = _stored_bytes(base, target)
    rec = _record(opts, SoakRun(list(outcomes), variants, refs, restart, stuck, t0, t1, reach))
    # Stored prompt caches are memory the server keeps on purpose, up to its bounds, and each
    # rank holds the same share; which prompts they hold differs from start to end, so the
    # growth is also given without them.
    rec["stored_prompt_cache_start_kib"], rec["stored_prompt_cache_end_kib"] = stored_start, stored_end
    for name in ("leader", "worker"):
        a, steady, b = rss_start.get(name), rss_steady.get(name), rss_end.get(name)
        # A restarted worker is another process: its end says nothing of the first one's growth.
        same = name == "leader" or not opts.restart_worker
        rec[f"rss_{name}_start_kib"], rec[f"rss_{name}_end_kib"] = a, b
        rec[f"rss_{name}_ratio"] = round(b / a, 3) if a and b else None
        rec[f"rss_{name}_ratio_less_stored"] = (
            round((b - stored_end) / (a - stored_start), 3)
            if a and b and same and stored_start is not None and stored_end is not None else None)
        rec[f"rss_{name}_steady_kib"] = steady
        rec[f"rss_{name}_end_vs_steady"] = round(b / steady, 3) if steady and b and same else None
    return rec


@dataclasses.dataclass
class SoakRun:
    """What one soak produced, for its record."""

    outcomes: List[Outcome]
    variants: list  # (prompt ids, max_tokens) of each variant
    refs: List[str]  # mlx-lm's greedy text of each variant
    restart: Dict[str, Any]  # the worker restart's figures ({} without --restart-worker)
    stuck: int  # client threads still running well past the deadline
    t0: float  # the soak's start and end (time.perf_counter() clock)
    t1: float
    reach: int  # the context the variants reach (the server's, or --context-length)


def _record(opts: SoakOptions, run: SoakRun) -> Dict[str, Any]:
    outcomes, variants, refs, restart = run.outcomes, run.variants, run.refs, run.restart
    stuck, t0, t1, reach = run.stuck, run.t0, run.t1, run.reach
    kinds = collections.Counter(o.kind for o in outcomes)
    kinds["hung"] += stuck
    mismatches, first = 0, None
    for o in outcomes:
        if o.kind == "ok" and o.text != refs[o.variant]:
            mismatches += 1
            if first is None:
                ids, n = variants[o.variant]
                first = {"variant": o.variant, "prompt_tokens": len(ids), "max_tokens": n,
                         "got": o.text[:200], "want": refs[o.variant][:200]}
    if restart:
        back = restart["rejoined_at"] if restart["rejoined"] else math.inf
        late_down = sum(1 for o in outcomes if o.kind == "pair_down" and not (
            o.end >= restart["killed_at"] and o.start <= back + REJOIN_GRACE_SEC))
    else:
        late_down = kinds["pair_down"]
    soak = [o for o in outcomes if not o.warmup]
    ttft = [1e3 * (o.first - o.start) for o in soak if o.first is not None]
    tokens = sum(o.tokens for o in soak if o.kind == "ok")
    failures = []
    if mismatches:
        failures.append(f"{mismatches} answer(s) differ from mlx-lm's greedy generation")
    for kind in sorted(k for k in kinds if k not in EXPECTED_KINDS and kinds[k]):
        failures.append(f"{kinds[kind]} request(s) {kind}")
    if late_down:
        failures.append(f"{late_down} request(s) saw the pair down outside a worker restart's outage")
    if restart and not restart["rejoined"]:
        failures.append(f"the restarted worker did not rejoin ({restart['why']})")
    if not kinds["ok"]:
        failures.append("no request was answered in full")
    rec: Dict[str, Any] = {
        "name": "soak", "seconds": opts.seconds, "clients": opts.clients, "seed": opts.seed,
        "variants": len(variants), "context_reach": reach, "max_tokens": opts.max_tokens,
        "requests": len(soak), "warmup_requests": len(outcomes) - len(soak),
        "completed": sum(1 for o in soak if o.kind == "ok"),
        "cancelled": kinds["cancelled"], "checked": kinds["ok"],
        "bad_requests": sum(1 for o in outcomes if o.kind.startswith("bad_request_")),
        "errors": {k: v for k, v in sorted(kinds.items()) if k not in ("ok", "cancelled") and v},
        "hung": kinds["hung"], "pair_down": kinds["pair_down"], "mismatches": mismatches,
        "first_mismatch": first,
        "ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
        "tokens": tokens, "tok_s": round(tokens / (t1 - t0), 1),
        "tok_s_per_minute": _per_minute(soak, t0, t1),
    }
    if opts.restart_worker:
        # /health says 200 once the worker has joined; a request answered in full says the
        # worker also has its weights again.
        served = [o.end for o in outcomes if o.kind == "ok" and restart.get("rejoined")
                  and o.start >= restart["killed_at"]]
        rec["restart"] = {"rejoined": restart.get("rejoined", False),
                          "outage_s": restart.get("outage_s"), "down_seen_s": restart.get("down_seen_s"),
                          "why": restart.get("why"),
                          "first_answer_after_kill_s":
                              round(min(served) - restart["killed_at"], 3) if served else None}
    rec["failures"], rec["ok"] = failures, not failures
    examples = [o.detail for o in outcomes if o.kind not in EXPECTED_KINDS and o.detail][:3]
    for detail in examples:
        log(f"soak: e.g. {detail}")
    return rec


def _mib(kib: Optional[int]) -> str:
    return "?" if kib is None else f"{kib / 1024:.1f} MiB"


def print_soak(rec: Dict[str, Any], as_json: bool) -> None:
    """The soak's record: one JSON line, or a few lines of text."""
    if as_json:
        print(json.dumps(rec), flush=True)
        return
    errors = ", ".join(f"{k}={v}" for k, v in rec["errors"].items()) or "none"
    print(f"soak  {rec['seconds']:g} s, {rec['clients']} clients: {rec['requests']} requests, "
          f"{rec['completed']} answered in full, {rec['cancelled']} cancelled, "
          f"{rec['bad_requests']} bad; {rec['mismatches']} mismatches against mlx-lm "
          f"({rec['checked']} checked), {rec['hung']} hung", flush=True)
    print(f"soak  errors by kind: {errors}")
    print(f"soak  ttft p50 {rec['ttft_p50_ms']} ms p99 {rec['ttft_p99_ms']} ms; {rec['tok_s']} tok/s "
          f"(per minute: {' '.join(str(x) for x in rec['tok_s_per_minute'])})")
    for name in ("leader", "worker"):
        ratio = rec[f"rss_{name}_ratio"]
        again = " (the restarted worker's)" if name == "worker" and "restart" in rec else ""
        steady = rec.get(f"rss_{name}_end_vs_steady")
        less = rec.get(f"rss_{name}_ratio_less_stored")
        print(f"soak  {name} RSS {_mib(rec[f'rss_{name}_start_kib'])} after warm-up, "
              f"{_mib(rec.get(f'rss_{name}_steady_kib'))} a quarter in -> "
              f"{_mib(rec[f'rss_{name}_end_kib'])} at the end{again}"
              f"{f' ({ratio:.3f}x the warm-up' if ratio else ''}"
              f"{f', {steady:.3f}x the quarter' if steady else ''}"
              f"{f', {less:.3f}x less the stored prompt caches' if less else ''}{')' if ratio else ''}")
    if "restart" in rec:
        r = rec["restart"]
        print("soak  worker restart: " + (
            f"rejoined, outage {r['outage_s']} s (kill to /health 200), first answer in full "
            f"{r['first_answer_after_kill_s']} s after the kill, {rec['pair_down']} pair_down"
            if r["rejoined"] else f"no rejoin: {r['why']}"))
    if rec["first_mismatch"]:
        print(f"soak  first mismatch: {json.dumps(rec['first_mismatch'])}")
    print("soak  OK" if rec["ok"] else "soak  FAILED: " + "; ".join(rec["failures"]), flush=True)


def _client_counts(base: str, model: Path, opts: SoakOptions, api_key: Optional[str],
                   pair: Optional[ServedPair]) -> List[Dict[str, Any]]:
    """bench.serve's client-count rounds against the pair, then against mlx_lm.server on the
    same model (the pair stopped first when the bench started it: one model in memory)."""
    from . import serve

    counts = list(opts.client_counts)
    ours = serve.measure_all(base, opts.max_tokens, counts, opts.rounds, api_key, constrained=False)
    if pair is not None:
        pair.close()
    proc, mlx_base = soak_pair.mlx_lm_server(model, max(counts))
    try:
        theirs = serve.measure_all(mlx_base, opts.max_tokens, counts, opts.rounds, constrained=False)
    finally:
        reap(proc)
    for rec, other in zip(ours, theirs):
        other["name"] = f"mlx-lm-server-{other['clients']}"
        rec["tok_s_vs_mlx_lm_server"] = round(rec["tok_s"] / other["tok_s"], 3) if other["tok_s"] else None
    return ours + theirs


def soak_report(url: Optional[str], model: Path, transport: str, rdma_device: Optional[str],
                api_key: Optional[str], opts: SoakOptions, as_json: bool) -> int:
    """`ds4tp bench --serve --soak` with values mlx_ds4tp.cli.bench checked; the exit status."""
    from .serve import print_records

    pair = None
    if url:
        host, port = soak_pair.loopback_host(url)
        base = url.rstrip("/")
        if health(base) != 200:
            raise RuntimeError(f"the server at {base} is not healthy (GET /health is not 200)")
        leader, worker = soak_pair.find_pair_pids(port)
        if leader is None or worker is None:
            log("soak: the leader's or the worker's process was not found here (ps): its "
                   "memory is not reported")
        pids = {"leader": leader, "worker": worker}
    else:
        pair = ServedPair(model, transport, rdma_device,
                          ["--max-batch", str(max([opts.clients, *opts.client_counts]))]).start()
        host, port, base = "127.0.0.1", pair.port, pair.base
        pids = {"leader": pair.pid("leader"), "worker": pair.pid("worker")}
    try:
        rec = run_soak(Target(host, port, api_key, opts.request_timeout), base, opts, model, pair, pids)
        if pair is not None and not rec["ok"]:
            pair.dump_log(40)
        print_soak(rec, as_json)
        if opts.client_counts:
            records = _client_counts(base, model, opts, api_key, pair)
            n = len(records) // 2
            print_records(records[:n], as_json)
            print_records(records[n:], as_json)
            if not as_json:
                for rec_ in records[:n]:
                    if rec_["tok_s_vs_mlx_lm_server"] is not None:
                        print(f"{rec_['name']:>10}  tok/s = {rec_['tok_s_vs_mlx_lm_server']:.2f}x "
                              f"mlx-lm-server-{rec_['clients']}")
    finally:
        if pair is not None:
            pair.close()
    return 0 if rec["ok"] else 1
