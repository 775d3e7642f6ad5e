"""`ds4tp bench --serve`: aggregate tok/s and time to first token of `ds4tp serve` for 1, 2, 4
and 8 concurrent clients, both ranks on 127.0.0.1.

Each client streams one completion of `max_tokens` tokens (greedy, a prompt of its own) and the
figures come from the client's side of the HTTP connection:
  tok_s         all clients' completion tokens / wall time from the first request to the last end
  decode_tok_s  the sum of the clients' decode rates ((tokens - 1) / (last token - first token)),
                the pair's decode throughput while they all run
  ttft_ms       time to first token, median and worst over the clients
With --poll-cluster each client count is also measured with a poller reading GET /cluster every
second (what the cluster page does while it is open), the two interleaved round by round, so
the records serve-N and serve-N+poll compare the same server in the same session.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

from ..base.log import log
from . import structured
from .served_pair import ServedPair
from .soak_client import json_headers

PROMPTS = ["The two machines agree that", "Once upon a time", "A list of prime numbers:",
           "The weather today", "In the beginning", "Dear diary,", "Rules of the road:",
           "The recipe calls for"]
CLIENTS = (1, 2, 4, 8)
CONNECT_RETRIES = 5
POLL_SEC = 1.0  # the cluster page's poll


def sse_events(lines: Iterable[bytes]) -> Iterator[dict]:
    """The events of a streamed answer's lines (its `data: {...}` ones, [DONE] left out);
    RuntimeError with the server's message at an error event."""
    for line in lines:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"the server failed the request: {event['error']['message']}")
        yield event


def stream_completion(base: str, prompt: Union[str, List[int]], max_tokens: int,
                      api_key: Optional[str] = None, extra: Optional[dict] = None) -> Dict[str, Any]:
    """One greedy streamed completion of a text or of token ids: when it was sent (start), its
    first and last text, its end, the tokens the server counted, the text, and the prompt tokens
    the server had cached."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, method="POST",
                                 headers=json_headers(api_key))
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], {}
    with urllib.request.urlopen(req, timeout=1800) as r:
        for event in sse_events(r):
            if event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                text.append(event["choices"][0]["text"])
    end = time.perf_counter()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"start": t0, "first": first if first is not None else end,
            "last": last if last is not None else end, "end": end,
            "tokens": usage.get("completion_tokens", 0), "text": "".join(text), "cached_tokens": cached}


def measure(base: str, clients: int, max_tokens: int, api_key: Optional[str] = None) -> Dict[str, float]:
    """One round: `clients` concurrent streamed completions; the figures of the module doc."""
    results: List[Optional[Dict[str, float]]] = [None] * clients
    errors: List[BaseException] = []

    resets = [0]

    def client(i: int) -> None:
        first_try = time.perf_counter()
        for attempt in range(CONNECT_RETRIES + 1):
            try:
                results[i] = stream_completion(base, PROMPTS[i % len(PROMPTS)] + f" ({i})", max_tokens, api_key)
                results[i]["start"] = first_try
                return
            except (ConnectionResetError, ConnectionRefusedError) as exc:
                # A server whose listen backlog overflows (the standard library's is 5, as
                # mlx_lm.server's) resets connections of a burst; a client retries, and the
                # count says how often. The time of the failed tries counts in the figures.
                resets[0] += 1
                if attempt == CONNECT_RETRIES:
                    errors.append(exc)
                time.sleep(0.05 * (attempt + 1))
            except BaseException as exc:  # noqa: BLE001 - reported after the join
                errors.append(exc)
                return

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    if errors or any(r is None for r in results):
        raise RuntimeError(f"a benchmark client failed: {errors[0] if errors else 'timed out'}")
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    decode = sum((r["tokens"] - 1) / (r["last"] - r["first"]) for r in results
                 if r["tokens"] > 1 and r["last"] > r["first"])
    ttfts = [1000.0 * (r["first"] - r["start"]) for r in results]
    return {"name": f"serve-{clients}", "clients": clients, "tokens": tokens,
            "tok_s": tokens / (end - start), "decode_tok_s": decode,
            "ttft_p50_ms": statistics.median(ttfts), "ttft_max_ms": max(ttfts),
            "connections_reset": resets[0]}


class ClusterPoller:
    """GET /cluster every POLL_SEC from a thread while the context is open, as the cluster page
    does; `polls` counts the answers, a failed poll is an error at the exit."""

    def __init__(self, base: str, api_key: Optional[str] = None):
        self.url, self.api_key = base + "/cluster", api_key
        self.polls = 0
        self.failure: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-poller", daemon=True)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(urllib.request.Request(self.url, headers=headers), timeout=30) as r:
                    json.loads(r.read())
                self.polls += 1
            except (OSError, ValueError) as exc:
                self.failure = exc
                return
            self._stop.wait(POLL_SEC)

    def __enter__(self) -> "ClusterPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        if self.failure is not None and exc[0] is None:
            raise RuntimeError(f"GET {self.url} failed while the bench ran: {self.failure}")


def _median(runs: List[Dict[str, float]]) -> Dict[str, float]:
    return sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]


def measure_all(base: str, max_tokens: int, clients: Sequence[int] = CLIENTS, rounds: int = 1,
                api_key: Optional[str] = None, constrained: bool = True,
                poll_cluster: bool = False) -> List[Dict[str, float]]:
    """Against a running server (http://HOST:PORT): one record per client count, the median
    round by decode tok/s, after one warm-up request (poll_cluster: a second record per count,
    serve-N+poll, its rounds run with a ClusterPoller, interleaved with the plain ones); then
    (constrained) the serve-json record, JSON Schema decode against plain (a server that
    ignores response_format has none)."""
    measure(base, 1, min(8, max_tokens), api_key)  # warm-up: first-call compilation, caches
    records = []
    for n in clients:
        plain, polled = [], []
        for _ in range(rounds):
            plain.append(measure(base, n, max_tokens, api_key))
            if poll_cluster:
                with ClusterPoller(base, api_key) as poller:
                    polled.append({**measure(base, n, max_tokens, api_key), "name": f"serve-{n}+poll"})
                polled[-1]["cluster_polls"] = poller.polls
        records += [_median(plain)] + ([_median(polled)] if polled else [])
        log(f"serve bench: {n} client(s) done")
    if not constrained:
        return records
    records.append(structured.measure_constrained(
        lambda extra: stream_completion(base, PROMPTS[0], max_tokens, api_key, extra), rounds))
    return records


def print_records(records: List[Dict[str, float]], as_json: bool) -> None:
    """One line per client count, and each count's decode throughput over one client's."""
    one = next((r for r in records if r["clients"] == 1), None)
    for rec in records:
        if as_json:
            print(json.dumps(rec), flush=True)
            continue
        if rec["name"] == "serve-json":
            print(structured.line(rec), flush=True)
            continue
        ratio = ""
        plain = next((r for r in records if r["name"] == rec["name"].replace("+poll", "")), None)
        if rec["name"].endswith("+poll") and plain and plain["decode_tok_s"]:
            ratio = (f"  = {rec['decode_tok_s'] / plain['decode_tok_s']:.2f}x without the page "
                     f"({rec['cluster_polls']} polls of /cluster)")
        elif one and one["decode_tok_s"]:
            ratio = f"  = {rec['decode_tok_s'] / one['decode_tok_s']:.2f}x one client"
        print(f"{rec['name']:>10}  {rec['tok_s']:8.1f} tok/s  decode {rec['decode_tok_s']:8.1f} tok/s"
              f"  ttft p50 {rec['ttft_p50_ms']:7.1f} ms max {rec['ttft_max_ms']:7.1f} ms{ratio}"
              + (f"  ({rec['connections_reset']} connections reset and retried)"
                 if rec.get("connections_reset") else ""),
              flush=True)


@dataclasses.dataclass(frozen=True)
class ServeRun:
    """What `ds4tp bench --serve` measures: each client's decode length, the rounds a client
    count, and whether each count is also measured with GET /cluster polled (--poll-cluster)."""

    max_tokens: int
    rounds: int
    poll_cluster: bool = False


def serve_report(url: Optional[str], model: Optional[Path], transport: str,
                 rdma_device: Optional[str], run: ServeRun, api_key: Optional[str], as_json: bool) -> int:
    """`ds4tp bench --serve` with values mlx_ds4tp.cli.bench checked: against the server at
    `url`, else a pair started here on `model` (default the demo model)."""
    if url:
        records = measure_all(url.rstrip("/"), run.max_tokens, rounds=run.rounds, api_key=api_key,
                              poll_cluster=run.poll_cluster)
    else:
        from ..synthetic.demo_model import demo_model_dir

        model = model or demo_model_dir()
        with ServedPair(model, transport, rdma_device, ["--max-batch", str(max(CLIENTS))]).start() as pair:
            records = measure_all(pair.base, run.max_tokens, rounds=run.rounds, poll_cluster=run.poll_cluster)
    if model is not None:
        records[-1].update(structured.compile_figures(model))
    print_records(records, as_json)
    return 0
