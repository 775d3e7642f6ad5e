"""Model decode throughput: one process, our pair, mlx-lm over MLX's ring.

Any model load_split splits (dense or mixture of experts); `--model` also takes a tiny_model
preset name ("moe-1g": a 1 GB float32 qwen3_moe), built once into the cache.

Every contender decodes the same prompt greedily for the same count of
tokens (no early stop at EOS), so the tok/s figures compare like for like
and the tokens must equal the single process's.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from . import _localpair
from . import gate_ops
from ._log import log

BENCH_PROMPT = "The quick brown fox jumps over the lazy dog because"
CEILING = "tp2-compute-ceiling"


def _tok_record(name: str, tokens: List[int], seconds: float, reference: Optional[List[int]]) -> Dict:
    return {"name": name, "tok_s": round((len(tokens) - 1) / seconds, 2) if seconds else 0.0,
            "tokens_match": reference is None or tokens == reference, "tokens": len(tokens)}


def single_record(path: str, max_tokens: int) -> Dict:
    """The unsplit model in this process: the reference tokens and the baseline tok/s."""
    from mlx_lm.utils import load

    from .lockstep import greedy_generate

    model, tokenizer = load(path)
    prompt = list(tokenizer.encode(BENCH_PROMPT))
    greedy_generate(model, prompt, 4)  # warm the kernels
    tokens, seconds = greedy_generate(model, prompt, max_tokens)
    rec = _tok_record("single", tokens, seconds, None)
    rec["token_ids"] = tokens
    return rec


def ring_model_rank(path: str, max_tokens: int) -> List[Dict]:
    """One rank of mlx-lm's own model.shard() over MLX's ring backend (rank 0 returns the record)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from .lockstep import greedy_generate

    group = mx.distributed.init(backend="ring", strict=True)
    model, tokenizer = load(path, lazy=True)
    model.shard(group)
    mx.eval(model.parameters())
    prompt = list(tokenizer.encode(BENCH_PROMPT))
    greedy_generate(model, prompt, 4)
    tokens, seconds = greedy_generate(model, prompt, max_tokens)
    rec = _tok_record("mlx-lm-ring", tokens, seconds, None)
    rec["token_ids"] = tokens
    return [rec] if group.rank() == 0 else []


def spawn_ring_model(path: str, max_tokens: int, timeout: float = 1200.0) -> Dict:
    """Both ranks of the mlx-lm ring contender on 127.0.0.1."""
    cmd = _localpair.rank_command("ring-model", "--model", path, "--max-tokens", str(max_tokens))
    with _localpair.ring_hostfile() as hostfile:
        outs = _localpair.run_ranks([cmd, cmd], _localpair.ring_envs(hostfile), timeout=timeout)
    return _localpair.json_records(outs[0])[0]


class GatelessGroup:
    """A two-rank group whose gates do nothing: all_sum hands the local partial back.

    For the compute ceiling only. Each rank still runs exactly its half of every matmul, so
    two of these side by side decode as fast as the pair could with a transport that takes zero
    time and ranks that never wait for each other. A real pair meets at every gate, so it also
    waits there whenever the other rank's half of a layer ran a little slower. Its tokens are
    meaningless (the halves are never summed).
    """

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2

    def all_sum(self, x):
        return x

    def all_gather(self, x):
        import mlx.core as mx

        return mx.concatenate([x, x], axis=0)


def ceiling_rank(role: str, port: int, path: str, max_tokens: int) -> List[Dict]:
    """One rank of the compute ceiling: its half of the model decoding with gateless gates,
    started together with the other rank so the two compete for the cores as a real pair does.
    A TCP pair is used only as the start line and to agree on the slower rank's time."""
    from .lockstep import greedy_generate
    from .model_split import load_split
    from .pair_run import model_identity

    where = {"listen": ("127.0.0.1", port)} if role == "leader" else {"coordinator": ("127.0.0.1", port)}
    with gate_ops.init(role=role, transport="tcp", identity=model_identity(path), **where) as group:
        model, tokenizer = load_split(path, GatelessGroup(group.rank()))
        prompt = list(tokenizer.encode(BENCH_PROMPT))
        greedy_generate(model, prompt, 4)
        start_line = np.zeros(1, np.float64)
        group.pair.gate(start_line, np.empty_like(start_line))
        tokens, seconds = greedy_generate(model, prompt, max_tokens)
        mine, theirs = np.array([seconds]), np.empty(1)
        group.pair.gate(mine, theirs)
    rec = _tok_record(CEILING, tokens, max(seconds, float(theirs[0])), None)
    rec["tokens_match"] = None  # the halves are never summed: no tokens to compare
    rec["gates"] = "skipped: the pair's compute alone, ranks never waiting for each other"
    return [rec] if role == "leader" else []


def spawn_ceiling(path: str, max_tokens: int, timeout: float = 1200.0) -> Dict:
    """Both ranks of the compute ceiling on 127.0.0.1."""
    base = _localpair.rank_command("ceiling", "--model", path, "--max-tokens", str(max_tokens))
    outs = _localpair.run_ranks(_localpair.pair_commands(base, _localpair.free_port()), timeout=timeout)
    return _localpair.json_records(outs[0])[0]


def spawn_tp2(path: str, transport: str, rdma_device: Optional[str], max_tokens: int,
              timeout: float = 1200.0) -> Dict:
    """Our pair (the ranks of `ds4tp run`), both on 127.0.0.1."""
    from .pair_run import run_local_pair

    result = run_local_pair(Path(path), BENCH_PROMPT, max_tokens, transport, rdma_device,
                            stop_at_eos=False, quiet=True, timeout=timeout)
    if result is None:
        raise RuntimeError(f"the tp2-{transport} pair failed (its errors are above)")
    name = "tp2-tcp" if transport == "tcp" else f"tp2-rdma-{rdma_device or 'ibverbs'}"
    return {"name": name, "tok_s": round(result["decode_tok_s"], 2), "tokens": len(result["tokens"]),
            "token_ids": result["tokens"], "gate_p50_us": round(result["gate_p50_us"], 1)}


def bench_model_dir(model: str) -> str:
    """`model` itself when it is a directory; a tiny_model preset name ("150m", "moe-1g", ...)
    is written once with fixed random weights into the cache and that directory returned."""
    import os

    from . import tiny_model

    if Path(model).is_dir() or model not in {**tiny_model.PRESETS, **tiny_model.MOE_PRESETS}:
        return model
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_ds4tp"
    path = root / f"bench-{model}-seed0"
    if not (path / "tokenizer_config.json").is_file():  # written last: a finished model
        log(f"building the {model} bench model (synthetic random weights) in {path}")
        save = tiny_model.save_qwen3_moe if model in tiny_model.MOE_PRESETS else tiny_model.save_llama
        save(path, model, seed=0)
    return str(path)


def mlx_lm_can_shard(path: str) -> bool:
    """Whether mlx-lm's own module for this model has shard() (mixtral's has none)."""
    from mlx_lm.utils import _get_classes, load_config

    model_class, _ = _get_classes(load_config(Path(path)))
    return callable(getattr(model_class, "shard", None))


def _model_contenders(path: str, transport: str, rdma_device: Optional[str],
                      max_tokens: int) -> Dict[str, Callable[[], Dict]]:
    contenders: Dict[str, Callable[[], Dict]] = {"single": lambda: single_record(path, max_tokens)}
    if transport in ("tcp", "all"):
        contenders["tp2-tcp"] = lambda: spawn_tp2(path, "tcp", None, max_tokens)
    if transport in ("rdma", "all"):
        device = rdma_device or "ucsim"
        contenders[f"tp2-rdma-{device}"] = lambda: spawn_tp2(path, "rdma", device, max_tokens)
    if mlx_lm_can_shard(path):
        contenders["mlx-lm-ring"] = lambda: spawn_ring_model(path, max_tokens)
    else:
        log(f"mlx-lm-ring left out: mlx-lm's module for {path} has no shard()")
    # Not a contender (its tokens are meaningless): the bound every tp2 figure sits under.
    contenders[CEILING] = lambda: spawn_ceiling(path, max_tokens)
    return contenders


def model_bench(path: str, transport: str, rdma_device: Optional[str], max_tokens: int,
                rounds: int = 3) -> List[Dict]:
    """Decode tok/s of every contender, run `rounds` times in rotating order so a slow spell
    of the machine falls on all of them alike; each record gives the median and every round."""
    path = bench_model_dir(path)
    contenders = _model_contenders(path, transport, rdma_device, max_tokens)
    names = list(contenders)
    runs: Dict[str, List[Dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(contenders[name]())
    reference = runs["single"][0]["token_ids"]
    records = []
    for name in names:
        got = runs[name]
        rec = dict(got[0])
        rec["tok_s_rounds"] = [g["tok_s"] for g in got]
        rec["tok_s"] = round(statistics.median(rec["tok_s_rounds"]), 2)
        if "gate_p50_us" in rec:
            rec["gate_p50_us"] = round(statistics.median(g["gate_p50_us"] for g in got), 1)
        if name != CEILING:
            rec["tokens_match"] = all(g["token_ids"] == reference for g in got)
        rec.pop("token_ids", None)
        records.append(rec)
    return records
