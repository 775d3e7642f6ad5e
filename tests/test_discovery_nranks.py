"""Discovery feeding the bring-up of N ranks, end to end: `ds4tp run --ranks 3 --interface lo`
and `ds4tp serve --ranks 3 --interface lo` on three processes of one machine, each given only
the model, the rank count, the interface and its secret (DS4_TP_SECRET). They find each other
(link/findgroup.py), form the mesh there and give the unsplit model's tokens; a served group
loses a worker, answers 503, takes the restarted worker back (it runs discovery again and finds
its leader's re-opened lobby) and answers exactly again, the other worker the same process.

Needs root and `ip netns`, as tests/test_discovery_link.py: the three ranks run on the loopback
of a network namespace the test creates (with multicast turned on there only) and deletes;
the tests are skipped, with the reason, for a user who is not root or has no `ip`, and fail
where root cannot make namespaces. Each test prints what it
measured."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from faultutil import Watched
from pairutil import REPO, reference_text
from test_discovery_link import Bridge, ip, wait_for

RANKS = 3
SECRET = "group-secret"
TIMEOUT = 60.0  # DS4_TP_TIMEOUT_SEC: a busy 2-core machine starts MLX slowly
PROMPT = "Three machines, one model"
TOKENS = 8
PORT = 8080  # the served leader's HTTP port, inside the namespace


@pytest.fixture
def loop_ns():
    """A namespace of its own, its loopback up and carrying multicast (Linux's does not until
    told, as the README says): three ranks on one machine find each other there. Skipped, with
    the reason, where this user cannot make namespaces (not root, or no `ip`); CI runs as root."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to make a network namespace (`ip netns add`) whose loopback may carry "
                    "multicast; run as root (CI does)")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (Debian: apt-get install iproute2) to make a network namespace")
    link = Bridge(1)
    try:
        link.up()
        ip("-n", link.ns[0], "link", "set", "lo", "multicast", "on")
        yield link.ns[0]
    finally:
        link.down()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    return save_llama(tmp_path_factory.mktemp("discovery-nranks") / "llama", "tiny8", seed=3)


class Rank(Watched):
    started: float
    args: List[str]


def spawn(procs, ns: str, command: List[str], tmp_path: Path, name: str,
          transport: Tuple[str, ...] = ("--transport", "tcp"), ranks: int = RANKS,
          extra_env: Optional[Dict[str, str]] = None) -> Rank:
    """`ds4tp COMMAND --ranks 3 --interface lo` (or `ranks`) in namespace `ns`, the secret (and
    `extra_env`) in the environment."""
    env = dict(os.environ, DS4_TP_SECRET=SECRET, DS4_TP_TIMEOUT_SEC=str(TIMEOUT), PYTHONUNBUFFERED="1",
               DS4_TP_CONFIG_DIR=str(tmp_path / f"config-{name}"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {}))
    args = ["ip", "netns", "exec", ns, sys.executable, "-m", "mlx_ds4tp", *command, "--ranks", str(ranks),
            "--interface", "lo", *transport]
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(p)
    rank = Rank(p, f"{name} ({command[0]} on {ns}'s loopback)")
    rank.started, rank.args = time.monotonic(), args
    return rank


def test_run_on_three_ranks_found_by_discovery_gives_the_unsplit_tokens(procs, loop_ns, model, tmp_path):
    """`ds4tp run --ranks 3 --interface lo`: the rank with --prompt leads, the two without work;
    no address typed anywhere. The leader's text is the unsplit model's."""
    base = ["run", "--model", str(model), "--max-tokens", str(TOKENS), "--no-chat-template"]
    workers = [spawn(procs, loop_ns, base, tmp_path, f"worker{i}") for i in (1, 2)]
    leader = spawn(procs, loop_ns, base + ["--prompt", PROMPT], tmp_path, "leader")
    everyone = [leader, *workers]
    deadline = time.monotonic() + 300
    while not leader.out.text() and time.monotonic() < deadline and leader.alive():
        time.sleep(0.01)
    first = time.monotonic() - leader.started
    if leader.wait_exit(300) is None or leader.proc.returncode != 0:
        pytest.fail("the run did not finish\n" + "\n".join(r.describe() for r in everyone))
    for w in workers:
        assert w.wait_exit(60) is not None and w.proc.returncode == 0, w.describe()
        assert "leader said stop" in w.err.text(), w.describe()
    assert leader.out.text().rsplit("\n", 2)[0] == reference_text(model, PROMPT, TOKENS)[0]
    found = re.search(r"discovery: a group of 3 in ([0-9.]+) s", leader.err.text())
    assert found, leader.describe()
    ranks = sorted(int(m) for r in everyone for m in re.findall(r"this machine is rank (\d)", r.err.text()))
    assert ranks == [0, 1, 2], "\n".join(r.describe() for r in everyone)
    print(f"\nrun --ranks 3 by discovery on loopback: the group found in {found[1]} s (leader's search); "
          f"first token {first:.1f} s after the leader started")


def _http(ns: str, path: str, body: Optional[dict] = None) -> tuple:
    """(status, JSON) of a request to the served leader, made from inside the namespace."""
    script = ("import sys, json, urllib.request, urllib.error\n"
              "data = sys.argv[2].encode() if sys.argv[2] else None\n"
              "r = urllib.request.Request('http://127.0.0.1:%d' + sys.argv[1], data=data, "
              "headers={'Content-Type': 'application/json'})\n"
              "try:\n    resp = urllib.request.urlopen(r, timeout=120)\n"
              "    print(resp.status); print(resp.read().decode())\n"
              "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n"
              "except OSError as e:\n    print(0); print(json.dumps(str(e)))\n") % PORT
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", script, path,
                          json.dumps(body) if body is not None else ""],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    code, text = out.stdout.split("\n", 1)
    return int(code), json.loads(text)


def _complete(ns: str, prompt: str) -> str:
    code, answer = _http(ns, "/v1/completions", {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0})
    assert code == 200, answer
    return answer["choices"][0]["text"]


def _exact(ns: str, model: Path, prompt: str) -> None:
    from serveutil import reference, text_ids

    assert _complete(ns, prompt) == reference(model, text_ids(model, prompt), TOKENS), prompt


def _rank_of(r: Rank) -> int:
    found = re.search(r"this machine is rank (-?\d)", r.err.text())
    return int(found[1]) if found else -1


def serving_by_rank(procs, ns: str, command: List[str], tmp_path: Path,
                    transport: Tuple[str, ...] = ("--transport", "tcp"),
                    extra_env: Optional[Dict[str, str]] = None) -> Dict[int, Rank]:
    """RANKS processes of `ds4tp serve` started alike (spawn), once the group serves: each by the
    rank it was given (every rank 0 .. RANKS-1 present)."""
    ranks = [spawn(procs, ns, command, tmp_path, f"rank{i}", transport, extra_env=extra_env) for i in range(RANKS)]
    wait_for(ranks, "the group serving", r"serving .* on http://", within=300)
    by_rank = {}
    for r in ranks:
        wait_for([r], f"{r.name}'s rank", r"this machine is rank \d", within=180)
        by_rank[_rank_of(r)] = r
    assert sorted(by_rank) == list(range(RANKS)), "\n".join(r.describe() for r in ranks)
    return by_rank


@pytest.mark.parametrize("victim_rank", [1, 2])
def test_serve_on_three_ranks_found_by_discovery_takes_a_restarted_worker_back(procs, loop_ns, model, tmp_path,
                                                                              victim_rank):
    """`ds4tp serve --ranks 3 --interface lo` on three processes: they elect a leader, which
    answers exactly; a worker killed makes it answer 503; the same command started again runs
    discovery, finds the leader's re-opened lobby and re-joins with the rank left free; the
    answers are exact again and the other worker is the process it was."""
    # --shrink-after 0: the group waits for its rank (tests/test_serve_shrink_discovery.py shrinks).
    cmd = ["serve", "--model", str(model), "--port", str(PORT), "--max-kv-tokens", "4096", "--shrink-after", "0"]
    by_rank = serving_by_rank(procs, loop_ns, cmd, tmp_path)
    leader, victim = by_rank[0], by_rank[victim_rank]
    survivor = by_rank[3 - victim_rank]
    found = re.search(r"discovery: a group of 3 in ([0-9.]+) s", leader.err.text())
    _exact(loop_ns, model, "three Macs")

    victim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    victim.wait_exit(30)
    deadline = time.monotonic() + 30
    while _http(loop_ns, "/health")[0] != 503:
        assert time.monotonic() < deadline, leader.describe()
        time.sleep(0.05)
    down = time.monotonic() - killed
    code, _ = _http(loop_ns, "/v1/completions", {"prompt": "meanwhile", "max_tokens": 3})
    assert code == 503
    # The leader re-opens its lobby for the rank that went (discovery's restarted worker finds it).
    wait_for([leader], "the leader's lobby re-opened", r"discovery: this machine leads its group again", within=180)

    again = spawn(procs, loop_ns, cmd, tmp_path, f"rank{victim_rank}-again")
    procs_back = time.monotonic()
    deadline = time.monotonic() + 300
    while _http(loop_ns, "/health")[0] != 200:
        assert time.monotonic() < deadline and again.alive(), again.describe() + "\n" + leader.describe()
        time.sleep(0.2)
    back = time.monotonic() - procs_back
    _exact(loop_ns, model, "after")
    _exact(loop_ns, model, "three Macs")
    assert "formed again" in leader.err.text(), leader.describe()
    assert survivor.alive() and "joined a leader again" in survivor.err.text(), survivor.describe()
    assert "re-joins it with the rank left free" in again.err.text(), again.describe()
    assert f"rank {victim_rank} of 3" in again.err.text(), again.describe()
    print(f"\nserve --ranks 3 by discovery on loopback: group found in {found[1] if found else '?'} s; "
          f"rank {victim_rank} killed: 503 after {down:.2f} s (seen from a request in the namespace); "
          f"the restarted worker re-discovered and serving {back:.1f} s after its start")
