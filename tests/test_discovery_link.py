"""Ranks that find each other: network namespaces joined by a bridge stand in for Macs on a
Thunderbolt link, each rank started with only --model, --interface and its secret (the
environment's DS4_TP_SECRET, as `ds4tp pair` would store it). They must pair and produce the
unsplit model's exact text whatever the start order; `serve` ranks started together elect one
leader and the worker prints its URL; a rank with another secret never pairs and both sides log
the refusal; two pairs of two models on one link each find their own; a worker whose leader died
pairs with the next one.

Needs root and `ip netns` (iproute2), as tests/test_cable_pull.py: where namespaces cannot be
made the tests FAIL with the reason. Multicast and addresses live only inside the namespaces the
tests create and delete. Each test prints the pairing time it measured (from the second rank's
start to the leader's "worker connected" line) for the closing note; none asserts a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List, Optional

import pytest

from faultutil import Watched, reap
from pairutil import REPO, reference_text

MAX_TOKENS = 6
PROMPT = "the link"
SECRET, OTHER_SECRET = "test-pair-secret", "someone-elses-secret"
TIMEOUT = 60.0  # DS4_TP_TIMEOUT_SEC: a busy 2-core machine starts MLX slowly


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Bridge:
    """A hub namespace with a bridge, and `n` namespaces each joined to it by a veth pair with an
    address on 10.233.0.0/24: the link every rank is on (its interface is `dev`)."""

    def __init__(self, n: int) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.hub = f"ds4tp-hub-{self.tag}"
        self.ns = [f"ds4tp-{i}-{self.tag}" for i in range(n)]
        self.dev = [f"tb{i}{self.tag}" for i in range(n)]
        self.addr = [f"10.233.0.{i + 1}" for i in range(n)]
        self.created: List[str] = []

    def up(self) -> None:
        if shutil.which("ip") is None:
            pytest.fail("the discovery tests need the `ip` command (Debian: apt-get install iproute2)")
        for ns in (self.hub, *self.ns):
            r = ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.fail(f"cannot create a network namespace (`ip netns add {ns}`: {r.stderr.strip()}); "
                            "the discovery tests need root (CAP_SYS_ADMIN) and network namespaces")
            self.created.append(ns)
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns):
            port = f"hp{i}{self.tag}"
            ip("link", "add", self.dev[i], "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
            ip("-n", self.hub, "link", "set", port, "master", "br0")
            ip("-n", self.hub, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", self.dev[i])
            ip("-n", ns, "link", "set", self.dev[i], "up")
            ip("-n", ns, "link", "set", "lo", "up")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = [ip("-n", ns, "link", "show", "dev", d).stdout for ns, d in zip(self.ns, self.dev)]
            if all("LOWER_UP" in s and "NO-CARRIER" not in s for s in states):
                return
            time.sleep(0.05)
        pytest.fail(f"the bridged links did not come up: {states}")

    def down(self) -> None:
        for ns in self.created:
            ip("netns", "del", ns, check=False)
        self.created = []


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    root = tmp_path_factory.mktemp("discovery-models")
    return [save_llama(root / "a", "tiny", seed=3), save_llama(root / "b", "tiny", seed=4)]


class Rank(Watched):
    started: float


def spawn(procs, bridge: Bridge, i: int, command: List[str], secret: str, tmp_path: Path) -> Rank:
    """`ds4tp COMMAND` in namespace i with only --interface (and the secret in the environment)."""
    config = tmp_path / f"config-{i}-{len(procs.procs)}"  # no stored secret: the environment's
    env = dict(os.environ, DS4_TP_SECRET=secret, DS4_TP_TIMEOUT_SEC=str(TIMEOUT), PYTHONUNBUFFERED="1",
               DS4_TP_CONFIG_DIR=str(config), PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["ip", "netns", "exec", bridge.ns[i], sys.executable, "-m", "mlx_ds4tp", *command,
            "--interface", bridge.dev[i], "--transport", "tcp"]
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(p)
    rank = Rank(p, f"{command[0]} in {bridge.ns[i]} ({bridge.addr[i]})")
    rank.started = time.monotonic()
    return rank


def run_cmd(model: Path, prompt: Optional[str] = PROMPT) -> List[str]:
    return ["run", "--model", str(model), "--max-tokens", str(MAX_TOKENS), "--no-chat-template",
            *(["--prompt", prompt] if prompt else [])]


def serve_cmd(model: Path) -> List[str]:
    return ["serve", "--model", str(model), "--host", "0.0.0.0", "--port", "8080", "--max-kv-tokens", "4096"]


def wait_for(ranks: List[Rank], what: str, pattern: str, within: float = 90.0) -> float:
    """The time `pattern` first appears in any of `ranks`' stderr; fails naming `what`."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for r in ranks:
            if re.search(pattern, r.err.text()):
                return time.monotonic()
        time.sleep(0.02)
    pytest.fail(f"{what}: not within {within:.0f} s\n" + "\n".join(r.describe() for r in ranks))


def finished_text(leader: Rank, others: List[Rank]) -> str:
    """The leader's streamed text once the run exits 0."""
    if leader.wait_exit(300) is None or leader.proc.returncode != 0:
        pytest.fail("the run did not finish\n" + "\n".join(r.describe() for r in [leader, *others]))
    return leader.out.text().rsplit("\n", 2)[0]


def completion(bridge: Bridge, i: int, model: Path, prompt: str) -> str:
    """POST /v1/completions to the leader in namespace i, from inside it."""
    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    script = ("import sys, urllib.request; r = urllib.request.Request('http://127.0.0.1:8080/v1/completions', "
              "data=sys.argv[1].encode(), headers={'Content-Type': 'application/json'}); "
              "print(urllib.request.urlopen(r, timeout=60).read().decode())")
    out = subprocess.run(["ip", "netns", "exec", bridge.ns[i], sys.executable, "-c", script, body],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["choices"][0]["text"]


def paired_after(leader: Rank, second: Rank) -> float:
    t = wait_for([leader], "the leader's worker connected", r"worker connected from")
    return t - second.started


@pytest.mark.parametrize("bridge", [2], indirect=True)
def test_run_ranks_pair_by_themselves_leader_first(procs, bridge, models, tmp_path):
    # The other orders: the serve test's worker waits for its next leader (worker first), and
    # its two serve ranks, like the two-model test's four, start together.
    model = models[0]
    leader = spawn(procs, bridge, 0, run_cmd(model), SECRET, tmp_path)
    wait_for([leader], "the leader waiting", r"leads; waiting for its worker on ")
    worker = spawn(procs, bridge, 1, run_cmd(model, None), SECRET, tmp_path)
    after = paired_after(leader, worker)
    looked = re.search(r"discovery: paired ([0-9.]+) s after", worker.err.text())
    print(f"pairing, leader first: the leader's 'worker connected' {after:.2f} s after the worker "
          f"started; the worker paired {looked[1] if looked else '?'} s after it began looking")
    assert finished_text(leader, [worker]) == reference_text(model, PROMPT, MAX_TOKENS)[0]
    assert worker.wait_exit(60) is not None and worker.proc.returncode == 0, worker.describe()
    assert "this machine (" in leader.err.text() and "leads; waiting for its worker on " + bridge.dev[0] \
        in leader.err.text()
    assert re.search(rf"leads \(found on {bridge.dev[1]} at {bridge.addr[0]} port \d+\); this machine",
                     worker.err.text()), worker.err.text()


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_serve_ranks_started_together_elect_a_leader_refuse_a_stranger_and_rejoin(procs, bridge, models,
                                                                                 tmp_path):
    from serveutil import reference, text_ids

    model = models[0]
    # Two serve ranks started at once: one leads, the other works for it and says its URL.
    serves = [spawn(procs, bridge, i, serve_cmd(model), SECRET, tmp_path) for i in (0, 1)]
    wait_for(serves, "a leader elected", r"discovery: this machine \(.*\) leads")
    lead_i = next(i for i, r in enumerate(serves) if re.search(r"this machine \(.*\) leads", r.err.text()))
    leader, worker = serves[lead_i], serves[1 - lead_i]
    wait_for([worker], "the worker following the leader", r"works for it; it serves http://0\.0\.0\.0:8080/v1")
    print(f"pairing, serve ranks started together: the leader's 'worker connected' "
          f"{paired_after(leader, max(serves, key=lambda r: r.started)):.2f} s after the second started")
    wait_for([leader], "the leader serving", r"serving .* on http://")
    assert not re.search(r"this machine \(.*\) leads", worker.err.text()), worker.err.text()
    assert completion(bridge, lead_i, model, "hello") == reference(model, text_ids(model, "hello"), MAX_TOKENS)

    # The leader dies. A stranger (another secret) leads on the link: the worker tries it and
    # both sides refuse, by name; then a new serve rank starts where the leader was, and the
    # worker, which outlived its leader, pairs with it and serves again.
    reap(leader)
    wait_for([worker], "the worker noticing", r"waiting for a leader \(discovery\)")
    stranger = spawn(procs, bridge, 2, run_cmd(model), OTHER_SECRET, tmp_path)
    wait_for([worker], "the worker's refusal", r"discovery: refused by / refusing .* \(instance")
    wait_for([stranger], "the stranger's refusal",
             rf"refused a JOIN from {bridge.addr[1 - lead_i]}:\d+: authentication failed")
    new_leader = spawn(procs, bridge, lead_i, serve_cmd(model), SECRET, tmp_path)
    wait_for([new_leader], "the new leader serving", r"serving .* on http://")
    print(f"pairing, a new leader for a worker that outlived its leader: "
          f"{paired_after(new_leader, new_leader):.2f} s after the new leader started")
    assert worker.err.text().count("works for it") == 3, worker.err.text()  # leader, stranger, new leader
    assert completion(bridge, lead_i, model, "again") == reference(model, text_ids(model, "again"), MAX_TOKENS)
    assert "worker connected from" not in stranger.err.text()


@pytest.mark.parametrize("bridge", [4], indirect=True)
def test_two_pairs_of_two_models_on_one_link_each_find_their_own(procs, bridge, models, tmp_path):
    # All four at once: two leaders (one per model) and two workers; each worker must join the
    # leader of its model, never the other.
    ranks = [spawn(procs, bridge, i, run_cmd(models[i % 2], PROMPT if i < 2 else None), SECRET, tmp_path)
             for i in range(4)]
    for i in (0, 1):
        text = finished_text(ranks[i], ranks)
        assert text == reference_text(models[i], PROMPT, MAX_TOKENS)[0], i
        worker = ranks[i + 2]
        assert worker.wait_exit(60) is not None and worker.proc.returncode == 0, worker.describe()
        assert re.search(rf"found on {bridge.dev[i + 2]} at {bridge.addr[i]} port", worker.err.text()), \
            worker.err.text()
    assert reference_text(models[0], PROMPT, MAX_TOKENS)[0] != reference_text(models[1], PROMPT, MAX_TOKENS)[0]


@pytest.mark.parametrize("bridge", [1], indirect=True)
def test_run_on_one_machine_pairs_over_loopback_worker_first_without_a_secret(procs, bridge, models, tmp_path):
    """The README's one-machine recipe: `ds4tp run --model M --interface lo` and the same with
    --prompt pair by themselves, the worker started first, no secret (loopback never leaves the
    machine). Linux's loopback carries no multicast until told to, as the README says; the test
    turns it on in its own namespace only."""
    ns = bridge.ns[0]
    ip("-n", ns, "link", "set", "lo", "multicast", "on")
    model = models[0]
    env = dict(os.environ, DS4_TP_TIMEOUT_SEC=str(TIMEOUT), PYTHONUNBUFFERED="1",
               DS4_TP_CONFIG_DIR=str(tmp_path / "no-secret"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DS4_TP_SECRET", None)

    def start(command: List[str], name: str) -> Rank:
        args = ["ip", "netns", "exec", ns, sys.executable, "-m", "mlx_ds4tp", *command, "--interface", "lo"]
        p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.procs.append(p)
        rank = Rank(p, f"{name} on {ns}'s loopback")
        rank.started = time.monotonic()
        return rank

    worker = start(run_cmd(model, None), "worker")
    wait_for([worker], "the worker looking", r"discovery: looking on lo")
    leader = start(run_cmd(model), "leader")
    after = paired_after(leader, worker)
    print(f"pairing over loopback, worker first: 'worker connected' {after:.2f} s after the leader started")
    assert finished_text(leader, [worker]) == reference_text(model, PROMPT, MAX_TOKENS)[0]
    assert worker.wait_exit(60) is not None and worker.proc.returncode == 0, worker.describe()


@pytest.mark.parametrize("bridge", [2], indirect=True)
def test_doctor_on_both_finds_the_peer_and_times_the_exchange(procs, bridge, models, tmp_path):
    """`ds4tp doctor --interface NAME --model M` on both machines, started together: they find
    each other, compare the models and time the gates' exchange, with no address typed."""
    model = models[0]
    doctors = [spawn(procs, bridge, i, ["doctor", "--model", str(model)], SECRET, tmp_path) for i in (0, 1)]
    for d in doctors:
        if d.wait_exit(180) is None:
            pytest.fail("doctor did not finish\n" + "\n".join(r.describe() for r in doctors))
    for d in doctors:
        out = d.out.text()
        assert re.search(r"all_sum round trip with the group discovery found.*2 ranks, transport tcp, 16 KiB p50",
                         out), \
            d.describe()
        assert "model fingerprint" in out and "split auto" in out, d.describe()
