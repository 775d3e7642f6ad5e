"""`ds4tp doctor`'s diagnoses of the cables (issue 57; cli/doctor_cables.py, cli/doctor_wiring.py),
each by name with its fix, in network namespaces joined by veth "cables" plus a bridge as the LAN
(tests/test_wiring.py's Cables):

- three ranks, ranks 1 and 2 without a cable between them, rank 2 naming an interface that is
  up without an IPv4 address, and a second cable between ranks 0 and 1 that carries one
  direction only (rank 1's end takes no frame larger than its MTU of 68 bytes, while its own
  frames, fragmented, still arrive): the group forms (auto), every rank prints the whole wiring
  table (all three links: interfaces, devices, transport, gate p50/p99, bulk), the link 1-2 is
  "a missing cable", the bare interface "an interface without an address", the one-way cable
  "a cable that carries one direction only" at the end that hears it;
- three ranks in a full mesh whose rank 0 has the addresses of its two cables swapped: each end
  of those cables says "a swapped cable" (rank 0's naming both of its interfaces);
- a cable whose far end is down: "missing cable".

Needs root and `ip netns`, as tests/test_wiring.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List

import pytest

from faultutil import Watched
from pairutil import REPO
from test_discovery_link import Bridge, ip
from test_wiring import PORT, SECRET, Cables, describe, exited


def doctor(procs, bridge: Bridge, rank: int, interfaces: List[str], timeout: float, *flags: str) -> Watched:
    """`ds4tp doctor` in namespace `rank`: the leader's (rank 0) with --listen, the others --peer."""
    lan = [bridge.addr[0], str(PORT)]
    where = ["--listen", *lan, "--ranks", str(len(bridge.ns))] if rank == 0 else ["--peer", *lan]
    argv = ["ip", "netns", "exec", bridge.ns[rank], sys.executable, "-m", "mlx_ds4tp", "doctor", *where,
            "--rdma-device", "ucsim", *[x for n in interfaces for x in ("--interface", n)], *flags]
    env = dict(os.environ, DS4_TP_SECRET=SECRET, DS4_TP_TIMEOUT_SEC=str(timeout), PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(p)
    return Watched(p, f"doctor {rank} in {bridge.ns[rank]}")


def start_all(procs, bridge: Bridge, interfaces: Dict[int, List[str]], timeout: float, *flags: str) -> List[Watched]:
    """Every rank's doctor, each worker once the one before joined (namespace i is rank i)."""
    size = len(bridge.ns)
    ranks = [doctor(procs, bridge, 0, interfaces[0], timeout, *flags)]
    for r in range(1, size):
        if r > 1:
            ranks[0].err.wait_for(f"joined ({r - 1} of the {size - 1} other ranks", 120.0, ranks[0].proc)
        ranks.append(doctor(procs, bridge, r, interfaces[r], timeout, *flags))
    return ranks


def lines(d: Watched, what: str) -> List[str]:
    return [x for x in d.out.text().splitlines() if x[7:].startswith(what)]


def rows_of(d: Watched, a: int, b: int) -> List[str]:
    """The wiring table's rows for the link between ranks a and b (from either end)."""
    return [x for x in lines(d, "wiring rank ") if f"rank {a} <-> rank {b}:" in x or f"rank {b} <-> rank {a}:" in x]


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_doctor_names_a_missing_cable_a_bare_interface_and_a_one_way_cable(procs, bridge):
    cables = Cables(bridge, [(0, 1), (0, 2)])
    tag = bridge.tag
    bare, bare_peer = f"n2{tag}", f"m2{tag}"  # up, no IPv4 address
    ip("-n", bridge.ns[2], "link", "add", bare, "type", "veth", "peer", "name", bare_peer)
    for dev in (bare, bare_peer):
        ip("-n", bridge.ns[2], "link", "set", dev, "up")
    one0, one1 = f"x01{tag}", f"x10{tag}"  # a second cable 0-1 that carries 0 -> 1 nothing past 68 bytes
    ip("link", "add", one0, "netns", bridge.ns[0], "type", "veth", "peer", "name", one1, "netns", bridge.ns[1])
    ip("-n", bridge.ns[0], "addr", "add", "10.235.0.1/30", "dev", one0)
    ip("-n", bridge.ns[1], "addr", "add", "10.235.0.2/30", "dev", one1)
    ip("-n", bridge.ns[1], "link", "set", one1, "mtu", "68")
    for r, dev in ((0, one0), (1, one1)):
        ip("-n", bridge.ns[r], "link", "set", dev, "up")
    interfaces = {0: cables.of(0) + [one0], 1: cables.of(1) + [one1], 2: cables.of(2) + [bare]}
    doctors = start_all(procs, bridge, interfaces, 120.0, "--transport", "auto")
    for d in doctors:
        assert exited(d, doctors) == 1, describe(doctors)  # the diagnoses FAIL
        out = d.out.text()
        print(f"\n{d.name}:\n" + "\n".join(x for x in out.splitlines() if "wiring" in x or "cable" in x))
        # The whole table on every rank: its three links, each with both ends, gate and bulk.
        for a, b in ((0, 1), (0, 2), (1, 2)):
            rows = rows_of(d, a, b)
            assert len(rows) == 1 and "gate 16 KiB p50 " in rows[0] and "GB/s" in rows[0], describe(doctors)
        row12 = rows_of(d, 1, 2)[0]
        assert row12.startswith("[warn]") and "a missing cable: rank" in row12 and "share no cable" in row12, row12
        for a, b in ((0, 1), (0, 2)):
            row = rows_of(d, a, b)[0]
            assert row.startswith("[  ok]") and "transport rdma" in row and "ucsim:c" in row, row
    bare_line = lines(doctors[2], f"cable {bare}:")
    assert bare_line and bare_line[0].startswith("[FAIL]"), describe(doctors)
    assert "an interface without an address" in bare_line[0] and "ip addr add" in bare_line[0], bare_line
    one_way = lines(doctors[0], f"cable {one0}:")
    assert one_way and one_way[0].startswith("[FAIL]"), describe(doctors)
    assert f"a cable that carries one direction only: {one0} 10.235.0.1/30 hears {one1} 10.235.0.2/30" in one_way[0]
    deaf = lines(doctors[1], f"cable {one1}:")
    assert deaf and deaf[0].startswith("[FAIL]") and "nothing answered" in deaf[0], describe(doctors)
    for r in range(3):
        for name in cables.of(r):
            good = lines(doctors[r], f"cable {name}:")
            assert good and good[0].startswith("[  ok]") and "both ways" in good[0], describe(doctors)


@pytest.mark.parametrize("bridge", [3], indirect=True)
def test_doctor_names_a_swapped_cable_at_both_its_ends(procs, bridge):
    cables = Cables(bridge, [(0, 1), (0, 2), (1, 2)])
    c01, c02 = cables.name(0, 1), cables.name(0, 2)
    # Rank 0's cables changed ports: its port to rank 1 carries the addresses meant for rank 2's
    # cable and the other way round.
    ip("-n", bridge.ns[0], "addr", "flush", "dev", c01)
    ip("-n", bridge.ns[0], "addr", "flush", "dev", c02)
    ip("-n", bridge.ns[0], "addr", "add", f"{cables.addr[(0, 2)]}/30", "dev", c01)
    ip("-n", bridge.ns[0], "addr", "add", f"{cables.addr[(0, 1)]}/30", "dev", c02)
    # The links the addresses pick cannot form over those cables: the doctors give up at their
    # (short) timeout, all started at once, and say why.
    doctors = [doctor(procs, bridge, r, cables.of(r), 20.0, "--transport", "tcp") for r in range(3)]
    for d in doctors:
        assert exited(d, doctors) == 1, describe(doctors)
    for name, other in ((c01, c02), (c02, c01)):
        said = lines(doctors[0], f"cable {name}:")
        assert said and said[0].startswith("[FAIL]") and "a swapped cable" in said[0], describe(doctors)
        assert f"the cables in {name} and {other} are swapped" in said[0], said
    for r, peer in ((1, 0), (2, 0)):
        said = lines(doctors[r], f"cable {cables.name(r, peer)}:")
        assert said and "a swapped cable" in said[0], describe(doctors)
    print("\n" + "\n".join(x for d in doctors for x in d.out.text().splitlines() if "cable" in x))


@pytest.mark.parametrize("bridge", [2], indirect=True)
def test_doctor_names_a_cable_whose_far_end_is_down_a_missing_cable(procs, bridge):
    cables = Cables(bridge, [(0, 1)])
    ip("-n", bridge.ns[1], "link", "set", cables.name(1, 0), "down")
    doctors = [doctor(procs, bridge, r, cables.of(r), 20.0, "--transport", "auto") for r in range(2)]
    for d in doctors:
        assert exited(d, doctors) == 1, describe(doctors)
    near = lines(doctors[0], f"cable {cables.name(0, 1)}:")
    assert near and near[0].startswith("[FAIL]") and "missing cable" in near[0] and "no carrier" in near[0]
    far = lines(doctors[1], f"cable {cables.name(1, 0)}:")
    assert far and "missing cable" in far[0] and "is down" in far[0], describe(doctors)
