"""`GET /metrics`: the server's state in the Prometheus text format (prometheus_client), what
docs/serving.md's "Metrics" lists. One registry per server (not the process-wide default), so two
servers in one process never mix their counts."""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a few ms (a cached prompt) to minutes (a long prefill behind a full batch).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Recent samples kept for the cluster page's percentiles (the histograms' buckets are too coarse).
RECENT_SAMPLES = 4096


class ServeMetrics:
    """The counters the HTTP handlers update, and the gauges read from the engine and group."""

    def __init__(self, engine, gate_latency_us: Optional[Callable[[], Any]] = None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ds4tp_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ds4tp_prompt_tokens", "Prompt tokens of the requests served", registry=r)
        self.cached_tokens = Counter("ds4tp_cached_prompt_tokens",
                                     "Prompt tokens reused from the prompt cache", registry=r)
        self.completion_tokens = Counter("ds4tp_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("ds4tp_time_to_first_token_seconds",
                              "From a request's arrival to its first text", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("ds4tp_inter_token_seconds", "Between a request's consecutive generated tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        # The cluster page's figures (serve/cluster.py): recent times to first token and gaps
        # between tokens (seconds), tokens streamed and requests served from a cached prefix.
        self.recent_ttft: "collections.deque[float]" = collections.deque(maxlen=RECENT_SAMPLES)
        self.recent_tpot: "collections.deque[float]" = collections.deque(maxlen=RECENT_SAMPLES)
        self.tokens_streamed = 0
        self.prompt_cache_hits = 0
        counts = engine.counts

        def gauge(name: str, what: str, read: Callable[[], float]) -> None:
            Gauge(f"ds4tp_{name}", what, registry=r).set_function(read)

        for name, key, what in (
                ("sessions_prefilling", "prefilling", "Sessions whose prompt is being prefilled"),
                ("sessions_waiting", "waiting", "Sessions prefilled and waiting to join the decode batch"),
                ("sessions_decoding", "decoding", "Sessions in the decode batch"),
                ("kv_reserved_tokens", "kv_reserved_tokens",
                 "Cache tokens the sessions under way reserve (prompt + max_tokens)"),
                ("kv_budget_tokens", "kv_budget_tokens", "The KV budget in tokens (0: none)"),
                ("prompt_cache_bytes", "prompt_cache_bytes", "Bytes the stored prompt caches take on each machine")):
            gauge(name, what, lambda key=key: counts()[key])
        gauge("requests_queued", "Requests submitted, not yet admitted by the engine", engine.queued)
        gauge("kv_tokens", "Tokens the active sessions' caches hold", engine.kv_tokens)
        if engine.disk_cache is not None:  # --prompt-cache-dir
            for key, what in (("prompt_cache_disk_bytes", "Bytes the leader's prompt-cache files take"),
                              ("prompt_cache_disk_entries", "Prompt caches stored on the leader's disk"),
                              ("prompt_cache_disk_seconds_saved",
                               "Prefill time the prefixes loaded from disk saved (at the measured prefill rate)"),
                              ("disk_writes", "Prompt caches written to disk"),
                              ("disk_write_failures", "Writes that failed (a full disk: served from memory)")):
                name = key if key.startswith("prompt_cache") else f"prompt_cache_{key}"
                gauge(name, what, lambda key=key: counts()[key])
            for key, what in (("disk_hits", "Requests whose prefix was loaded from disk"),
                              ("disk_tokens", "Prompt tokens loaded from disk instead of computed"),
                              ("disk_load_failures", "Loads from disk a rank could not make (both recomputed)")):
                gauge(f"prompt_cache_{key}", what, lambda key=key: engine.stats[key])
        # Totals since start, read from the engine (whose parts own them): gauges, not
        # counters, because prometheus_client counters cannot be read from a function.
        for key, what in (("prefill_batches", "Prefill forwards (each of up to --prompt-concurrency prompts)"),
                          ("decode_steps", "Decode forwards (each over every running session)"),
                          ("drafted_tokens", "Tokens drafted for speculative sessions"),
                          ("accepted_tokens", "Drafted tokens the model accepted")):
            gauge(key, what, lambda key=key: engine.stats[key])
        gauge("pair_up", "1 while the two-machine pair is up, else 0", lambda: 1.0 if engine.error is None else 0.0)
        if gate_latency_us is not None:
            gauge("gate_latency_p50_microseconds", "Median round trip of the recent decode gates",
                  lambda: gate_latency_us()[0])
            gauge("gate_latency_p99_microseconds", "99th percentile round trip of the recent decode gates",
                  lambda: gate_latency_us()[1])

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        if cached_tokens > 0:
            self.prompt_cache_hits += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenClock:
    """One request's time to first token and the gaps between its tokens."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.first = True

    def tokens(self, count: int) -> None:
        """`count` tokens (one event's worth) have just arrived."""
        if count <= 0:
            return
        now = time.monotonic()
        self.metrics.tokens_streamed += count
        if self.first:
            self.metrics.ttft.observe(now - self.start)
            self.metrics.recent_ttft.append(now - self.start)
            self.first = False
            count -= 1
        if count > 0:
            gap = (now - self.last) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
            self.metrics.recent_tpot.append(gap)
        self.last = now
