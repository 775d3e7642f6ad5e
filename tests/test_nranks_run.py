"""`ds4tp run --ranks N` and `ds4tp demo --ranks N`: three and four ranks as processes on
127.0.0.1 (a mesh, docs/nranks.md), over tcp and ucsim, give the unsplit single-process
model's greedy text and tokens; every worker agrees with the leader on every sampled token and,
every few steps, on the logits (HASH asked of each worker: --debug-hash). Children are killed
when a test ends (the procs fixture)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pairutil import free_port, reference_text

TRANSPORTS = {"tcp": ["--transport", "tcp"], "ucsim": ["--transport", "rdma", "--rdma-device", "ucsim"]}
PROMPT = "Three machines, one model"
TOKENS = 16
RUN_TIMEOUT = 240

# 8 KV heads (and 256 MLP and expert columns, 8 groups of 32): 3:3:2 at N = 3 even.
_EIGHT = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
          "intermediate_size": 256, "vocab_size": 500, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 2048, "tie_word_embeddings": False}
MOE = {
    "qwen3_moe": {**_EIGHT, "model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                  "moe_intermediate_size": 256, "norm_topk_prob": True},
    "deepseek_v3": {**_EIGHT, "model_type": "deepseek_v3", "num_hidden_layers": 3, "moe_intermediate_size": 256,
                    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
                    "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 16,
                    "qk_nope_head_dim": 16, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama, save_random_model

    root = tmp_path_factory.mktemp("nranks-run")
    dirs = {"llama": save_llama(root / "llama", "tiny8", seed=3)}
    for name, config in MOE.items():
        dirs[name] = save_random_model(root / name, config)
    return dirs


def spawn_ranks(procs, model_dir, ranks: int, transport: str, extra=(), tokens_out=None,
                worker_extra=()):
    """The leader and its ranks-1 workers of one `ds4tp run --ranks N`: (leader, [workers]). Only
    the leader is given --ranks: the workers learn N from it (`worker_extra`: their own flags)."""
    port = free_port()
    # The spawned rank's entry point: `ds4tp run` plus --tokens-out (onehost.local_run's too).
    common = ["-m", "mlx_ds4tp.cli.rank", "run", "--model", str(model_dir), "--max-tokens", str(TOKENS),
              "--no-chat-template", "--debug-hash", "4", *TRANSPORTS[transport], *extra]
    out = ["--tokens-out", str(tokens_out)] if tokens_out else []
    leader = procs.spawn(common + ["--ranks", str(ranks), "--prompt", PROMPT, "--role", "leader", "--listen",
                                   "127.0.0.1", str(port), *out])
    workers = [procs.spawn(common + ["--role", "worker", "--coordinator", "127.0.0.1", str(port), *worker_extra])
               for _ in range(ranks - 1)]
    return leader, workers


def _run_and_check(procs, model_dir, ranks, transport, tmp_path, extra=(), worker_extra=()) -> dict:
    tokens_out = tmp_path / "tokens.json"
    leader, workers = spawn_ranks(procs, model_dir, ranks, transport, extra, tokens_out, worker_extra)
    lout, lerr = leader.communicate(timeout=RUN_TIMEOUT)
    assert leader.returncode == 0, lerr
    for worker in workers:
        _, werr = worker.communicate(timeout=60)
        assert worker.returncode == 0, werr
        assert "leader said stop" in werr, werr
    text, tokens = reference_text(model_dir, PROMPT, TOKENS)
    record = json.loads(tokens_out.read_text())
    assert record["tokens"] == tokens
    assert lout.rsplit("\n", 2)[0] == text
    assert f"rank 0/{ranks} holds its part" in lerr, lerr
    return record


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("ranks", [3, 4])
def test_llama_on_n_ranks_gives_the_unsplit_tokens(procs, models, tmp_path, ranks, transport):
    record = _run_and_check(procs, models["llama"], ranks, transport, tmp_path)
    assert record["transport"] == ("tcp" if transport == "tcp" else "rdma")


def test_workers_given_ranks_explicitly_join_as_before(procs, models, tmp_path):
    """Workers may still be given --ranks N (the leader's): they JOIN at once, no size learned."""
    _run_and_check(procs, models["llama"], 3, "tcp", tmp_path, worker_extra=["--ranks", "3"])


@pytest.mark.parametrize("ranks, says", [
    ("4", "the group has 3 ranks and this rank was started for 4; give every rank --ranks 3"),
    ("2", "the group has 3 ranks and this rank was started for 2; give every rank --ranks 3"),
])
def test_a_worker_given_other_ranks_than_the_leader_stops_naming_both(procs, models, ranks, says):
    """A worker whose --ranks is not the leader's stops with both sizes named, at its join (no
    hang, no weight read); the leader keeps waiting for its workers."""
    port = free_port()
    common = ["-m", "mlx_ds4tp.cli.rank", "run", "--model", str(models["llama"]), "--no-chat-template",
              "--transport", "tcp"]
    leader = procs.spawn(common + ["--ranks", "3", "--prompt", PROMPT, "--role", "leader", "--listen",
                                   "127.0.0.1", str(port)])
    worker = procs.spawn(common + ["--ranks", ranks, "--role", "worker", "--coordinator", "127.0.0.1", str(port)],
                         env={"DS4_TP_TIMEOUT_SEC": "600"})
    _, err = worker.communicate(timeout=60)  # well inside its own 600 s timeout: refused, not timed out
    assert worker.returncode not in (0, None) and says in err, err
    assert "weights loaded" not in err, err
    assert leader.poll() is None  # still gathering


@pytest.mark.parametrize("split", ["2:1:1", "auto"])
def test_an_uneven_share_on_three_ranks(procs, models, tmp_path, split):
    """A share given, or the leader's from every rank's measured figures (auto): the workers
    load the leader's share, each its own part."""
    record = _run_and_check(procs, models["llama"], 3, "tcp", tmp_path, extra=["--split", split])
    assert record["split"] == split if split != "auto" else len(record["split"].split(":")) in (1, 3)


def test_speculation_on_three_ranks_keeps_the_unsplit_tokens(procs, models, tmp_path):
    """Prompt-lookup drafts verified by all three ranks in one forward a round: the same tokens."""
    _run_and_check(procs, models["llama"], 3, "tcp", tmp_path, extra=["--prompt-lookup", "2"])


@pytest.mark.parametrize("family, transport", [("qwen3_moe", "tcp"), ("deepseek_v3", "ucsim")])
def test_moe_on_three_ranks_gives_the_unsplit_tokens(procs, models, tmp_path, family, transport):
    _run_and_check(procs, models[family], 3, transport, tmp_path)


@pytest.mark.parametrize("victim", [1, 2])
def test_a_worker_killed_mid_generation_stops_the_others(procs, models, victim):
    port = free_port()
    common = ["-m", "mlx_ds4tp.cli.rank", "run", "--model", str(models["llama"]), "--max-tokens", "100000",
              "--no-eos", "--no-chat-template", "--ranks", "3", "--transport", "tcp"]
    leader = procs.spawn(common + ["--prompt", "a long story", "--role", "leader", "--listen", "127.0.0.1",
                                   str(port)])
    workers = [procs.spawn(common + ["--role", "worker", "--coordinator", "127.0.0.1", str(port)])
               for _ in range(2)]
    os.set_blocking(leader.stdout.fileno(), False)
    deadline = time.monotonic() + 120
    while not leader.stdout.read(1):
        assert leader.poll() is None, leader.stderr.read()
        assert time.monotonic() < deadline, "the leader never started streaming"
        time.sleep(0.05)
    time.sleep(0.5)
    dead = workers[victim - 1]
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=10)
    for survivor in [leader] + [w for w in workers if w is not dead]:
        survivor.wait(timeout=20)  # a hang fails here
        err = survivor.stderr.read()
        assert survivor.returncode not in (0, None), err
        assert "ds4-tp: error:" in err, err


def test_demo_on_three_ranks_matches_the_unsplit_model(procs):
    demo = procs.spawn(["-m", "mlx_ds4tp", "demo", "--ranks", "3", "--transport", "tcp", "--max-tokens", "8"])
    out, err = demo.communicate(timeout=RUN_TIMEOUT)
    assert demo.returncode == 0, out + err
    assert "tokens (3 ranks):" in out and "match with the unsplit model in one process: True" in out, out


@pytest.mark.parametrize("flags, message", [
    (["--ranks", "9", "--listen", "127.0.0.1", "9"], "--ranks 9: give the number of machines, 2 to 8"),
    (["--ranks", "1", "--listen", "127.0.0.1", "9"], "--ranks 1: give the number of machines, 2 to 8"),
])
def test_bad_ranks_are_refused_naming_the_value(procs, models, flags, message):
    run = procs.spawn(["-m", "mlx_ds4tp", "run", "--model", str(models["llama"]), "--prompt", "x",
                       "--role", "leader", *flags])
    _, err = run.communicate(timeout=60)
    assert run.returncode not in (0, None) and message in err, err


def test_bench_model_over_n_ranks_beside_the_ring(procs):
    """`ds4tp bench --model M --ranks 2,3`: ours at each N with the unsplit tokens; mlx-lm's ring
    at N = 2, and at N = 3 its shard() cannot cut the tiny llama's 128 columns in three: said."""
    bench = procs.spawn(["-m", "mlx_ds4tp", "bench", "--model", "tiny8", "--ranks", "2,3", "--max-tokens", "4",
                         "--prompt-tokens", "8", "--rounds", "1", "--json"])
    out, err = bench.communicate(timeout=RUN_TIMEOUT)
    assert bench.returncode == 0, err
    records = {(r["name"], r["ranks"]): r for r in map(json.loads, out.strip().splitlines())}
    for n in (2, 3):
        assert records[("ours-tcp", n)]["tokens_match"] is True and records[("ours-tcp", n)]["tok_s"] > 0
    assert records[("mlx-lm-ring", 2)]["tokens_match"] is True
    assert "failed" in records[("mlx-lm-ring", 3)]["error"], records
