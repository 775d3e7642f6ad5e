"""Running a split model's ranks as real processes (tests/split_child.py) and reading their results.

Shared by tests/test_model_split.py (dense families) and tests/test_model_split_moe.py.
"""

from __future__ import annotations

import inspect
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pairutil import Procs, free_port

CHILD = Path(__file__).with_name("split_child.py")
PAIR_TIMEOUT_S = 240


def transports() -> list[str]:
    """MLX's ring always; ours when gate_ops can make groups (rdma on the emulated device)."""
    found = ["ring"]
    try:
        from mlx_ds4tp import gate_ops
    except ImportError:
        return found
    found.append("tcp")
    if "rdma_device" in inspect.signature(gate_ops.init).parameters:
        try:
            from mlx_ds4tp import _verbs  # noqa: F401  the emulated UC device lives in the C module
        except ImportError:
            return found
        found.append("rdma")
    return found


def our_meshes() -> bool:
    """Whether our own groups take more than two ranks (init's size=N, the mesh)."""
    try:
        from mlx_ds4tp import gate_ops
    except ImportError:
        return False
    return "size" in inspect.signature(gate_ops.init).parameters


def run_ranks(transport: str, model_dirs: dict[str, Path], out: Path, ranks: int = 2,
              split: str = "even") -> dict[str, list]:
    """All ranks in their own processes, each loading its `split` share; {family: [rank0 npz,
    rank1 npz, ...]}. Never hangs.

    More than 2 ranks over MLX's ring, and over ours where our_meshes()."""
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "DS4_TP_TIMEOUT_SEC": "60"}
    if transport == "ring":
        hostfile = out / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
        env["MLX_HOSTFILE"] = str(hostfile)
    procs = Procs()
    try:
        children = [
            procs.spawn(
                [str(CHILD), "pair", "--rank", str(rank), "--size", str(ranks), "--transport", transport,
                 "--port", str(port), "--split", split, "--out", str(out), *map(str, model_dirs.values())],
                env={**env, "MLX_RANK": str(rank)},
            )
            for rank in range(ranks)
        ]
        for rank, child in enumerate(children):
            try:
                _, err = child.communicate(timeout=PAIR_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} over {transport} did not finish within {PAIR_TIMEOUT_S} s")
            assert child.returncode == 0, f"rank {rank} over {transport} failed:\n{err[-4000:]}"
    finally:
        procs.kill_all()
    return {
        name: [np.load(out / f"rank{rank}-{name}.npz") for rank in range(ranks)] for name in model_dirs
    } | {"gate": [np.load(out / f"rank{rank}-gate.npz") for rank in range(ranks)]}


def unsplit_references(model_dirs: dict[str, Path]) -> dict[str, dict]:
    """The unsplit models' greedy tokens and logits, decoded with mlx-lm's plain loader."""
    import mlx_lm

    import tiny_models

    out = {}
    for name, path in model_dirs.items():
        model, tokenizer = mlx_lm.load(str(path))
        tokens, logits = tiny_models.greedy_decode(model, tokenizer.encode(tiny_models.PROMPT))
        out[name] = {
            "tokens": tokens,
            "logits": logits,
            "streamed": tiny_models.stream_tokens(model, tokenizer),
        }
    return out
