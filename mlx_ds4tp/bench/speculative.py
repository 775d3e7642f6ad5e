"""`ds4tp bench --model M --draft-model D` (or `--prompt-lookup N`): speculative decoding on the
pair against plain pair decode and against mlx-lm's own single-machine speculative decoding.

Contenders, run `rounds` times in rotating order on the same prompt and token count, greedy,
no early stop (so every one must produce the plain pair's tokens):
  tp2-tcp                 plain pair decode
  tp2-tcp-recorded-K      drafts that are the plain run's own tokens: every draft accepted and
                          drafting free, the mechanism's ceiling (one verify forward over K+1 rows,
                          the gates paid once)
  tp2-tcp-draft-K         the draft model (whole, on the leader)
  tp2-tcp-lookup-N-K      prompt lookup
  mlx-lm-single           mlx-lm's stream_generate, one process
  mlx-lm-single-draft-K   the same with mlx-lm's speculative decoding and the draft model
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .model import BENCH_PROMPT, bench_model_dir, rotating_rounds


def _pair(path: str, max_tokens: int, prompt_tokens: int, name: str, extra: List[str]) -> Dict:
    from ..onehost.local_run import LocalRun, run_local_pair

    result = run_local_pair(LocalRun(Path(path), BENCH_PROMPT, max_tokens, stop_at_eos=False,
                                     prompt_tokens=prompt_tokens, extra=extra), quiet=True)
    if result is None:
        raise RuntimeError(f"the {name} pair failed (its errors are above)")
    drafted = result.get("drafted", 0)
    return {"name": name, "tok_s": round(result["decode_tok_s"], 2), "token_ids": result["tokens"],
            "acceptance": round(result["accepted"] / drafted, 3) if drafted else None,
            "rounds_of_gates": result.get("rounds") or len(result["tokens"])}


def _mlx_lm_single(path: str, draft: Optional[str], k: int, max_tokens: int, prompt_tokens: int,
                   name: str) -> Dict:
    from mlx_lm import load, stream_generate

    from ..lockstep.generate import bench_prompt

    model, tokenizer = load(path)
    prompt = bench_prompt(tokenizer, BENCH_PROMPT, prompt_tokens)
    extra = {"draft_model": load(draft)[0], "num_draft_tokens": k} if draft else {}
    tokens, accepted, last = [], 0, None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **extra):
        tokens.append(r.token)
        accepted += bool(getattr(r, "from_draft", False))
        last = r
    return {"name": name, "tok_s": round(last.generation_tps, 2), "token_ids": tokens,
            "acceptance": round(accepted / max(len(tokens) - 1, 1), 3) if draft else None}


def speculative_bench(model: str, draft: Optional[str], prompt_lookup: int, k: int, max_tokens: int,
                      rounds: int, prompt_tokens: int) -> List[Dict]:
    """Every contender's median decode tok/s, acceptance and whether its tokens match."""
    path = bench_model_dir(model)
    draft = bench_model_dir(draft) if draft else None
    plain = _pair(path, max_tokens, prompt_tokens, "tp2-tcp", [])
    recorded = Path(tempfile.mkdtemp()) / "recorded.json"
    recorded.write_text(json.dumps(plain["token_ids"]))
    contenders: Dict[str, Callable[[], Dict]] = {}

    def pair(name: str, flags: List[str]) -> None:
        contenders[name] = lambda: _pair(path, max_tokens, prompt_tokens, name, flags)

    def single(name: str, with_draft: Optional[str]) -> None:
        contenders[name] = lambda: _mlx_lm_single(path, with_draft, k, max_tokens, prompt_tokens, name)

    k_flags = ["--num-draft-tokens", str(k)]
    pair("tp2-tcp", [])
    pair(f"tp2-tcp-recorded-{k}", ["--recorded-draft", str(recorded), *k_flags])
    single("mlx-lm-single", None)
    if draft:
        pair(f"tp2-tcp-draft-{k}", ["--draft-model", draft, *k_flags])
        single(f"mlx-lm-single-draft-{k}", draft)
    if prompt_lookup:
        pair(f"tp2-tcp-lookup-{prompt_lookup}-{k}", ["--prompt-lookup", str(prompt_lookup), *k_flags])
    records = []
    for name, got in rotating_rounds(contenders, rounds).items():
        rec = {"name": name, "tok_s": round(statistics.median(g["tok_s"] for g in got), 2),
               "tok_s_rounds": [g["tok_s"] for g in got], "acceptance": got[0]["acceptance"],
               "tokens_match": all(g["token_ids"] == plain["token_ids"] for g in got)
               if name.startswith("tp2") else None}
        if "rounds_of_gates" in got[0]:
            rec["rounds_of_gates"] = got[0]["rounds_of_gates"]
        records.append(rec)
    return records


def speculative_report(model: str, draft: Optional[str], prompt_lookup: int, k: int, max_tokens: int,
                       rounds: int, prompt_tokens: int, as_json: bool) -> int:
    records = speculative_bench(model, draft, prompt_lookup, k, max_tokens, rounds, prompt_tokens)
    by_name = {r["name"]: r for r in records}
    base, single = by_name["tp2-tcp"]["tok_s"], by_name["mlx-lm-single"]["tok_s"]
    for rec in records:
        if as_json:
            print(json.dumps(rec))
            continue
        ratio = (f"{rec['tok_s'] / base:.2f}x tp2-tcp, {rec['tok_s'] / single:.2f}x mlx-lm-single"
                 if base and single else "")
        acceptance = "" if rec["acceptance"] is None else f"  acceptance {rec['acceptance']:.3f}"
        match = "" if rec["tokens_match"] is None else f"  tokens_match={rec['tokens_match']}"
        print(f"{rec['name']:>26}  decode {rec['tok_s']:8.1f} tok/s (rounds "
              f"{' '.join(f'{v:.1f}' for v in rec['tok_s_rounds'])})  {ratio}{acceptance}{match}")
    return 0

