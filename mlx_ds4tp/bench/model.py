"""Model throughput, prompt processing and decode: one process, our pair, mlx-lm over MLX's ring.

Any model load_split splits (dense or mixture of experts); `--model` also takes a tiny_model
preset name ("moe-1g": a 1 GB float32 qwen3_moe), built once into the cache.

Every contender processes the same prompt of `prompt_tokens` tokens (bench_prompt) and decodes
greedily for the same count of tokens (no early stop at EOS), so the tok/s figures compare like
for like and the tokens must equal the single process's. A record's `prefill_tok_s` is the
prompt's tokens over the time to the first generated token's logits (mlx-lm's prompt_tps),
`tok_s` the decode rate after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import gate_ops
from ..base.log import log
from ..collectives.backend import gateless_group
from ..link.config import MLX, LinkSettings, PairAddress
from ..onehost import localpair as _localpair

BENCH_PROMPT = "The quick brown fox jumps over the lazy dog because"
DEFAULT_PROMPT_TOKENS = 512
CEILING = "tp2-compute-ceiling"


def _rate(count: int, seconds: float) -> float:
    return round(count / seconds, 2) if seconds else 0.0


def _tok_record(name: str, stats, prompt_sec: Optional[float] = None,
                decode_sec: Optional[float] = None) -> Dict:
    """A contender's record from its GenerationStats (times overridable: the slower rank's)."""
    prompt_sec = stats.prompt_sec if prompt_sec is None else prompt_sec
    decode_sec = stats.decode_sec if decode_sec is None else decode_sec
    return {"name": name, "tok_s": _rate(len(stats.tokens) - 1, decode_sec), "tokens_match": True,
            "tokens": len(stats.tokens), "prefill_tok_s": _rate(stats.prompt_tokens, prompt_sec),
            "prompt_tokens": stats.prompt_tokens, "token_ids": stats.tokens}


# Every contender warms up on the prompt's first tokens (kernels, the allocator's buffers)
# before its timed generation; the whole prompt twice would double a slow machine's bench.
WARMUP_PROMPT_TOKENS = 16


def _generate(model, tokenizer, prompt_tokens: int, max_tokens: int):
    """Warm up, then the timed generation of the bench prompt."""
    from ..lockstep.generate import bench_prompt, greedy_generate

    prompt = bench_prompt(tokenizer, BENCH_PROMPT, prompt_tokens)
    greedy_generate(model, prompt[:WARMUP_PROMPT_TOKENS], 4)
    return prompt, greedy_generate(model, prompt, max_tokens)


def single_record(path: str, max_tokens: int, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> Dict:
    """The unsplit model in this process: the reference tokens and the baseline rates."""
    from mlx_lm.utils import load

    model, tokenizer = load(path)
    _, stats = _generate(model, tokenizer, prompt_tokens, max_tokens)
    return _tok_record("single", stats)


def shard_model_rank(path: str, max_tokens: int, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                     link: Optional[LinkSettings] = None) -> List[Dict]:
    """One rank of mlx-lm's own plan (model.shard(group)) and mlx-lm's loading, generating
    with the same loop as every contender: over MLX's ring backend (link None, ranks from
    MLX_HOSTFILE / MLX_RANK) or over our pair (the rank's link): one plan, one loop, only the
    backend differs. Rank 0 returns the record."""
    import mlx.core as mx
    from mlx_lm.utils import load

    if link is None:
        # The ring pinned, not MLX's first available backend: the hostfile spawn_shard_model
        # writes is a ring's, and the record is named for it.
        group, name = mx.distributed.init(backend="ring", strict=True), "mlx-lm-ring"
    else:
        group = gate_ops.init_pair(link)
        device = link.rdma_device or "ibverbs"
        name = "mlx-lm-tcp" if group.transport == "tcp" else f"mlx-lm-rdma-{device}"
    try:
        model, tokenizer = load(path, lazy=True)
        model.shard(group)
        mx.eval(model.parameters())
        _, stats = _generate(model, tokenizer, prompt_tokens, max_tokens)
    finally:
        if link is not None:
            group.close()
    return [_tok_record(name, stats)] if group.rank() == 0 else []


def spawn_shard_model(path: str, max_tokens: int, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                      transport: str = MLX, rdma_device: Optional[str] = None,
                      timeout: float = 1200.0) -> Dict:
    """Both ranks of an mlx-lm shard() contender on 127.0.0.1 (see shard_model_rank)."""
    base = _localpair.rank_command("shard-model", "--model", path, "--max-tokens", str(max_tokens),
                                   "--prompt-tokens", str(prompt_tokens), "--transport", transport)
    if rdma_device:
        base += ["--rdma-device", rdma_device]
    if transport == MLX:
        return _localpair.ring_records(base, timeout)[0]
    return _localpair.pair_records(base, timeout)[0]


def ceiling_rank(address: PairAddress, path: str, max_tokens: int,
                 prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> List[Dict]:
    """One rank of the compute ceiling: its half of the model prefilling and decoding with
    gateless gates, started together with the other rank so the two compete for the cores as a
    real pair does. A TCP pair is used only as the start line and to agree on the slower rank's
    times (prefill and decode each)."""
    import mlx.core as mx

    from ..link.identity import model_identity
    from ..lockstep.generate import bench_prompt, greedy_generate
    from ..model_split import load_split

    with gate_ops.init(role=address.role, listen=address.listen, coordinator=address.coordinator,
                       transport="tcp", identity=model_identity(path)) as group:
        model, tokenizer = load_split(path, gateless_group(group.rank()))
        prompt = bench_prompt(tokenizer, BENCH_PROMPT, prompt_tokens)
        greedy_generate(model, prompt[:WARMUP_PROMPT_TOKENS], 4)
        mx.eval(gate_ops.all_sum(mx.zeros(1), group=group))  # the start line
        stats = greedy_generate(model, prompt, max_tokens)
        slower = gate_ops.all_max(mx.array([stats.prompt_sec, stats.decode_sec]), group=group).tolist()
    rec = _tok_record(CEILING, stats, slower[0], slower[1])
    rec["tokens_match"] = None  # the halves are never summed: no tokens to compare
    rec["gates"] = "skipped: the pair's compute alone, ranks never waiting for each other"
    return [rec] if address.role == "leader" else []


def spawn_ceiling(path: str, max_tokens: int, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                  timeout: float = 1200.0) -> Dict:
    """Both ranks of the compute ceiling on 127.0.0.1."""
    base = _localpair.rank_command("ceiling", "--model", path, "--max-tokens", str(max_tokens),
                                   "--prompt-tokens", str(prompt_tokens))
    return _localpair.pair_records(base, timeout)[0]


@dataclass(frozen=True)
class ModelBench:
    """`ds4tp bench --model`'s settings. split other than "even": our tcp pair runs split so
    too, beside the even one. slow_worker: our tcp pairs run with the worker on a core shared
    with a busy process and the leader alone on another (two different Macs' stand-in)."""

    path: str
    transport: str = "all"
    rdma_device: Optional[str] = None
    max_tokens: int = 64
    rounds: int = 3
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    split: str = "even"
    slow_worker: bool = False


def spawn_tp2(bench: ModelBench, transport: str, rdma_device: Optional[str] = None, split: str = "even",
              timeout: float = 1200.0) -> Dict:
    """Our pair (the ranks of `ds4tp run`), both on 127.0.0.1, split by `split` (--split); the
    record names the share used and each rank's peak resident memory."""
    from ..onehost.local_run import LocalRun, run_local_pair

    slow = bench.slow_worker and transport == "tcp"
    with _localpair.busy_core(1) if slow else contextlib.nullcontext():
        run = LocalRun(Path(bench.path), BENCH_PROMPT, bench.max_tokens, transport, rdma_device,
                       stop_at_eos=False, prompt_tokens=bench.prompt_tokens, extra=("--split", split))
        result = run_local_pair(run, quiet=True, timeout=timeout,
                                placement=_localpair.SLOW_WORKER if slow else _localpair.ANYWHERE)
    if result is None:
        raise RuntimeError(f"the tp2-{transport} pair failed (its errors are above)")
    name = "tp2-tcp" if transport == "tcp" else f"tp2-rdma-{rdma_device or 'ibverbs'}"
    if split != "even":
        name += f"-split-{split}"
    return {"name": name, "tok_s": round(result["decode_tok_s"], 2), "tokens": len(result["tokens"]),
            "split": result["split"], "rank0_peak_rss_mib": round(result["peak_rss_bytes"] / 2**20, 1),
            "rank1_peak_rss_mib": round(result["worker_peak_rss_bytes"] / 2**20, 1),
            "token_ids": result["tokens"], "gate_p50_us": round(result["gate_p50_us"], 1),
            "exchange_ms_per_token": round(result["exchange_ms_per_token"], 2),
            "prefill_tok_s": round(result["prompt_tok_s"], 2), "prompt_tokens": len(result["prompt_tokens"])}


def bench_model_dir(model: str) -> str:
    """`model` itself when it is a directory; a tiny_model preset name ("150m", "moe-1g", ...)
    is written once with fixed random weights into the cache and that directory returned."""
    from ..synthetic import tiny_model
    from ..synthetic.demo_model import cached_model

    if Path(model).is_dir() or model not in {**tiny_model.PRESETS, **tiny_model.MOE_PRESETS}:
        return model
    save = tiny_model.save_qwen3_moe if model in tiny_model.MOE_PRESETS else tiny_model.save_llama
    return str(cached_model(f"bench-{model}-seed0", f"the {model} bench model",
                            lambda path: save(path, model, seed=0)))


def mlx_lm_can_shard(path: str) -> bool:
    """Whether mlx-lm's own module for this model has shard() (mixtral's has none)."""
    from mlx_lm.utils import _get_classes, load_config

    model_class, _ = _get_classes(load_config(Path(path)))
    return callable(getattr(model_class, "shard", None))


def _model_contenders(bench: ModelBench) -> Dict[str, Callable[[], Dict]]:
    path, transport, rdma_device = bench.path, bench.transport, bench.rdma_device
    max_tokens, n, split = bench.max_tokens, bench.prompt_tokens, bench.split
    device = rdma_device or "ucsim"
    contenders: Dict[str, Callable[[], Dict]] = {"single": lambda: single_record(path, max_tokens, n)}
    if transport in ("tcp", "all"):
        contenders["tp2-tcp"] = lambda: spawn_tp2(bench, "tcp")
        if split != "even":  # the chosen share beside the even split, in the same rounds
            contenders[f"tp2-tcp-split-{split}"] = lambda: spawn_tp2(bench, "tcp", split=split)
    if bench.slow_worker:
        # Only our tcp pairs are placed so: the other contenders would be slowed unevenly.
        return contenders
    if transport in ("rdma", "all"):
        contenders[f"tp2-rdma-{device}"] = lambda: spawn_tp2(bench, "rdma", device)
    if mlx_lm_can_shard(path):
        # mlx-lm's own plan and loading, over MLX's ring and over our pair.
        contenders["mlx-lm-ring"] = lambda: spawn_shard_model(path, max_tokens, n)
        if transport in ("tcp", "all"):
            contenders["mlx-lm-tcp"] = lambda: spawn_shard_model(path, max_tokens, n, "tcp")
        if transport in ("rdma", "all"):
            contenders[f"mlx-lm-rdma-{device}"] = lambda: spawn_shard_model(
                path, max_tokens, n, "rdma", device)
    else:
        log(f"mlx-lm's contenders left out: mlx-lm's module for {path} has no shard()")
    # Not a contender (its tokens are meaningless): the bound every tp2 figure sits under.
    contenders[CEILING] = lambda: spawn_ceiling(path, max_tokens, n)
    return contenders


def rotating_rounds(contenders: Dict[str, Callable[[], Dict]], rounds: int) -> Dict[str, List[Dict]]:
    """Every contender's record of each round, the rounds in rotating order so a slow spell of
    the machine falls on all of them alike."""
    names = list(contenders)
    runs: Dict[str, List[Dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(contenders[name]())
    return runs


def model_bench(bench: ModelBench) -> List[Dict]:
    """Prompt and decode tok/s of every contender, run `bench.rounds` times (rotating_rounds);
    each record gives the medians and every round."""
    if bench.prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={bench.prompt_tokens} must be >= 1")
    bench = dataclasses.replace(bench, path=bench_model_dir(bench.path))
    runs = rotating_rounds(_model_contenders(bench), bench.rounds)
    reference = runs["single"][0]["token_ids"]
    records = []
    for name, got in runs.items():
        rec = dict(got[0])
        for key in ("tok_s", "prefill_tok_s", "exchange_ms_per_token"):
            if key in rec:
                rec[f"{key}_rounds"] = [g[key] for g in got]
                rec[key] = round(statistics.median(rec[f"{key}_rounds"]), 2)
        if "gate_p50_us" in rec:
            rec["gate_p50_us"] = round(statistics.median(g["gate_p50_us"] for g in got), 1)
        if "split" in rec:  # auto measures afresh each round and may pick another share
            rec["split_rounds"] = [g["split"] for g in got]
        if name != CEILING:
            rec["tokens_match"] = all(g["token_ids"] == reference for g in got)
        rec.pop("token_ids", None)
        records.append(rec)
    return records
