"""One rank of a split-model test, or one side of the memory measurement (run as a script).

    split_child.py pair --rank R [--size N] [--split S] --transport ring|tcp|rdma --port P --out DIR MODEL_DIR...
        join the pair (N ranks over the ring), load_split every model (share S, default even), decode
        greedily, write DIR/rank{R}-{name}.npz (with the bytes of weights the rank holds),
        then pass a partial through AllSumGate and write DIR/rank{R}-gate.npz
    split_child.py rss --mode whole|split [--rank R] [--size N] [--split S] MODEL_DIR
        load the model (whole with mlx_lm.load, or rank R's part with load_split) and print
        {"baseline_kb": ..., "peak_kb": ...} (peak RSS after the imports, and at the end)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_ds4tp.model_split import AllSumGate, load_split  # noqa: E402
from tiny_models import PROMPT, RankOnly, greedy_decode, stream_tokens  # noqa: E402


def make_group(transport: str, rank: int, port: int, size: int = 2):
    if transport == "ring":
        # MLX_RANK and MLX_HOSTFILE come from the parent.
        return mx.distributed.init(backend="ring", strict=True)
    from mlx_ds4tp import gate_ops

    extra = {"rdma_device": "ucsim"} if transport == "rdma" else {}
    if size != 2:
        # A mesh of our own (init's size=N): each worker asks for its rank.
        extra["size"] = size
        if rank:
            extra["rank"] = rank
    if rank == 0:
        return gate_ops.init(role="leader", listen=("127.0.0.1", port), transport=transport, **extra)
    return gate_ops.init(role="worker", coordinator=("127.0.0.1", port), transport=transport, **extra)


def run_pair(args) -> None:
    group = make_group(args.transport, args.rank, args.port, args.size)
    if group.rank() != args.rank or group.size() != args.size:
        raise SystemExit(f"group says rank {group.rank()} of {group.size()}, expected {args.rank} of {args.size}")
    out = Path(args.out)
    for model_dir in map(Path, args.models):
        model, tokenizer = load_split(model_dir, group, split=args.split)
        weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        tokens, logits = greedy_decode(model, tokenizer.encode(PROMPT))
        streamed = stream_tokens(model, tokenizer)
        np.savez(out / f"rank{args.rank}-{model_dir.name}.npz", tokens=np.array(tokens),
                 logits=logits, streamed=np.array(streamed), weight_bytes=weight_bytes)
    # The gate as user code would use it: each rank's partial in, the total out.
    partial = mx.arange(6, dtype=mx.float32).reshape(2, 3) * (args.rank + 1) + 0.25 * args.rank
    total = AllSumGate(group)(partial)
    np.savez(out / f"rank{args.rank}-gate.npz", partial=np.array(partial), out=np.array(total))
    if args.transport == "ring":
        # MLX's ring group has no close; its receive threads report every socket torn down at
        # interpreter exit as an error. Meet at a last gate, then leave without the teardown.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    group.close()


def peak_rss_kb() -> int:
    """This process's peak resident memory so far, in KiB."""
    # Linux keeps ru_maxrss across fork and exec: a child of a big pytest process would report
    # its parent's peak. VmHWM belongs to this process's own address space.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # macOS counts bytes


def run_rss(args) -> None:
    import mlx_lm  # noqa: F401  everything both modes import, before the baseline
    from transformers import PreTrainedTokenizerFast  # noqa: F401

    baseline = peak_rss_kb()
    if args.mode == "whole":
        model, _ = mlx_lm.load(args.model)
    else:
        # loading never calls a collective
        model, _ = load_split(args.model, RankOnly(args.rank, args.size), split=args.split)
    print(json.dumps({"baseline_kb": baseline, "peak_kb": peak_rss_kb()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    pair = sub.add_parser("pair")
    pair.add_argument("--rank", type=int, required=True)
    pair.add_argument("--transport", required=True)
    pair.add_argument("--size", type=int, default=2)
    pair.add_argument("--port", type=int, default=0)
    pair.add_argument("--split", default="even")
    pair.add_argument("--out", required=True)
    pair.add_argument("models", nargs="+")
    rss = sub.add_parser("rss")
    rss.add_argument("--mode", choices=("whole", "split"), required=True)
    rss.add_argument("--rank", type=int, default=0)
    rss.add_argument("--size", type=int, default=2)
    rss.add_argument("--split", default="even")
    rss.add_argument("model")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run_pair(args) if args.cmd == "pair" else run_rss(args)


if __name__ == "__main__":
    main()
