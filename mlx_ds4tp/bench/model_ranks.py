"""`ds4tp bench --model M --ranks N[,N...]`: decode tok/s of a model split over N ranks, every
rank on this machine, for each N: ours (the ranks of `ds4tp run --ranks N` over tcp, our split:
8 KV heads on 3 ranks is 3:3:2) beside mlx-lm's own plan (`model.shard(group)`) on MLX's ring at
the same N, in the same run, rounds rotating so a slow spell of the machine falls on all alike.
mlx-lm's plan divides every count by N, so a model whose counts N does not divide is refused
there: its record says why (exo#1834's three Macs and 8 KV heads).

Each record: name ("ours-tcp" or "mlx-lm-ring"), ranks, tok_s (the median of the rounds),
tok_s_rounds, tokens_match (the greedy tokens equal the unsplit model's), or error."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Dict, List, Sequence

from ..base.log import log
from ..onehost import localpair
from ..onehost.local_run import LocalRun, run_local_pair
from .model import BENCH_PROMPT, bench_model_dir, mlx_lm_can_shard, single_record
from .report import print_rows


def ours(path: str, ranks: int, max_tokens: int, prompt_tokens: int) -> Dict:
    """Our N ranks over tcp (`ds4tp run --ranks N`): decode tok/s and the tokens."""
    run = LocalRun(Path(path), BENCH_PROMPT, max_tokens, "tcp", stop_at_eos=False,
                   prompt_tokens=prompt_tokens, ranks=ranks)
    result = run_local_pair(run, quiet=True)
    if result is None:
        return {"error": "our ranks failed (their errors are above)"}
    return {"tok_s": round(result["decode_tok_s"], 2), "token_ids": result["tokens"], "split": result["split"]}


def mlx_lm_ring(path: str, ranks: int, max_tokens: int, prompt_tokens: int) -> Dict:
    """mlx-lm's shard() over MLX's ring of N local processes (bench.model.shard_model_rank)."""
    cmd = localpair.rank_command("shard-model", "--model", path, "--max-tokens", str(max_tokens),
                                 "--prompt-tokens", str(prompt_tokens), "--transport", "mlx")
    try:
        rec = localpair.ring_records(cmd, 1200.0, ranks)[0]
    except (RuntimeError, IndexError) as exc:
        return {"error": f"mlx-lm's shard() on MLX's ring of {ranks} failed: {exc}"}
    return {"tok_s": rec["tok_s"], "token_ids": rec["token_ids"]}


def model_ranks_bench(path: str, sizes: Sequence[int], max_tokens: int, prompt_tokens: int,
                      rounds: int) -> List[Dict]:
    """Every record: for each N, ours then mlx-lm's ring; `rounds` rounds in rotating order."""
    path = bench_model_dir(path)
    reference = single_record(path, max_tokens, prompt_tokens)["token_ids"]
    contenders: Dict[tuple, Callable[[], Dict]] = {}
    for n in sizes:
        contenders[("ours-tcp", n)] = lambda n=n: ours(path, n, max_tokens, prompt_tokens)
        if mlx_lm_can_shard(path):
            contenders[("mlx-lm-ring", n)] = lambda n=n: mlx_lm_ring(path, n, max_tokens, prompt_tokens)
    keys = list(contenders)
    runs: Dict[tuple, List[Dict]] = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            log(f"bench: {key[0]} at N={key[1]}, round {r + 1} of {rounds}")
            runs[key].append(contenders[key]())
    records = []
    for (name, n), got in runs.items():
        rates = [g["tok_s"] for g in got if "tok_s" in g]
        rec: Dict = {"name": name, "ranks": n}
        if rates:
            rec.update(tok_s=round(statistics.median(rates), 2), tok_s_rounds=rates,
                       tokens_match=all(g["token_ids"] == reference for g in got if "token_ids" in g))
            if "split" in got[0]:
                rec["split"] = got[0]["split"]
        else:
            rec["error"] = got[0]["error"]
        records.append(rec)
    return records


def ratios(records: List[Dict]) -> List[str]:
    """One line per N: ours over mlx-lm's ring (> 1: ours is faster), or why there is none."""
    lines = []
    by = {(r["name"], r["ranks"]): r for r in records}
    for n in sorted({r["ranks"] for r in records}):
        mine, ring = by.get(("ours-tcp", n), {}), by.get(("mlx-lm-ring", n), {})
        if "tok_s" in mine and "tok_s" in ring and ring["tok_s"]:
            lines.append(f"N={n}: ours {mine['tok_s']:.1f} tok/s vs mlx-lm ring {ring['tok_s']:.1f} tok/s: "
                         f"{mine['tok_s'] / ring['tok_s']:.2f}x")
        elif "tok_s" in mine:
            lines.append(f"N={n}: ours {mine['tok_s']:.1f} tok/s; mlx-lm ring: {ring.get('error', 'not run')}")
    return lines


def model_ranks_report(path: str, sizes: Sequence[int], max_tokens: int, prompt_tokens: int, rounds: int,
                       as_json: bool) -> int:
    """Run the bench and print its records (a table, or JSON lines) and the ratios."""
    records = model_ranks_bench(path, sizes, max_tokens, prompt_tokens, rounds)
    print_rows(records, as_json, _table_row)
    if not as_json:
        for line in ratios(records):
            print(line, flush=True)
    return 0


def _table_row(rec: dict) -> str:
    """One N's decode tok/s, its rounds and whether its tokens match the unsplit model's; or its error."""
    if "tok_s" in rec:
        return (f"N={rec['ranks']}  {rec['name']:>12}  decode {rec['tok_s']:8.1f} tok/s  rounds "
                f"{rec['tok_s_rounds']}  tokens match the unsplit model: {rec['tokens_match']}")
    return f"N={rec['ranks']}  {rec['name']:>12}  {rec['error']}"
