"""`ds4tp bench`'s reports: runs the gate bench (bench.gates) or the model bench (bench.model)
with values mlx_ds4tp.cli.bench checked, and prints the records, the ratios and the plot."""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..base.log import log
from ..link.config import LinkSettings


def model_report(bench, as_json: bool) -> int:
    """`ds4tp bench --model` (bench: a bench.model.ModelBench): decode and prefill tok/s of every
    contender (with --split, our tcp pair split so beside the even split, each rank's peak
    resident memory), then the ratios."""
    from . import model as bench_model

    records = bench_model.model_bench(bench)
    print_records(records, as_json)
    if not as_json:
        _print_model_ratios(records)
    return 0


def gate_rank_report(link: LinkSettings, nbytes: int, iters: int, as_json: bool) -> int:
    """One rank of a two-machine gate bench: the other machine runs the same line."""
    from . import gates as bench_gates

    records = bench_gates.run_rank(link.address, link.transport, link.rdma_device, nbytes, iters,
                                   secret=link.secret)
    print_records(records, as_json, keep_samples=True)
    return 0


def gates_report(transports: Sequence[str], rdma_device: Optional[str], nbytes: int, iters: int,
                 as_json: bool, plot: Optional[str] = None) -> int:
    """Both ranks here: each of `transports` ("tcp", "rdma"; "mlx": MLX's ring alone) and MLX's
    ring, then the ratios and (plot: a PNG path) the latency histogram."""
    from . import gates as bench_gates

    if plot:
        # The ranks this process spawns send their raw samples back.
        os.environ[bench_gates.EMIT_SAMPLES_ENV] = "1"
    records: List[dict] = []
    if "tcp" in transports:
        records += bench_gates.spawn_transport("tcp", None, nbytes, iters)
    if "rdma" in transports:
        records += bench_gates.spawn_transport("rdma", rdma_device or "ucsim", nbytes, iters)
    records += bench_gates.spawn_ring(nbytes, iters)
    print_records(records, as_json)
    if not as_json:
        _print_ratios(records)
    if plot:
        plot_histograms(records, plot)
        log(f"latency histogram written to {plot}")
    return 0


def print_records(records: List[dict], as_json: bool, keep_samples: bool = False) -> None:
    """One line per record on stdout: JSON, or a table row.
    keep_samples: the raw samples stay in the JSON (a rank passing them up)."""
    if not keep_samples:
        records = [{k: v for k, v in rec.items() if k != "samples_us"} for rec in records]
    print_rows(records, as_json, _table_row)


def print_rows(records: Sequence[dict], as_json: bool, row: Callable[[dict], str]) -> None:
    """Each record on its line of stdout, flushed as it comes: its JSON, or `row(record)` (a
    bench's table row)."""
    for rec in records:
        print(json.dumps(rec) if as_json else row(rec), flush=True)


def _table_row(rec: dict) -> str:
    """A gate record's latencies, or a model record's tok/s, exchanges, split and tokens check."""
    if "p50_us" in rec:
        return (f"{rec['name']:>22}  {rec['bytes']:>7} B  p50 {rec['p50_us']:8.1f} us  "
                f"p99 {rec['p99_us']:8.1f} us  ({rec['iters']} iters)")
    match = ("(gates skipped: the bound for any transport)" if rec["tokens_match"] is None
             else f"tokens_match={rec['tokens_match']}")
    exchanges = (f"  exchanges {rec['exchange_ms_per_token']:.2f} ms/token"
                 if "exchange_ms_per_token" in rec else "")
    if "split" in rec:
        shares = " ".join(rec.get("split_rounds") or [rec["split"]])
        exchanges += (f"  split {shares}: peak resident {rec['rank0_peak_rss_mib']:.0f} MiB "
                      f"(rank 0) / {rec['rank1_peak_rss_mib']:.0f} MiB (rank 1)")
    return (f"{rec['name']:>22}  prefill {rec['prefill_tok_s']:8.1f} tok/s{_rounds(rec, 'prefill_tok_s')}"
            f"  decode {rec['tok_s']:8.1f} tok/s{_rounds(rec, 'tok_s')}{exchanges}  {match}")


def _rounds(rec: dict, key: str) -> str:
    got = rec.get(f"{key}_rounds", ())
    return " (rounds " + " ".join(f"{t:.1f}" for t in got) + ")" if len(got) > 1 else ""


def _print_model_ratios(records: List[dict]) -> None:
    by_name = {r["name"]: r for r in records}
    ceiling = by_name.get("tp2-compute-ceiling")
    for key, label in (("prefill_tok_s", "prefill"), ("tok_s", "decode")):
        for base in ("single", "mlx-lm-ring"):
            if base not in by_name or not by_name[base][key]:
                continue
            for name, rec in by_name.items():
                # mlx-lm's own plan over our pair: against the same plan over MLX's ring.
                ours = name.startswith("tp2") or (base == "mlx-lm-ring" and name.startswith("mlx-lm-"))
                if name != base and ours:
                    print(f"{name:>22}  {label} = {rec[key] / by_name[base][key]:.2f}x {base}")
        if ceiling and ceiling[key]:
            for name, rec in by_name.items():
                if name.startswith("tp2") and name != ceiling["name"]:
                    print(f"{name:>22}  {label} = {rec[key] / ceiling[key]:.2f}x the compute ceiling"
                          f"{_decode_gap(rec, ceiling) if key == 'tok_s' else ''}")


def _decode_gap(rec: dict, ceiling: dict) -> str:
    """What a pair's decode loses to the ceiling a token, beside what the leader spent in
    exchanges: the gate round trips plus waiting for the other rank's half, the lockstep's
    whole cost (the ceiling's ranks never wait for each other)."""
    if not rec.get("tok_s") or "exchange_ms_per_token" not in rec:
        return ""
    gap = 1e3 / rec["tok_s"] - 1e3 / ceiling["tok_s"]
    return (f" ({gap:+.2f} ms/token; the leader spent {rec['exchange_ms_per_token']:.2f} ms/token "
            "in exchanges, waits for the other rank included)")


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
        # all_sum on an mx.array against the bare gate of its own transport: what the gate
        # op (checks, the sum, the result array) adds to the exchange.
        # The in-graph gate's own cost (MLX's cost per op taken out) against the same.
        suffix = next((s for s in ("-all_sum", "-in-graph") if name.endswith(s)), None)
        bare = by_name.get(name[: -len(suffix)]) if suffix else None
        if bare:
            parts.append(f"{rec['p50_us'] / bare['p50_us']:.2f}x {bare['name']}")
        if parts:
            print(f"{name:>22}  p50 = " + ", ".join(parts))


def plot_histograms(records: List[Dict], path: str) -> None:
    """One latency histogram per transport, on shared log-spaced bins."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'mlx-ds4tp[plot]'") from None
    with_samples = [r for r in records if r.get("samples_us")]
    if not with_samples:
        raise RuntimeError("no latency samples to plot")
    hi = max(np.percentile(r["samples_us"], 99.9) for r in with_samples)
    lo = min(min(r["samples_us"]) for r in with_samples)
    bins = np.geomspace(max(lo, 0.1), max(hi, lo * 2), 80)
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in with_samples:
        ax.hist(r["samples_us"], bins=bins, histtype="step", linewidth=1.5,
                label=f"{r['name']} (p50 {r['p50_us']} us, p99 {r['p99_us']} us)")
    ax.set_xscale("log")
    ax.set_xlabel(f"round trip of one {with_samples[0]['bytes']}-byte exchange (us)")
    ax.set_ylabel("count")
    ax.set_title("ds4tp gate latency per transport")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
