"""The examples run as a user runs them: both ranks on 127.0.0.1, and what they print is right."""

from __future__ import annotations

import ast
import os
import shlex
import signal
import subprocess
import sys

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
    from mlx_ds4tp.synthetic.tiny_model import save_llama

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


def loopback_commands(script: str, port: int) -> str:
    """The shell lines the script's docstring gives for one machine (the block of `$ ` lines
    under "On one machine"), with this test's port and this Python."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(EXAMPLES, script)).read()))
    block = doc.split("On one machine", 1)[1].split("\n\n", 2)[1]
    lines = [ln.strip().removeprefix("$ ") for ln in block.splitlines()]
    text = " ".join(ln[:-1] if ln.endswith("\\") else ln + "\n" for ln in lines)
    assert "127.0.0.1 9911" in text and "--role leader" in text and "--role worker" in text, text
    return text.replace("9911", str(port)).replace("python ", shlex.quote(sys.executable) + " ")


def run_shell(text: str, env: dict, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """`text` under bash in the repository; the whole process group is killed on a timeout."""
    full_env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    p = subprocess.Popen(["bash", "-c", text], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize("script", ["gate_layer.py", "pair_generate.py"])
def test_the_docstrings_loopback_commands_run_as_written(script, tmp_path):
    # A reader copies the docstring's one-machine lines: they start both ranks and finish.
    text = loopback_commands(script, free_port())
    res = run_shell(text, {"XDG_CACHE_HOME": str(tmp_path), "DS4_TP_TIMEOUT_SEC": "60"})
    assert res.returncode == 0, res.stdout + res.stderr
    if script == "gate_layer.py":
        for rank in (0, 1):
            assert f"rank {rank}: matches the unsplit model: True" in res.stdout, res.stdout
    else:
        assert "tok/s" in res.stdout.strip().splitlines()[-1], res.stdout
        assert "worker: served 1 prompt(s)" in res.stderr, res.stderr
