"""One rank of the MLX backend tests (tests/test_backend.py), run as a script:

    backend_child.py ROLE PORT TRANSPORT CASE

CASE: chain (100 chained gates built while the peer sleeps, then evaluated), shard (mlx-lm's
own Model.shard(g) on a dense and an MoE model, logits against the unsplit model), die
(rank 1 exits inside an evaluated graph; rank 0 reports what it saw and that it lives on),
rejoin (the leader joins a second worker on the same group after the first left).
Prints one JSON object on stdout's last line.
"""

from __future__ import annotations

import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

import mlx_ds4tp as tp
from mlx_ds4tp.collectives.group import Group


def join(role: str, port: int, transport: str) -> Group:
    where = {"listen": ("127.0.0.1", port)} if role == "leader" else {"coordinator": ("127.0.0.1", port)}
    kw = {"rdma_device": "ucsim"} if transport == "rdma" else {}
    group = tp.init(role=role, transport=transport, timeout=float(os.environ.get("CHILD_TIMEOUT", 20)),
                    **where, **kw)
    return group


def chain(g: Group) -> dict:
    x = mx.ones((4096,), dtype=mx.float32) * (g.rank() + 1)
    sent_before = g.gates()
    t0 = time.perf_counter()
    for _ in range(100):
        x = mx.distributed.all_sum(x, group=g) * 0.5
    build_sec = time.perf_counter() - t0
    moved = g.gates() - sent_before
    if g.rank() == 1:
        time.sleep(1.0)
    mx.eval(x)
    # The first step makes (1 + 2) / 2 = 1.5 on both ranks, every later one keeps it: exact.
    return {"build_sec": build_sec, "gates_while_building": moved, "value": float(x[0]),
            "gates_after": g.gates() - sent_before}


def _qwen3(seed: int):
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rms_norm_eps=1e-6, vocab_size=256, max_position_embeddings=128,
                           rope_theta=10000.0, tie_word_embeddings=False)
    mx.random.seed(seed)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def _qwen3_moe(seed: int):
    from mlx_lm.models import qwen3_moe

    args = qwen3_moe.ModelArgs(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, rms_norm_eps=1e-6, vocab_size=256, num_experts=4,
                               num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               moe_intermediate_size=32, norm_topk_prob=True,
                               max_position_embeddings=128, rope_theta=10000.0,
                               tie_word_embeddings=False)
    mx.random.seed(seed)
    model = qwen3_moe.Model(args)
    mx.eval(model.parameters())
    return model


def shard(g: Group) -> dict:
    tokens = mx.array([[1, 5, 9, 42, 7, 3, 100, 200]])
    out = {}
    for name, make in (("qwen3", _qwen3), ("qwen3_moe", _qwen3_moe)):
        reference = make(0)(tokens)
        model = make(0)
        model.shard(g)
        logits = model(tokens)
        mx.eval(reference, logits)
        ref = np.array(reference, dtype=np.float64)
        got = np.array(logits, dtype=np.float64)
        out[name] = {
            "max_rel": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))),
        }
        # Identity across ranks: rank 1 sends its logits' bytes through the same group.
        theirs = mx.distributed.all_gather(logits.reshape(1, -1), group=g)
        mx.eval(theirs)
        both = np.array(theirs)
        out[name]["identical_on_both"] = bool(np.array_equal(both[0], both[1]))
    return out


def prefill(g: Group) -> dict:
    """The split demo-sized llama prefilling 37 tokens in chunks of 16 (lockstep.fill_cache):
    the gates evaluated, against what a forward builds."""
    import tempfile
    from pathlib import Path

    from mlx_ds4tp.lockstep.compute import fill_cache, make_cache
    from mlx_ds4tp.model_split import load_split
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    path = save_llama(Path(tempfile.mkdtemp(prefix=f"prefill-{g.rank()}-")), "tiny", seed=4)
    model, _ = load_split(str(path), g)
    layers = len(model.model.layers)
    before = g.gates()
    fill_cache(model, list(range(3, 40)), make_cache(model), step=16)
    return {"layers": layers, "prefill_gates": g.gates() - before}


def die(g: Group) -> dict:
    x = mx.ones((4096,))
    for _ in range(4):
        x = mx.distributed.all_sum(x, group=g) * 0.5
    if g.rank() == 1:
        mx.eval(mx.distributed.all_sum(mx.ones((4096,)), group=g))
        os._exit(3)  # dies with the leader inside its evaluated graph
    t0 = time.perf_counter()
    try:
        mx.eval(mx.distributed.all_sum(mx.ones((4096,)), group=g))
        mx.eval(x)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    elapsed = time.perf_counter() - t0
    try:
        mx.eval(mx.distributed.all_sum(mx.ones((8,)), group=g))
        later = None
    except RuntimeError as exc:
        later = str(exc)
    alive = float(mx.sum(mx.ones(3)).item())  # the process and MLX go on
    return {"error": error, "elapsed": elapsed, "later": later, "alive": alive}


def rejoin(g: Group) -> dict:
    """mlx-lm's qwen3 plan over the group; the first worker leaves after one forward, the
    leader's next forward fails, the leader joins a second worker on the same group and the
    model, sharded over it once, runs on: logits against the unsplit model's."""
    from mlx_ds4tp import gate_ops

    tokens = mx.array([[1, 5, 9, 42, 7, 3]])
    reference = _qwen3(0)(tokens)
    model = _qwen3(0)
    model.shard(g)
    first = model(tokens)
    mx.eval(reference, first)
    ref = np.array(reference, dtype=np.float64)
    out = {"first_rel": float(np.max(np.abs(np.array(first, dtype=np.float64) - ref)) / np.max(np.abs(ref)))}
    if g.rank() == 1:
        if os.environ.get("CHILD_SECOND") != "1":
            os._exit(3)  # the first worker leaves; the second returns its own report
        return out
    try:
        mx.eval(model(tokens))
        out["lost"] = None
    except RuntimeError as exc:
        out["lost"] = str(exc)
    try:
        g.reattach(g.mesh)  # still open: refused
    except Exception as exc:  # noqa: BLE001
        out["bad_reattach"] = f"{type(exc).__name__}: {exc}"
    g.close()
    gate_ops.reconnect(g)  # the settings init made it with: the same address and transport
    again = model(tokens)
    mx.eval(again)
    out["again_rel"] = float(np.max(np.abs(np.array(again, dtype=np.float64) - ref)) / np.max(np.abs(ref)))
    return out


def main() -> None:
    role, port, transport, case = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    g = join(role, port, transport)
    result = {"chain": chain, "shard": shard, "die": die, "prefill": prefill,
              "rejoin": rejoin}[case](g)
    result["rank"] = g.rank()
    result["transport"] = g.transport
    print(json.dumps(result), flush=True)
    g.close()


if __name__ == "__main__":
    main()
