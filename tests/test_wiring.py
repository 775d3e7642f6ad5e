"""A mesh that wires itself (issue 57, parts 1 and 2), end to end: network namespaces stand in
for Macs, a shared bridge (the `bridge` fixture, test_discovery_link.Bridge) for their LAN, and
veth pairs for the Thunderbolt cables between them, each cable on its own /30 subnet and its
interface named differently in each namespace (as en3 on one Mac is en5 on the other). Every
rank is started with the leader's LAN address, `--transport rdma --rdma-device ucsim` and its
cables' interfaces (--interface), nothing else about the wiring:

- a full mesh of three: the unsplit model's tokens, every link on its own cable (each rank says
  which, `ucsim:IFNAME`), and every cable's veth carries its link's gates (its byte counters
  grow, more than the LAN's); the same found by discovery on the cables alone (no address);
- a cable missing (ranks 1 and 2 not cabled): `--transport rdma` stops every rank naming the
  two ranks and the interfaces they looked on; `--transport auto` runs RDMA on the two cables,
  TCP between 1 and 2 saying why, and gives the unsplit tokens;
- four ranks cabled as a ring plus the LAN: `auto` runs RDMA on the four ring links and TCP on
  the two diagonals, saying why, and gives the unsplit tokens; `--transport rdma` runs every
  collective round the ring of cables (the diagonals TCP, for the leader's commands only): the
  unsplit tokens, every ring cable's counters grow by more than the LAN's;
- `--rdma-devices` naming the other cable's device (a swapped cable) is refused by name;
- `ds4tp doctor` on the full mesh prints its wiring table: each link's interfaces, addresses and
  devices at both ends, transport, gate p50/p99 and bulk bandwidth.

Needs root and `ip netns`, as tests/test_discovery_link.py: where namespaces cannot be made the
tests FAIL with the reason. Addresses live only inside the namespaces the tests create and delete.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from faultutil import Watched
from pairutil import REPO, reference_text
from test_discovery_link import Bridge, finished_text, ip

PROMPT = "the cables"
TOKENS = 6
PORT = 9911  # the namespaces are fresh: nothing else listens there
TIMEOUT = 120.0  # DS4_TP_TIMEOUT_SEC: a busy 2-core machine starts MLX slowly
SECRET = "wiring-test-secret"  # the LAN is open: the group proves a secret there


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    # 8 KV heads: splits over three ranks.
    return save_llama(tmp_path_factory.mktemp("wiring") / "llama", "tiny8", seed=3)


class Cables:
    """Veth "cables" between the namespaces of a Bridge: cable (a, b) is interface `name(a, b)`
    in namespace a and `name(b, a)` in b (names that differ per end), on 10.234.K.0/30."""

    def __init__(self, bridge: Bridge, pairs: List[Tuple[int, int]]) -> None:
        self.bridge = bridge
        self.addr: Dict[Tuple[int, int], str] = {}
        for k, (a, b) in enumerate(pairs):
            ip("link", "add", self.name(a, b), "netns", bridge.ns[a], "type", "veth",
               "peer", "name", self.name(b, a), "netns", bridge.ns[b])
            for end, host in ((a, 1), (b, 2)):
                other = b if end == a else a
                self.addr[(end, other)] = f"10.234.{k}.{host}"
                ip("-n", bridge.ns[end], "addr", "add", f"10.234.{k}.{host}/30", "dev", self.name(end, other))
                ip("-n", bridge.ns[end], "link", "set", self.name(end, other), "up")
        self.pairs = pairs

    def name(self, mine: int, theirs: int) -> str:
        return f"c{mine}{theirs}{self.bridge.tag}"

    def of(self, rank: int) -> List[str]:
        """The interfaces of rank `rank`'s cables."""
        return [self.name(rank, b if a == rank else a) for a, b in self.pairs if rank in (a, b)]

    def tx_bytes(self, rank: int, dev: str) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.bridge.ns[rank], "cat",
                              f"/sys/class/net/{dev}/statistics/tx_bytes"],
                             capture_output=True, text=True, timeout=30, check=True)
        return int(out.stdout)


def spawn(procs, bridge: Bridge, cables: Cables, rank: int, model: Path, *flags: str) -> Watched:
    """`ds4tp run` as rank `rank` in its namespace: the leader's LAN address, ucsim, its cables
    (model None: `ds4tp doctor` instead, --listen on the leader and --peer on the others)."""
    size = str(len(bridge.ns))
    lan = [bridge.addr[0], str(PORT)]
    if model is None:
        command = ["doctor", *(["--listen", *lan, "--ranks", size] if rank == 0 else ["--peer", *lan])]
    else:
        command = ["run", "--model", str(model), "--max-tokens", str(TOKENS), "--no-chat-template",
                   *(["--prompt", PROMPT, "--role", "leader", "--listen", *lan, "--ranks", size] if rank == 0
                     else ["--role", "worker", "--coordinator", *lan])]
    interfaces = [x for name in cables.of(rank) for x in ("--interface", name)]
    argv = ["ip", "netns", "exec", bridge.ns[rank], sys.executable, "-m", "mlx_ds4tp", *command,
            "--rdma-device", "ucsim", *interfaces, *flags]
    env = dict(os.environ, DS4_TP_SECRET=SECRET, DS4_TP_TIMEOUT_SEC=str(TIMEOUT), PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(p)
    return Watched(p, f"rank {rank} in {bridge.ns[rank]}")


def start(procs, bridge: Bridge, cables: Cables, model: Optional[Path], *flags: str, leader_flags=()) -> List[Watched]:
    """Every rank, the workers one after the other so that namespace i is rank i (the leader
    numbers its workers in the order they join)."""
    size = len(bridge.ns)
    ranks = [spawn(procs, bridge, cables, 0, model, *flags, *leader_flags)]
    for r in range(1, size):
        if r > 1:
            ranks[0].err.wait_for(f"joined ({r - 1} of the {size - 1} other ranks", 120.0, ranks[0].proc)
        ranks.append(spawn(procs, bridge, cables, r, model, *flags))
    return ranks


def describe(ranks: List[Watched]) -> str:
    return "\n".join(r.describe() for r in ranks)


def assert_cables_outgrew_the_lan(cables, bridge, before, ranks: List[Watched]) -> None:
    """Every cable's sent-bytes counter grew, since `before`, by more than any rank's LAN end."""
    grown = {key: cables.tx_bytes(*key) - n for key, n in before.items()}
    lan = max(grown[(r, bridge.dev[r])] for r in range(len(ranks)))
    print(f"\nbytes sent during the run, per interface (rank, interface): {grown}")
    for r in range(len(ranks)):
        for dev in cables.of(r):
            assert grown[(r, dev)] > lan, (grown, describe(ranks))


def exited(rank: Watched, others: List[Watched], within: float = 180.0) -> int:
    if rank.wait_exit(within) is None:
        pytest.fail(f"{rank.name} did not exit\n{describe(others)}")
    return rank.proc.returncode


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_three_ranks_cabled_as_a_full_mesh_run_each_link_on_its_own_cable(procs, bridge, model):
    cables = Cables(bridge, [(0, 1), (0, 2), (1, 2)])
    before = {(r, dev): cables.tx_bytes(r, dev) for r in range(3) for dev in (*cables.of(r), bridge.dev[r])}
    ranks = start(procs, bridge, cables, model, "--transport", "rdma")
    assert finished_text(ranks[0], ranks[1:]) == reference_text(model, PROMPT, TOKENS)[0]
    for r in ranks[1:]:
        assert exited(r, ranks) == 0, describe(ranks)
    for a, b in cables.pairs:
        for me, peer in ((a, b), (b, a)):
            said = ranks[me].err.text()
            line = (f"link rank {a} <-> rank {b} up on the cable {cables.name(me, peer)} "
                    f"{cables.addr[(me, peer)]} <-> {cables.name(peer, me)} {cables.addr[(peer, me)]}, "
                    f"transport rdma, device ucsim:{cables.name(me, peer)}")
            assert line in said, describe(ranks)
    # Each cable carried its link's gates (ucsim's datagrams and the link's sockets), the LAN
    # only the JOINs.
    assert_cables_outgrew_the_lan(cables, bridge, before, ranks)


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_three_ranks_found_by_discovery_on_their_cables_alone_run_each_link_on_its_cable(procs, bridge, model):
    cables = Cables(bridge, [(0, 1), (0, 2), (1, 2)])
    lan = {r: cables.tx_bytes(r, bridge.dev[r]) for r in range(3)}
    before = {(r, dev): cables.tx_bytes(r, dev) for r in range(3) for dev in cables.of(r)}
    ranks = []
    for r in range(3):  # no address: each finds the others on its cables (--interface), the LAN not named
        interfaces = [x for name in cables.of(r) for x in ("--interface", name)]
        argv = ["ip", "netns", "exec", bridge.ns[r], sys.executable, "-m", "mlx_ds4tp", "run", "--model",
                str(model), "--max-tokens", str(TOKENS), "--no-chat-template", "--ranks", "3",
                "--transport", "rdma", "--rdma-device", "ucsim", *interfaces,
                *(["--prompt", PROMPT] if r == 0 else [])]
        env = dict(os.environ, DS4_TP_SECRET=SECRET, DS4_TP_TIMEOUT_SEC=str(TIMEOUT), PYTHONUNBUFFERED="1",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.procs.append(p)
        ranks.append(Watched(p, f"discovering rank in {bridge.ns[r]}"))
    assert finished_text(ranks[0], ranks[1:]) == reference_text(model, PROMPT, TOKENS)[0]
    for r in ranks[1:]:
        assert exited(r, ranks) == 0, describe(ranks)
    for r in ranks:
        assert r.err.text().count(" up on the cable ") == 2, describe(ranks)
        assert r.err.text().count("transport rdma, device ucsim:c") == 2, describe(ranks)
    grown = {key: cables.tx_bytes(*key) - n for key, n in before.items()}
    quiet = max(cables.tx_bytes(r, bridge.dev[r]) - lan[r] for r in range(3))
    print(f"\nbytes sent during the run, per cable (rank, interface): {grown}; the LAN's most: {quiet}")
    assert all(n > quiet for n in grown.values()), (grown, quiet, describe(ranks))


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_doctor_prints_the_wiring_table_of_a_cabled_mesh(procs, bridge):
    cables = Cables(bridge, [(0, 1), (0, 2), (1, 2)])
    doctors = start(procs, bridge, cables, None, "--transport", "rdma")
    for me, d in enumerate(doctors):
        assert exited(d, doctors) == 0, describe(doctors)
        out = d.out.text()
        for peer in (p for p in range(3) if p != me):
            mine, theirs = cables.name(me, peer), cables.name(peer, me)
            row = (f"[  ok] wiring rank {me} <-> rank {peer}: rank {me} {mine} {cables.addr[(me, peer)]} "
                   f"ucsim:{mine} <-> rank {peer} {theirs} {cables.addr[(peer, me)]} ucsim:{theirs}; "
                   "transport rdma; gate 16 KiB p50 ")
            assert row in out and "GB/s" in out, describe(doctors)
        print(f"\n{d.name}:\n" + "\n".join(x for x in out.splitlines() if "wiring" in x))


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_a_missing_cable_stops_rdma_on_every_rank_naming_the_two_ranks(procs, bridge, model):
    cables = Cables(bridge, [(0, 1), (0, 2)])
    ranks = start(procs, bridge, cables, model, "--transport", "rdma")
    for r in ranks:
        assert exited(r, ranks) != 0, describe(ranks)
        said = r.err.text()
        assert "--transport rdma cannot cable this group: rank 1 and rank 2 share no cable" in said, describe(ranks)
        assert f"rank 1 looked on {cables.name(1, 0)} " in said, describe(ranks)
        assert f"rank 2 looked on {cables.name(2, 0)} " in said, describe(ranks)
        assert "Traceback" not in said, describe(ranks)


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_auto_runs_rdma_on_the_cables_and_tcp_where_there_is_none(procs, bridge, model):
    cables = Cables(bridge, [(0, 1), (0, 2)])
    ranks = start(procs, bridge, cables, model, "--transport", "auto")
    assert finished_text(ranks[0], ranks[1:]) == reference_text(model, PROMPT, TOKENS)[0]
    for r in ranks[1:]:
        assert exited(r, ranks) == 0, describe(ranks)
    for r in (1, 2):
        said = ranks[r].err.text()
        assert f"link rank 0 <-> rank {r} up on the cable" in said and "transport rdma" in said, describe(ranks)
        assert "link rank 1 <-> rank 2: rank 1 and rank 2 share no cable" in said, describe(ranks)
        assert "link rank 1 <-> rank 2 up, transport tcp" in said, describe(ranks)


@pytest.mark.parametrize("bridge", [4], indirect=True)
def test_four_ranks_cabled_as_a_ring_run_auto_rdma_on_the_ring_and_tcp_on_the_diagonals(procs, bridge, model):
    cables = Cables(bridge, [(0, 1), (1, 2), (2, 3), (0, 3)])
    ranks = start(procs, bridge, cables, model, "--transport", "auto")
    assert finished_text(ranks[0], ranks[1:]) == reference_text(model, PROMPT, TOKENS)[0]
    for r in ranks[1:]:
        assert exited(r, ranks) == 0, describe(ranks)
    for a, b in cables.pairs:
        for me in (a, b):
            said = ranks[me].err.text()
            assert f"link rank {a} <-> rank {b} up on the cable {cables.name(me, b if me == a else a)}" in said
            assert f"device ucsim:{cables.name(me, b if me == a else a)}" in said, describe(ranks)
    for a, b in ((0, 2), (1, 3)):
        for me in (a, b):
            said = ranks[me].err.text()
            assert f"link rank {a} <-> rank {b}: rank {a} and rank {b} share no cable" in said, describe(ranks)
            assert f"link rank {a} <-> rank {b} up, transport tcp" in said, describe(ranks)


@pytest.mark.parametrize("bridge", [4], indirect=True)
def test_four_ranks_cabled_as_a_ring_run_rdma_round_the_ring_alone(procs, bridge, model):
    cables = Cables(bridge, [(0, 1), (1, 2), (2, 3), (0, 3)])
    before = {(r, dev): cables.tx_bytes(r, dev) for r in range(4) for dev in (*cables.of(r), bridge.dev[r])}
    ranks = start(procs, bridge, cables, model, "--transport", "rdma")
    assert finished_text(ranks[0], ranks[1:]) == reference_text(model, PROMPT, TOKENS)[0]
    for r in ranks[1:]:
        assert exited(r, ranks) == 0, describe(ranks)
    assert "transport rdma" in ranks[0].out.text().strip().splitlines()[-1], describe(ranks)
    for me in range(4):
        said = ranks[me].err.text()
        assert "the cables form the ring 0-1-2-3: --transport rdma runs every collective round its RDMA links" in said
        for a, b in cables.pairs:
            if me in (a, b):
                peer = b if me == a else a
                low, high = min(a, b), max(a, b)
                assert (f"link rank {low} <-> rank {high} up on the cable {cables.name(me, peer)}" in said
                        and f"device ucsim:{cables.name(me, peer)}" in said), describe(ranks)
        for a, b in ((0, 2), (1, 3)):
            if me in (a, b):
                assert (f"link rank {a} <-> rank {b}: rank {a} and rank {b} share no cable" in said
                        and "for the leader's commands only: the collectives go round the ring of cables "
                        "0-1-2-3" in said and f"link rank {a} <-> rank {b} up, transport tcp" in said), describe(ranks)
    # Every gate went round the cables; the LAN carried the JOINs, the diagonal links' hellos
    # and the leader's commands to rank 2 only.
    assert_cables_outgrew_the_lan(cables, bridge, before, ranks)


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_rdma_devices_naming_the_other_cable_is_refused(procs, bridge, model):
    cables = Cables(bridge, [(0, 1), (0, 2), (1, 2)])
    swapped = f"1=ucsim:{cables.name(0, 2)},2=ucsim:{cables.name(0, 1)}"
    ranks = start(procs, bridge, cables, model, "--transport", "rdma", leader_flags=("--rdma-devices", swapped))
    assert exited(ranks[0], ranks) != 0, describe(ranks)
    said = ranks[0].err.text()
    assert (f"--rdma-devices 1=ucsim:{cables.name(0, 2)}: the cable to rank 1 is on interface "
            f"{cables.name(0, 1)}") in said, describe(ranks)
    assert "a swapped cable" in said and "Traceback" not in said, describe(ranks)
    for r in ranks[1:]:
        assert exited(r, ranks) != 0, describe(ranks)
        # The leader's end of their JOIN closed: they stop dialing its links then, not at the timeout.
        assert "the mesh's leader ended or gave up its bring-up" in r.err.text(), describe(ranks)
