"""A worker without --model found by discovery (link/meet.py for two, link/findgroup.py for N):
it advertises no model (discovery.ANY_MODEL), never leads, joins the leader of the model on its
link, receives its part into its parts cache and the leader's text is the unsplit model's; its
second start finds its part cached and nothing is sent. Three ranks: one or both workers without
the model.

The process tests need root and `ip netns`, as tests/test_discovery_nranks.py: the ranks run on the loopback of a
namespace the test creates (multicast turned on there only) and deletes; skipped, with the
reason, for a user who is not root or has no `ip`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from faultutil import Watched
from pairutil import REPO, reference_text
from test_discovery_nranks import loop_ns as namespace  # the fixture: a namespace's loopback

loop_ns = namespace
SECRET = "parts-secret"
TIMEOUT = 60.0  # DS4_TP_TIMEOUT_SEC: a busy 2-core machine starts MLX slowly
PROMPT = "Only the leader holds the model"
TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    return save_llama(tmp_path_factory.mktemp("part-discovery") / "llama", "tiny8", seed=3)


def spawn(procs, ns: str, command: List[str], tmp_path: Path, name: str, verb: str = "run") -> Watched:
    """`ds4tp run ... --interface lo` (or `verb`) in namespace `ns`, the secret in the environment."""
    env = dict(os.environ, DS4_TP_SECRET=SECRET, DS4_TP_TIMEOUT_SEC=str(TIMEOUT), PYTHONUNBUFFERED="1",
               DS4_TP_CONFIG_DIR=str(tmp_path / f"config-{name}"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_only = ["--max-tokens", str(TOKENS), "--no-chat-template"] if verb == "run" else []
    args = ["ip", "netns", "exec", ns, sys.executable, "-m", "mlx_ds4tp", verb, *command,
            "--interface", "lo", "--transport", "tcp", *run_only]
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(p)
    return Watched(p, f"{name} on {ns}'s loopback")


def run_group(procs, ns: str, model: Path, parts: List[Path], tmp_path: Path, with_model: int = 0) -> tuple:
    """The workers first (those of `parts` without --model, `with_model` more with it), then the
    leader with --prompt: (the leader's text, each model-less worker's stderr)."""
    ranks = 1 + len(parts) + with_model
    size = ["--ranks", str(ranks)] if ranks > 2 else []
    receivers = [spawn(procs, ns, ["--parts-dir", str(d), *size], tmp_path, f"receiver{i}")
                 for i, d in enumerate(parts)]
    holders = [spawn(procs, ns, ["--model", str(model), *size], tmp_path, f"holder{i}") for i in range(with_model)]
    leader = spawn(procs, ns, ["--model", str(model), "--prompt", PROMPT, *size], tmp_path, "leader")
    everyone = [leader, *receivers, *holders]
    if leader.wait_exit(300) is None or leader.proc.returncode != 0:
        pytest.fail("the run did not finish\n" + "\n".join(r.describe() for r in everyone))
    for w in receivers + holders:
        assert w.wait_exit(60) is not None and w.proc.returncode == 0, w.describe()
    return leader.out.text().rsplit("\n", 2)[0], [r.err.text() for r in receivers], leader.err.text()


def test_a_worker_without_a_model_joins_a_leader_of_any_model_and_is_no_rival():
    from mlx_ds4tp.link import discovery as dsc, lobby

    def advert(instance, digest, want="any", state=dsc.SEEK, port=0):
        return dsc.Advert(instance=instance, digest=digest, want=want, state=state, port=port)

    leader = advert("c3", "ab" * 16, state=dsc.LEAD, port=1)
    receiver = advert("a1", dsc.ANY_MODEL, want="work")
    assert dsc.elect(receiver, [leader], settled=False) == ("join", leader)
    assert dsc.elect(receiver, [], settled=True) == ("wait", None)  # it never leads: it has no model
    # Lower id or not, a receiver is no rival of a rank that holds the model.
    assert dsc.elect(advert("z9", "ab" * 16), [receiver], settled=True) == ("lead", None)
    assert dsc.same_model("ab" * 16, dsc.ANY_MODEL) and not dsc.same_model("ab" * 16, "cd" * 16)
    knock = lobby.Knock("a1", "h", dsc.ANY_MODEL, 3, 1, lobby.NO_RANK, True)
    mine = lobby.Knock("c3", "h", "ab" * 16, 3, 1, lobby.NO_RANK, True)
    assert lobby._mismatch(mine, knock) == "" and lobby._mismatch(knock, mine) == ""
    assert "another model" in lobby._mismatch(mine, lobby.Knock("b2", "h", "cd" * 16, 3, 1, lobby.NO_RANK, True))


def test_a_pair_whose_worker_has_no_model_pairs_by_discovery_and_gets_its_part(procs, loop_ns, model, tmp_path):
    started = time.monotonic()
    text, (werr,), lerr = run_group(procs, loop_ns, model, [tmp_path / "parts"], tmp_path)
    assert text == reference_text(model, PROMPT, TOKENS)[0]
    assert "receiving this rank's part" in werr and "discovery: paired" in werr, werr
    assert re.search(r"rank 1's part: [0-9.]+ MB sent", lerr), lerr
    print(f"\npair by discovery, the worker without --model: done in {time.monotonic() - started:.1f} s")

    text, (werr,), lerr = run_group(procs, loop_ns, model, [tmp_path / "parts"], tmp_path)
    assert text == reference_text(model, PROMPT, TOKENS)[0]
    assert "receiving this rank's part" not in werr and "its cache held all of it" in lerr, lerr


@pytest.mark.parametrize("receivers", [1, 2])
def test_three_ranks_by_discovery_workers_without_the_model(procs, loop_ns, model, tmp_path, receivers):
    parts = [tmp_path / f"parts{i}" for i in range(receivers)]
    text, werrs, lerr = run_group(procs, loop_ns, model, parts, tmp_path, with_model=2 - receivers)
    assert text == reference_text(model, PROMPT, TOKENS)[0]
    for werr in werrs:
        assert "receiving this rank's part" in werr and "discovery: a group of 3" in werr, werr
    assert len(re.findall(r"rank \d's part: [0-9.]+ MB sent", lerr)) == receivers, lerr


def test_serve_by_discovery_a_worker_without_the_model_answers_as_the_unsplit_model(procs, loop_ns, model,
                                                                                    tmp_path):
    """`ds4tp serve --role worker --interface lo` without --model beside `ds4tp serve --model M
    --interface lo`: they pair, the worker receives its part, the answers are the unsplit model's."""
    from test_discovery_nranks import PORT, _exact, wait_for

    worker = spawn(procs, loop_ns, ["--role", "worker", "--parts-dir", str(tmp_path / "parts")], tmp_path,
                   "worker", verb="serve")
    leader = spawn(procs, loop_ns, ["--model", str(model), "--port", str(PORT), "--max-kv-tokens", "4096"],
                   tmp_path, "leader", verb="serve")
    wait_for([leader], "the pair serving", r"serving .* on http://", within=300)
    _exact(loop_ns, model, "one Mac holds it")
    assert "receiving this rank's part" in worker.err.text(), worker.describe()
    assert re.search(r"rank 1's part: [0-9.]+ MB sent", leader.err.text()), leader.describe()
