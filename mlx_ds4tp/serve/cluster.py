"""The cluster page's figures (GET /cluster, and the page at GET / that polls it): every rank
(host, chip, memory, share of the split, up or down), every link between two ranks (transport,
device, the recent decode gates' p50/p99, gates and bytes a second) and the work under way
(decode tokens a second, time to first token and per output token, sessions, prompt caches,
the prefills in progress).

The leader's own figures and its links are read when asked (its latency rings, MLX's memory
counters: no lock, no wait). A worker's figures, and the links between two workers, are the
worker's answer to RANK_STATS, which the engine thread asks only while it is idle (Engine.on_idle),
at most every ASK_EVERY_SEC and only while someone reads /cluster: the decode loop never waits
for them, so under load they are those of the last idle moment (`figures_age_s` says how old).
A rank is "down" as soon as the engine knows the group broke (a dead worker is noticed within
a quarter second when idle, at its next gate when busy); the workers still alive are
"rejoining" meanwhile (they follow the leader's REFORM into the new mesh)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import TransportError
from ..lockstep.protocol.commands import RankStats, rank_figures
from ..split.share import SplitShare

# How often the idle engine asks the workers, and for how long after the last read of /cluster.
# Not every second: a worker gives its memory back after a second without commands.
ASK_EVERY_SEC = 2.0
WANTED_SEC = 10.0
# The shortest window a rate (tokens, gates a second) is measured over.
RATE_WINDOW_SEC = 1.0
_RANK_NAMED = re.compile(r"\brank (\d+)\b")


def percentiles_ms(samples: Sequence[float]) -> Dict[str, Optional[float]]:
    """p50, p90, p99 of samples in seconds, in milliseconds (None while there are none)."""
    if not samples:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    p50, p90, p99 = np.percentile(np.asarray(samples, dtype=np.float64), [50, 90, 99]) * 1000.0
    return {"p50": round(float(p50), 2), "p90": round(float(p90), 2), "p99": round(float(p99), 2),
            "count": len(samples)}


def share_fractions(share: SplitShare, size: int) -> List[float]:
    """Each rank's fraction of the split (an even split: 1/size each)."""
    parts = share.parts if share.parts and len(share.parts) == size else (1,) * size
    return [round(p / sum(parts), 4) for p in parts]


def gate_vector_bytes(model: Any) -> int:
    """The bytes of one row's hidden vector as a gate sends it: hidden size times the
    activations' element size (the norms' dtype; 4 when it cannot be told)."""
    from mlx.utils import tree_flatten

    hidden = int(getattr(getattr(model, "args", None), "hidden_size", 0) or 0)
    itemsize = 4
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            itemsize = value.dtype.size
            break
    return hidden * itemsize


class _Rate:
    """A count's rate a second, measured over at least RATE_WINDOW_SEC between readings."""

    def __init__(self):
        self.at: Optional[Tuple[float, float]] = None
        self.value = 0.0

    def read(self, count: float, now: float) -> float:
        if self.at is None or count < self.at[1]:  # the first reading, or a counter that restarted
            self.at = (now, count)
        elif now - self.at[0] >= RATE_WINDOW_SEC:
            self.value = (count - self.at[1]) / (now - self.at[0])
            self.at = (now, count)
        return self.value


class ClusterView:
    """See the module docstring. Made once on the leader (serve/serving_rank.py) over the
    engine, its group, the split share and the model; it hooks itself to the engine's idle turns
    (Engine.on_idle) to ask the workers; `snapshot()` is GET /cluster's body."""

    def __init__(self, engine, metrics, share: SplitShare, model: Any, model_id: str):
        self.engine, self.metrics, self.model_id = engine, metrics, model_id
        self.group = engine.sessions.group  # the same object across re-joins (Group.reattach)
        self.size = self.group.size()
        self.shares = share_fractions(share, self.size)
        self.vector_bytes = gate_vector_bytes(model)
        self._lock = threading.Lock()
        self._workers: Dict[int, Dict[str, Any]] = {}  # rank -> its last RANK_STATS answer
        self._leader: Optional[Dict[str, Any]] = None  # the leader's figures while the group was up
        self._wanted = 0.0  # when /cluster was last read (monotonic)
        self._asked = 0.0
        self._rates: Dict[Any, _Rate] = {}
        engine.on_idle = self.ask_workers

    def regrouped(self, group, share: SplitShare) -> None:
        """The group changed size (serve/resize.py): its ranks, shares and links from now on."""
        with self._lock:
            self.group, self.size = group, group.size()
            self.shares = share_fractions(share, self.size)
            self._workers, self._rates = {}, {}

    # -- the engine thread, idle ----------------------------------------------------------
    def ask_workers(self, sessions) -> None:
        """RANK_STATS to every worker, when someone reads /cluster and the last answers are
        older than ASK_EVERY_SEC (the engine thread, between turns while idle)."""
        now = time.monotonic()
        if now - self._wanted > WANTED_SEC or now - self._asked < ASK_EVERY_SEC:
            return
        self._asked = now
        _, answers = sessions.ask(RankStats, {})
        with self._lock:
            for (figures,) in answers:
                rank = int(figures.get("rank", 0))
                figures["read_at"] = now
                for link in figures.get("links", []):
                    rate = self._rates.setdefault((rank, int(link["peer"])), _Rate())
                    link["gates_per_second"] = round(rate.read(link["gates"], now), 1)
                self._workers[rank] = figures

    # -- the HTTP face ----------------------------------------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        """Every figure of GET /cluster (docs/serving.md, "The cluster page")."""
        now = time.monotonic()
        self._wanted = now
        states = self._states()
        leader = self._leader_figures(now)
        with self._lock:
            figures = {0: leader, **{r: dict(f) for r, f in self._workers.items()}}
        ranks = [self._rank(r, figures.get(r), states[r], now) for r in range(self.size)]
        links = self._links(figures, states)
        return {"model": self.model_id, "size": self.size, "transport": self.group.transport,
                "up": self.engine.error is None, "error": self.engine.error,
                "ranks": ranks, "links": links, "work": self._work(now)}

    def _states(self) -> List[str]:
        error = self.engine.error
        if error is None:
            return ["up"] * self.size
        named = {int(r) for r in _RANK_NAMED.findall(error)}
        # A failure that names no rank: which worker died cannot be told; all are shown down.
        return ["up"] + ["down" if not named or r in named else "rejoining" for r in range(1, self.size)]

    def _leader_figures(self, now: float) -> Optional[Dict[str, Any]]:
        """The leader's own figures now; while its group is closed (down, re-forming), the
        last ones it had, its memory read now."""
        try:
            figures = rank_figures(self.group)
        except (TransportError, AttributeError, OSError):
            if self._leader is None:
                return None
            import mlx.core as mx

            return {**self._leader, "memory_used_bytes": int(mx.get_active_memory())}
        figures["read_at"] = now
        for link in figures["links"]:
            rate = self._rates.setdefault((0, link["peer"]), _Rate())
            link["gates_per_second"] = round(rate.read(link["gates"], now), 1)
        self._leader = figures
        return figures

    def _rank(self, rank: int, figures: Optional[Dict[str, Any]], state: str, now: float) -> Dict[str, Any]:
        known = figures or {}
        return {"rank": rank, "role": "leader" if rank == 0 else "worker", "state": state,
                "host": known.get("host"), "chip": known.get("chip") or None,
                "memory_total_bytes": known.get("memory_total_bytes"),
                "memory_used_bytes": known.get("memory_used_bytes"),
                "figures_age_s": round(now - known["read_at"], 1) if "read_at" in known else None,
                "share": self.shares[rank]}

    def _links(self, figures: Dict[int, Optional[Dict[str, Any]]], states: List[str]) -> List[Dict[str, Any]]:
        """One link per pair of ranks, as its lower rank sees it (the leader's own, live)."""
        out = []
        for a in range(self.size):
            seen = {link["peer"]: link for link in ((figures.get(a) or {}).get("links") or [])}
            for b in range(a + 1, self.size):
                link = seen.get(b, {})
                state = "up" if states[a] == states[b] == "up" else "down"
                gps = link.get("gates_per_second", 0.0) if state == "up" else 0.0  # no gates cross it now
                out.append({"ranks": [a, b], "state": state,
                            "transport": link.get("transport"), "device": link.get("device"),
                            "gate_p50_us": link.get("gate_p50_us"), "gate_p99_us": link.get("gate_p99_us"),
                            "gates": link.get("gates"), "gates_per_second": gps,
                            "bytes_per_second": round(gps * self.vector_bytes)})
        return out

    def _work(self, now: float) -> Dict[str, Any]:
        engine, metrics = self.engine, self.metrics
        counts, stats = engine.counts(), engine.stats
        rate = self._rates.setdefault("tokens", _Rate()).read(metrics.tokens_streamed, now)
        per_token = engine.mixing.separate_per_token
        prefills = []
        for row in list(engine.prefilling):
            total = max(len(row.request.prompt) - 1, 1)
            left = len(row.todo)
            prefills.append({"tokens": total, "done": total - left,
                             "seconds_left": round(left * per_token, 1) if per_token else None})
        return {"decode_tokens_per_second": round(rate, 1),
                "ttft_ms": percentiles_ms(list(metrics.recent_ttft)),
                "tpot_ms": percentiles_ms(list(metrics.recent_tpot)),
                "sessions_running": counts["decoding"] + counts["waiting"] + counts["prefilling"],
                "sessions_decoding": counts["decoding"], "sessions_queued": counts["queued"],
                "prompt_cache_hits": metrics.prompt_cache_hits,
                "prompt_cache_hit_tokens": stats.get("cached_tokens", 0),
                "prompt_cache_entries": counts["prompt_cache_entries"],
                "prompt_cache_bytes": counts["prompt_cache_bytes"],
                "prompt_cache_disk_bytes": counts.get("prompt_cache_disk_bytes"),
                "prompt_cache_disk_entries": counts.get("prompt_cache_disk_entries"),
                "prefills": prefills}
