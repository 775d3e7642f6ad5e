"""A lost Mac under load: `python -m mlx_ds4tp.bench.shrink`. N ranks of `ds4tp serve
--shrink-after SEC` here, CLIENTS clients asking greedy completions for SECONDS; a worker is
killed (SIGKILL) at a quarter of the run and started again at three fifths. Every answer must
be the unsplit model's text (mlx-lm's generate here) or a clean error (refused with an HTTP
status, or an error event in the stream: bench/soak_client.py's kinds); none may hang past its
timeout, and a stream cut without an error counts as wrong. Prints one JSON record: the answers by outcome,
the seconds from the kill to /health 200 at N-1 ranks (serving again) and from the restart to
N ranks, and the leader's own figures from its log (the shrink's and the grow's durations)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..base.log import log
from ..link.wire import MAX_MESH_SIZE
from .served_pair import ServedPair
from .soak_client import Outcome, Target, stream

PROMPTS = ("the lost Mac", "a group of three", "serving on", "grows back", "every answer exact",
           "no request hung", "tensor parallel", "one more prompt")


@dataclasses.dataclass(frozen=True)
class ShrinkLoad:
    """What one run does: the model (None: a small random llama built here), ranks, clients,
    seconds, --shrink-after, the transport, each request's timeout and answer length."""

    model: Optional[Path] = None
    ranks: int = 3
    clients: int = 8
    seconds: float = 60.0
    shrink_after: float = 2.0
    transport: str = "tcp"
    request_timeout: float = 60.0
    max_tokens: int = 12


class Outcomes:
    """Every answer's outcome (soak_client's kinds, "ok" split into exact and wrong), counted
    under one lock, with when each clean error came and the slowest answer."""

    def __init__(self) -> None:
        self.kinds: "collections.Counter[str]" = collections.Counter()
        self.wrong_examples: List[str] = []
        self.error_times: List[float] = []
        self.slowest_s = 0.0
        self._lock = threading.Lock()

    def count(self, out: Outcome, expected: str) -> None:
        kind = out.kind
        if kind == "ok":
            kind = "exact" if out.text == expected else "wrong"
        elif kind == "stream_cut":
            kind = "wrong"  # ended without [DONE] and without an error: not a clean error
        with self._lock:
            self.kinds[kind] += 1
            self.slowest_s = max(self.slowest_s, out.end - out.start)
            if kind == "wrong" and len(self.wrong_examples) < 5:
                self.wrong_examples.append(f"{out.kind}: {out.text!r} != {expected!r} {out.detail}")
            if kind not in ("exact", "wrong", "hung"):
                self.error_times.append(time.monotonic())

    def figures(self) -> dict:
        kinds = dict(self.kinds)
        return {"exact": kinds.pop("exact", 0), "wrong": kinds.pop("wrong", 0), "hung": kinds.pop("hung", 0),
                "clean_errors": sum(kinds.values()), "error_kinds": kinds, "slowest_s": round(self.slowest_s, 3),
                "wrong_examples": self.wrong_examples}


def references(model: Path, max_tokens: int) -> Tuple[Dict[str, List[int]], Dict[str, str]]:
    """Each prompt's token ids, and its greedy text on the unsplit model (mlx-lm's generate)."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    loaded, tokenizer = load(str(model))
    ids = {p: list(tokenizer.encode(p)) for p in PROMPTS}
    return ids, {p: generate(loaded, tokenizer, prompt=ids[p], max_tokens=max_tokens,
                             sampler=make_sampler(0.0)) for p in PROMPTS}


def _client(target: Target, prompts: Dict[str, List[int]], refs: Dict[str, str], settings: ShrinkLoad,
            until: float, outcomes: Outcomes, index: int) -> None:
    n = index
    while time.monotonic() < until:
        prompt = PROMPTS[n % len(PROMPTS)]
        n += settings.clients
        out = stream(target, prompts[prompt], settings.max_tokens)
        outcomes.count(out, refs[prompt])
        if out.kind not in ("ok", "hung"):
            time.sleep(0.2)  # as a client honouring Retry-After would, briefly


def _health(base: str) -> tuple:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError):
        return 0, {}


def _until_size(base: str, size: int, since: float, within: float) -> Optional[float]:
    """Seconds from `since` until /health is 200 with the group at `size` ranks; None past within."""
    while time.monotonic() - since < within:
        code, body = _health(base)
        if code == 200 and body.get("size") == size and body.get("state") == "serving":
            return round(time.monotonic() - since, 3)
        time.sleep(0.05)
    return None


def run_load(settings: ShrinkLoad) -> dict:
    """One run (module docstring); its record."""
    with tempfile.TemporaryDirectory() as scratch:
        model = settings.model
        if model is None:
            from ..synthetic.tiny_model import save_llama

            model = save_llama(Path(scratch) / "llama", "tiny8", seed=3)
        prompts, refs = references(model, settings.max_tokens)
        lost = (["worker"] + [f"worker{n}" for n in range(2, settings.ranks)])[-1]  # the last rank
        rdma = "ucsim" if settings.transport == "rdma" else None
        served = ServedPair(model, settings.transport, rdma, ranks=settings.ranks,
                            extra=["--max-tokens", str(settings.max_tokens)],
                            rank_extra={"leader": ["--shrink-after", f"{settings.shrink_after:g}"]})
        with served:
            served.start()
            outcomes = Outcomes()
            t0 = time.monotonic()
            until = t0 + settings.seconds
            target = Target("127.0.0.1", served.port, None, settings.request_timeout)
            clients = [threading.Thread(target=_client, args=(target, prompts, refs, settings, until,
                                                              outcomes, i), daemon=True)
                       for i in range(settings.clients)]
            for c in clients:
                c.start()
            time.sleep(settings.seconds / 4)
            killed = time.monotonic()
            served.kill(lost)
            log(f"shrink bench: {lost} killed at {killed - t0:.1f} s")
            shrunk = _until_size(served.base, settings.ranks - 1, killed, settings.shrink_after + 60)
            time.sleep(max(0.0, t0 + settings.seconds * 0.6 - time.monotonic()))
            restarted = time.monotonic()
            served.start_again(lost)
            grown = _until_size(served.base, settings.ranks, restarted, 120)
            for c in clients:
                c.join(settings.request_timeout + 30)
            leader_log = _leader_lines(served)
        grown_at = restarted + (grown if grown is not None else 120)
        during_grow = sum(restarted <= at <= grown_at for at in outcomes.error_times)
        figures = outcomes.figures()
        trouble = [line for line in leader_log.splitlines() if "did not form" in line or "could not" in line]
        return {"name": f"shrink-load-{settings.transport}", "leader_trouble": trouble[:5], "ranks": settings.ranks,
                "clients": settings.clients, "seconds": settings.seconds, "shrink_after_s": settings.shrink_after,
                "kill_to_serving_s": shrunk, "restart_to_grown_s": grown,
                **_leader_figures(leader_log),
                **figures, "errors_during_grow": during_grow,
                "stuck_clients": sum(c.is_alive() for c in clients)}


def _leader_lines(served: ServedPair) -> str:
    served.log.seek(0)
    return served.log.read().decode(errors="replace")


def _leader_figures(text: str) -> dict:
    """The leader's own durations: the shrink (from the loss) and the grow (from the knock)."""
    shrink = re.search(r"shrank from \d+ to \d+ ranks in ([\d.]+) s \(([\d.]+) s since the loss\)", text)
    grow = re.search(r"grew from \d+ to \d+ ranks in ([\d.]+) s", text)
    return {"leader_shrink_s": float(shrink.group(1)) if shrink else None,
            "leader_loss_to_serving_s": float(shrink.group(2)) if shrink else None,
            "leader_grow_s": float(grow.group(1)) if grow else None}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_ds4tp.bench.shrink", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a model directory (default: a small random llama)")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--shrink-after", type=float, default=2.0)
    p.add_argument("--transport", choices=("tcp", "rdma"), default="tcp", help="rdma: over ucsim")
    p.add_argument("--request-timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    if not 1 < args.ranks <= MAX_MESH_SIZE or args.clients < 1 or args.seconds <= 0:
        raise SystemExit(f"--ranks {args.ranks} (2 to 8), --clients {args.clients} (1 or more), --seconds "
                         f"{args.seconds:g} (above 0): give values in those ranges")
    record = run_load(ShrinkLoad(args.model, args.ranks, args.clients, args.seconds, args.shrink_after,
                                 args.transport, args.request_timeout))
    print(json.dumps(record))
    return 0 if record["wrong"] == record["hung"] == record["stuck_clients"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
