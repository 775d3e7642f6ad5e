"""`ds4tp bench --serve --disk-cache`: the prompt cache on disk (`ds4tp serve --prompt-cache-dir`),
both ranks on 127.0.0.1, each with its own directory.

ttft: a long prompt's time to first token (streamed, from the client's side) cold, then the same
prompt plus a new turn with its prefix in memory, then both ranks stopped (SIGTERM to the leader,
as Ctrl-C), started again on the same directories, and the prompt plus another new turn with its
prefix loaded from disk; that answer is checked against a cold server's (a third start, without
the directories). soak (--disk-soak SECONDS): clients looping over many distinct prefixes, a few
turns each and now and then an old one again, against a pair whose memory holds few caches and
whose directories are bounded: the directories' largest size seen against the bound, the disk
hits, and the leader's resident memory read every 0.5 s under load: each minute's median, the last
minute's against the first (a reading at rest is no match for one under load: requests in flight
hold their prefill and decode buffers), and one idle reading at the end, on its own.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..base.log import log
from .serve import stream_completion
from .served_pair import ServedPair
from .soak_pair import rss_kib

IDLE_SEC = 3.0  # the server hands memory back once idle: RSS is read there


def _pair(model: Path, transport: str, extra: List[str], dirs: Optional[Dict[str, Path]],
          disk_bytes: int) -> ServedPair:
    """A started pair, each rank with its own cache directory (or none)."""
    per_rank = {name: ["--prompt-cache-dir", str(d), "--prompt-cache-disk-bytes", str(disk_bytes)]
                for name, d in (dirs or {}).items()}
    return ServedPair(model, transport, None, ["--max-kv-tokens", "0", *extra], per_rank).start(600.0)


def stream(base: str, prompt: List[int], max_tokens: int) -> Dict[str, object]:
    """One greedy streamed completion of token ids: its time to first text (ms), text, cached tokens."""
    r = stream_completion(base, prompt, max_tokens)
    return {"ttft_ms": 1000.0 * (r["first"] - r["start"]), "text": r["text"], "cached_tokens": r["cached_tokens"]}


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _tokens(rng: random.Random, vocab: int, count: int) -> List[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


def ttft(model: Path, transport: str, prompt_tokens: int, max_tokens: int) -> Dict[str, object]:
    """The TTFT record of the module docstring."""
    rng, vocab = random.Random(7), _vocab(model)
    prefix, turn1, turn2 = (_tokens(rng, vocab, n) for n in (prompt_tokens, 16, 16))
    warm = _tokens(rng, vocab, 32)
    root = Path(tempfile.mkdtemp(prefix="ds4tp-disk-bench-"))
    dirs = {"leader": root / "leader", "worker": root / "worker"}
    rec: Dict[str, object] = {"name": "serve-disk-ttft", "prompt_tokens": prompt_tokens}
    pair = _pair(model, transport, [], dirs, 10**10)
    try:
        stream(pair.base, warm, 4)  # first-call compilation
        cold = stream(pair.base, prefix, max_tokens)
        memory = stream(pair.base, prefix + turn1, max_tokens)
        pair.stop()
        log("disk bench: cold and memory measured; restarting the pair on the same directories")
        pair = _pair(model, transport, [], dirs, 10**10)
        stream(pair.base, warm, 4)
        disk = stream(pair.base, prefix + turn2, max_tokens)
        rec["disk_hits"] = pair.health_body().get("disk_hits")
        pair.stop()
        log("disk bench: disk measured; a cold server for the reference answer")
        pair = _pair(model, transport, [], None, 0)
        stream(pair.base, warm, 4)
        reference = stream(pair.base, prefix + turn2, max_tokens)
        pair.stop()
    except BaseException:
        pair.dump_log()
        pair.close()
        raise
    sizes = {n: _dir_bytes(d) for n, d in dirs.items()}
    shutil.rmtree(root, ignore_errors=True)
    rec.update({"cold_ttft_ms": round(cold["ttft_ms"], 1), "memory_ttft_ms": round(memory["ttft_ms"], 1),
                "disk_ttft_ms": round(disk["ttft_ms"], 1),
                "cold_again_ttft_ms": round(reference["ttft_ms"], 1),
                "memory_cached_tokens": memory["cached_tokens"], "disk_cached_tokens": disk["cached_tokens"],
                "disk_vs_cold": round(disk["ttft_ms"] / cold["ttft_ms"], 3),
                "memory_vs_cold": round(memory["ttft_ms"] / cold["ttft_ms"], 3),
                "disk_text_exact": disk["text"] == reference["text"],
                "disk_bytes_per_rank": sizes})
    return rec


def soak(model: Path, transport: str, seconds: float, disk_bytes: int, clients: int = 4,
         prompt_tokens: int = 256) -> Dict[str, object]:
    """The soak record of the module docstring."""
    vocab = _vocab(model)
    root = Path(tempfile.mkdtemp(prefix="ds4tp-disk-soak-"))
    dirs = {"leader": root / "leader", "worker": root / "worker"}
    pair = _pair(model, transport, ["--prompt-cache-size", "4"], dirs, disk_bytes)
    largest = {"leader": 0, "worker": 0}
    done = {"requests": 0, "failures": 0}
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(100 + i)
        seen: List[List[int]] = []
        while time.monotonic() < stop_at:
            if seen and rng.random() < 0.3:
                prompt = rng.choice(seen) + _tokens(rng, vocab, 8)  # an old prefix, a new turn
            else:
                prompt = _tokens(rng, vocab, rng.randrange(prompt_tokens // 2, prompt_tokens))
                seen.append(prompt)
            try:
                stream(pair.base, prompt, 8)
                with lock:
                    done["requests"] += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported
                log(f"disk soak: a request failed: {exc}")
                with lock:
                    done["failures"] += 1

    pid = pair.pid("leader")
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.monotonic()
    rss: List[Tuple[float, int]] = []  # (seconds in, leader KiB) every poll, under load
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for name, d in dirs.items():
                largest[name] = max(largest[name], _dir_bytes(d))
            kib = rss_kib(pid)
            if kib is not None:
                rss.append((time.monotonic() - t0, kib))
            time.sleep(0.5)
        time.sleep(IDLE_SEC)
        rss_idle = rss_kib(pid)
        health = pair.health_body()
        pair.stop()
    except BaseException:
        pair.dump_log()
        pair.close()
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    minutes = _minute_medians(rss, seconds)
    return {"name": "serve-disk-soak", "seconds": seconds, "clients": clients, **done,
            "disk_bound_bytes": disk_bytes, "largest_dir_bytes": largest,
            "within_bound": all(v <= disk_bytes for v in largest.values()),
            "disk_hits": health.get("disk_hits"), "disk_writes": health.get("disk_writes"),
            "disk_load_failures": health.get("disk_load_failures"),
            "leader_rss_sampled": "every 0.5 s under load, the median of each minute",
            "leader_rss_minute_medians_kib": minutes,
            "leader_rss_last_vs_first_minute": round(minutes[-1] / minutes[0], 3) if len(minutes) > 1 else None,
            "leader_rss_idle_end_kib": rss_idle}


def _dir_bytes(directory: Path) -> int:
    """Bytes of the directory's cache files, those being written included (a file renamed or
    removed while it is read counts as gone)."""
    total = 0
    for path in directory.glob("*.safetensors"):  # pathlib's * matches the dot-named temporaries
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _minute_medians(samples: List[Tuple[float, int]], seconds: float) -> List[int]:
    """The median reading of each whole minute of the run (the last minute: the run's last 60
    s, however long the run)."""
    windows = [(60.0 * m, 60.0 * (m + 1)) for m in range(int(seconds // 60))]
    if windows and windows[-1][1] < seconds:
        windows[-1] = (seconds - 60.0, seconds)
    medians = []
    for lo, hi in windows:
        inside = [kib for t, kib in samples if lo <= t < hi]
        if inside:
            medians.append(int(statistics.median(inside)))
    return medians


def report(model: Path, transport: str, prompt_tokens: int, max_tokens: int, soak_seconds: float,
           disk_bytes: int, as_json: bool) -> int:
    """`ds4tp bench --serve --disk-cache`: the TTFT record, then the soak's when asked."""
    records = [ttft(model, transport, prompt_tokens, max_tokens)]
    if soak_seconds:
        records.append(soak(model, transport, soak_seconds, disk_bytes))
    for rec in records:
        print(json.dumps(rec) if as_json else "  ".join(f"{k}={v}" for k, v in rec.items()), flush=True)
    ok = records[0]["disk_text_exact"] and all(r.get("within_bound", True) and not r.get("failures")
                                               for r in records)
    return 0 if ok else 1
