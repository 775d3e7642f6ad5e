"""No one joins without the secret, end to end: network namespaces on one bridge (the
`bridge` fixture, test_discovery_link.Bridge) stand in for Macs on a shared network (a switch,
Wi-Fi), every rank started with explicit addresses (--listen/--coordinator) and its own config
directory (DS4_TP_CONFIG_DIR, where `ds4tp pair` stores the secret).

- a leader (and a worker) on a bridge address with no secret stops at once, naming the address
  and the two fixes;
- three ranks paired with `ds4tp pair` (no --secret anywhere) form their group, while strangers
  (another secret; none, with --insecure) dialing the leader's door and a worker's mesh port are
  refused on both ends; the code is in no line any of them wrote;
- --insecure forms a pair with no secret, one warning line on each rank;
- `ds4tp serve` paired the same way: the keyless HTTP face on 0.0.0.0 warns once, and /health,
  /metrics, the answers and the logs hold no secret.

Needs root and `ip netns`, as tests/test_discovery_link.py: where namespaces cannot be made the
tests FAIL with the reason. Addresses live only inside the namespaces the tests create and delete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import pytest

from faultutil import Watched, reap
from pairutil import REPO, reference_text
from test_discovery_link import Bridge, finished_text

PROMPT = "the open network"
TOKENS = 6
PORT = 9911  # the namespaces are fresh: nothing else listens there
TIMEOUT = 120.0  # DS4_TP_TIMEOUT_SEC: a busy 2-core machine starts MLX slowly (a stranger waits at worker 1 that long)
OTHER_SECRET = "a-strangers-secret"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    # 8 KV heads: splits over two ranks and three alike.
    return save_llama(tmp_path_factory.mktemp("join-secret") / "llama", "tiny8", seed=3)


def ds4tp_env(config: Path) -> dict:
    env = dict(os.environ, DS4_TP_CONFIG_DIR=str(config), DS4_TP_TIMEOUT_SEC=str(TIMEOUT),
               PYTHONUNBUFFERED="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DS4_TP_SECRET", None)
    return env


def pair_every(configs: List[Path]) -> str:
    """`ds4tp pair` with the first config directory, `ds4tp pair CODE` with the others (as on
    each Mac); the code."""
    def pair(config: Path, *code: str) -> str:
        out = subprocess.run([sys.executable, "-m", "mlx_ds4tp", "pair", *code], env=ds4tp_env(config),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    code = pair(configs[0])
    for config in configs[1:]:
        pair(config, code)
    return code


def spawn(procs, bridge: Bridge, i: int, argv: List[str], config: Path, name: str) -> Watched:
    """`ds4tp ARGV` in namespace i, with only `config` (its stored secret, if any) to prove."""
    args = ["ip", "netns", "exec", bridge.ns[i], sys.executable, "-m", "mlx_ds4tp", *argv]
    p = subprocess.Popen(args, env=ds4tp_env(config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(p)
    return Watched(p, f"{name} in {bridge.ns[i]} ({bridge.addr[i]})")


def run_argv(model: Path, *flags: str) -> List[str]:
    return ["run", "--model", str(model), "--max-tokens", str(TOKENS), "--no-chat-template",
            "--transport", "tcp", *flags]


def leader_flags(bridge: Bridge, *more: str) -> List[str]:
    return ["--prompt", PROMPT, "--role", "leader", "--listen", bridge.addr[0], str(PORT), *more]


def worker_flags(bridge: Bridge, *more: str, at: int = 0, port: int = PORT) -> List[str]:
    return ["--role", "worker", "--coordinator", bridge.addr[at], str(port), *more]


def wait_for(rank: Watched, text: str, within: float = 120.0) -> None:
    rank.err.wait_for(text, within, rank.proc)


def exited(rank: Watched, within: float = 120.0) -> int:
    if rank.wait_exit(within) is None:
        pytest.fail(f"{rank.name} did not exit\n{rank.describe()}")
    return rank.proc.returncode


def describe(ranks: List[Watched]) -> str:
    return "\n".join(r.describe() for r in ranks)


def assert_no_secret(ranks: List[Watched], code: str, *bodies: str) -> None:
    """Neither the code nor its raw characters in any rank's output, any process's command line
    or the bodies given."""
    forms = (code, code.replace("-", ""))
    for r in ranks:
        for text in (r.out.text(), r.err.text()):
            assert not any(f in text for f in forms), r.describe()
    for body in bodies:
        assert not any(f in body for f in forms), body


def listening_ports(ns: str) -> List[int]:
    """The TCP ports something listens on in namespace `ns` (its /proc/net/tcp and tcp6)."""
    return sorted(int(local.split(":")[-1], 16) for local, state in _sockets(ns) if state == "0A")


def established_on(ns: str, port: int) -> bool:
    return any(state == "01" and int(local.split(":")[-1], 16) == port for local, state in _sockets(ns))


def _sockets(ns: str):
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/tcp", "/proc/net/tcp6"],
                         capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[0].endswith(":"):
            yield fields[1], fields[3]


@pytest.mark.parametrize("bridge", [2], indirect=True)
def test_a_rank_on_a_bridge_address_without_a_secret_stops_naming_it_and_the_fixes(procs, bridge, model, tmp_path):
    leader = spawn(procs, bridge, 0, run_argv(model, *leader_flags(bridge)), tmp_path / "c0", "leader")
    worker = spawn(procs, bridge, 1, run_argv(model, *worker_flags(bridge)), tmp_path / "c1", "worker")
    for rank, does in ((leader, "listens on"), (worker, "dials")):
        assert exited(rank) != 0, rank.describe()
        says = rank.err.text()
        for part in (f"this rank {does} {bridge.addr[0]}:{PORT}", "with no pair secret", "`ds4tp pair`",
                     "--secret"):
            assert part in says, rank.describe()
        assert "waiting for" not in says and "Traceback" not in says, rank.describe()  # before any socket


@pytest.mark.parametrize("bridge", [4], indirect=True)
def test_ranks_paired_with_ds4tp_pair_form_their_group_and_strangers_are_refused_at_every_door(
        procs, bridge, model, tmp_path):
    configs = [tmp_path / f"mac{i}" for i in range(3)]
    code = pair_every(configs)
    strangers_config = tmp_path / "stranger"  # no stored secret
    leader = spawn(procs, bridge, 0, run_argv(model, "--ranks", "3", *leader_flags(bridge)), configs[0], "leader")
    wait_for(leader, "rank 0 of 3 waiting for ranks 1 .. 2")
    # At the leader's door: one with another secret, one with none (--insecure gets it past its
    # own check); each is refused by the leader's JOIN check and stops saying so.
    strangers = []
    for i, flags in enumerate((("--secret", OTHER_SECRET), ("--insecure",))):
        stranger = spawn(procs, bridge, 3, run_argv(model, *worker_flags(bridge, "--ranks", "3", *flags)),
                         strangers_config, f"stranger {i}")
        strangers.append(stranger)
        assert exited(stranger) != 0, stranger.describe()
        assert "authentication failed" in stranger.err.text(), stranger.describe()
        assert leader.err.text().count(f"mesh: refused a JOIN from {bridge.addr[3]}") == i + 1, leader.describe()
        line = f"mesh: refused a JOIN from {bridge.addr[3]}"
        refused_here = leader.err.find(line, len(leader.err.text().rsplit(line, 1)[0].encode()))
        print(f"\nstranger {i} at the leader's door: its error {stranger.err.find('error:') - refused_here:+.3f} s "
              "after the leader logged the refusal")
    assert strangers[1].err.text().count("WARNING: --insecure") == 1, strangers[1].describe()
    first = spawn(procs, bridge, 1, run_argv(model, *worker_flags(bridge)), configs[1], "worker 1")
    wait_for(leader, "joined (1 of the 2 other ranks")
    # At worker 1's mesh port, open while the leader gathers the others: a stranger's
    # connection waits there and is the first the worker takes once the links form.
    ports = listening_ports(bridge.ns[1])
    assert len(ports) == 1, (ports, first.describe())
    at_worker = spawn(procs, bridge, 3, run_argv(model, *worker_flags(bridge, "--ranks", "3", "--secret",
                                                                       OTHER_SECRET, at=1, port=ports[0])),
                      strangers_config, "stranger at worker 1")
    strangers.append(at_worker)
    deadline = time.monotonic() + 60
    while not established_on(bridge.ns[1], ports[0]):
        if time.monotonic() > deadline or not at_worker.alive():
            pytest.fail("the stranger never reached worker 1's mesh port\n" + describe([first, at_worker]))
        time.sleep(0.05)
    second = spawn(procs, bridge, 2, run_argv(model, *worker_flags(bridge)), configs[2], "worker 2")
    everyone = [leader, first, second, *strangers]
    assert finished_text(leader, [first, second, at_worker]) == reference_text(model, PROMPT, TOKENS)[0]
    for w in (first, second):
        assert exited(w) == 0, describe(everyone)
    assert exited(at_worker) != 0, at_worker.describe()
    assert f"refused a connection from {bridge.addr[3]}" in first.err.text(), first.describe()
    assert "refused by the mesh rank" in at_worker.err.text(), at_worker.describe()
    assert_no_secret(everyone, code)
    assert not any("WARNING" in r.err.text() for r in (leader, first, second)), describe(everyone)


@pytest.mark.parametrize("bridge", [2], indirect=True)
def test_insecure_forms_an_open_pair_with_one_warning_line_on_each_rank(procs, bridge, model, tmp_path):
    leader = spawn(procs, bridge, 0, run_argv(model, *leader_flags(bridge, "--insecure")), tmp_path / "c0", "leader")
    worker = spawn(procs, bridge, 1, run_argv(model, *worker_flags(bridge, "--insecure")), tmp_path / "c1", "worker")
    assert finished_text(leader, [worker]) == reference_text(model, PROMPT, TOKENS)[0]
    assert exited(worker) == 0, worker.describe()
    for rank, addr in ((leader, bridge.addr[0]), (worker, bridge.addr[0])):
        lines = [line for line in rank.err.text().splitlines() if "WARNING" in line]
        assert len(lines) == 1 and "--insecure" in lines[0] and f"{addr}:{PORT}" in lines[0], rank.describe()


def http_get(bridge: Bridge, path: str, body: Optional[dict] = None) -> str:
    """GET (or POST `body` to) the leader's HTTP face, from inside its namespace."""
    script = ("import sys, urllib.request; d = sys.argv[2].encode() or None; r = urllib.request.Request("
              "'http://127.0.0.1:8080' + sys.argv[1], data=d, headers={'Content-Type': 'application/json'}); "
              "print(urllib.request.urlopen(r, timeout=60).read().decode())")
    out = subprocess.run(["ip", "netns", "exec", bridge.ns[0], sys.executable, "-c", script, path,
                          json.dumps(body) if body else ""], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("bridge", [2], indirect=True)
def test_a_paired_server_warns_of_its_keyless_http_face_and_shows_the_secret_nowhere(procs, bridge, model, tmp_path):
    configs = [tmp_path / "mac0", tmp_path / "mac1"]
    code = pair_every(configs)
    serve = ["serve", "--model", str(model), "--transport", "tcp", "--host", "0.0.0.0", "--max-kv-tokens", "4096"]
    leader = spawn(procs, bridge, 0, [*serve, "--role", "leader", "--listen", bridge.addr[0], str(PORT)],
                   configs[0], "serve leader")
    worker = spawn(procs, bridge, 1, [*serve, *worker_flags(bridge)], configs[1], "serve worker")
    try:
        wait_for(leader, "linked to every peer", 180)
        wait_for(leader, "http://", 180)
        answer = http_get(bridge, "/v1/completions", {"model": str(model), "prompt": PROMPT, "max_tokens": TOKENS,
                                                      "temperature": 0})
        bodies = [answer, http_get(bridge, "/health"), http_get(bridge, "/metrics"), http_get(bridge, "/v1/models")]
        cmdlines = [Path(f"/proc/{r.proc.pid}/cmdline").read_bytes().decode(errors="replace") for r in (leader, worker)]
        assert json.loads(answer)["choices"][0]["text"] == reference_text(model, PROMPT, TOKENS)[0]
    finally:
        for r in (leader, worker):
            reap(r)
    lines = [line for line in leader.err.text().splitlines() if "WARNING" in line]
    assert len(lines) == 1 and "HTTP API on 0.0.0.0:8080" in lines[0] and "--api-key" in lines[0], leader.describe()
    assert "WARNING" not in worker.err.text(), worker.describe()
    assert_no_secret([leader, worker], code, *bodies, *cmdlines)
