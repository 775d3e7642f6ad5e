"""The examples run as a user runs them: both ranks on 127.0.0.1, and what they print is right."""

from __future__ import annotations

import os

import pytest

from pairutil import REPO, free_port, reference_text

EXAMPLES = os.path.join(REPO, "examples")


def spawn_ranks(procs, script, args, leader_args=()):
    port = str(free_port())
    path = os.path.join(EXAMPLES, script)
    leader = procs.spawn([path, *args, *leader_args, "--role", "leader", "--listen", "127.0.0.1", port])
    worker = procs.spawn([path, *args, "--role", "worker", "--coordinator", "127.0.0.1", port])
    return leader, worker


def test_pair_generate_prints_the_unsplit_models_text(procs, tmp_path):
    from mlx_ds4tp.testing.tiny_model import save_llama

    model = save_llama(tmp_path / "m", "tiny", seed=11)
    prompt = "An example of the library"
    leader, worker = spawn_ranks(procs, "pair_generate.py",
                                 ["--model", str(model), "--max-tokens", "12", "--transport", "tcp",
                                  "--no-chat-template"], ["--prompt", prompt])
    lout, lerr = leader.communicate(timeout=180)
    wout, werr = worker.communicate(timeout=30)
    assert leader.returncode == 0, lerr
    assert worker.returncode == 0, werr
    text, _ = reference_text(model, prompt, 12)
    streamed, closing = lout.rsplit("\n", 2)[0], lout.strip().splitlines()[-1]
    assert streamed == text
    assert "transport tcp" in closing and "tok/s" in closing
    assert "worker: served 1 prompt(s)" in werr


@pytest.mark.parametrize("transport", [["--transport", "tcp"], ["--transport", "rdma", "--rdma-device", "ucsim"]],
                         ids=["tcp", "rdma-ucsim"])
def test_gate_layer_matches_the_unsplit_model_on_both_ranks(procs, transport):
    leader, worker = spawn_ranks(procs, "gate_layer.py", transport)
    outs = []
    for rank, p in enumerate((leader, worker)):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, out + err
        assert f"rank {rank}: matches the unsplit model: True" in out, out
        assert f"rank {rank} ({transport[1]}): 3 blocks, 3 gates" in out, out
        outs.append(out)
    # Both ranks continue with the same bits after every gate.
    digests = [out.split("output sha256 ")[1].split()[0] for out in outs]
    assert digests[0] == digests[1], outs
