"""A group of N ranks that finds itself: network namespaces joined by one bridge stand in for
Macs on one link, each rank (tests/group_child.py) given only its interface, the group size
and its secret (DS4_TP_SECRET). Three ranks with one secret and a fourth with another, all
with the same model, started together: the three form a group of 3 (ranks 0, 1, 2 once each,
one leader; the mesh made with what discovery found carries an exact all_sum) within the
10 s discovery timeout, and the stranger never joins (it gives up naming what it saw); the
same with the stranger already leading when the three start, and with four ranks. A rank
that joined and was killed is not waited for: the group forms with the next one.

Needs root and `ip netns`, as tests/test_discovery_link.py (whose Bridge it uses): where
namespaces cannot be made the tests FAIL with the reason. Multicast and addresses live only
inside the namespaces the tests create and delete. Each test prints the time it measured.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from faultutil import Watched, wait_all_exit
from pairutil import REPO
from test_discovery_link import Bridge

HERE = Path(__file__).resolve().parent
SECRET, OTHER_SECRET = "group-secret", "a-strangers-secret"
FIND_SEC = 10.0  # the Done-when's bound: discovery's own timeout, so a slower start fails


def spawn(procs, bridge: Bridge, i: int, secret: str, go: Path, size: int = 3,
          timeout: float = FIND_SEC, *more: str) -> Watched:
    env = dict(os.environ, DS4_TP_SECRET=secret, PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["ip", "netns", "exec", bridge.ns[i], sys.executable, str(HERE / "group_child.py"),
            bridge.dev[i], str(size), str(go), str(timeout), *more]
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(p)
    return Watched(p, f"rank in {bridge.ns[i]} ({bridge.addr[i]})")


def ready(ranks: List[Watched], within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all("ready" in r.out.text() for r in ranks):
            return
        if any(not r.alive() for r in ranks):
            break
        time.sleep(0.02)
    pytest.fail("the ranks did not get ready\n" + "\n".join(r.describe() for r in ranks))


def result(rank: Watched) -> dict:
    lines = rank.out.text().strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        pytest.fail(f"no result\n{rank.describe()}")


def finish(ranks: List[Watched], within: float = 120.0) -> List[dict]:
    if None in wait_all_exit(ranks, within):
        pytest.fail("a rank did not finish\n" + "\n".join(r.describe() for r in ranks))
    return [result(r) for r in ranks]


def check_group(results: List[dict], size: int) -> None:
    """One group: ranks 0 .. size-1 once each, the mesh's collectives right on every rank; and
    where the rank kept what discovery found (not init_pair's one call): one leader, the rank
    it was given, the same roster everywhere, naming exactly these ranks."""
    assert sorted(r["rank"] for r in results) == list(range(size)), results
    assert all(r["sum"] == size * (size + 1) / 2 and r["ranks"] == list(range(size)) for r in results), results
    found = [r for r in results if "roster" in r]
    assert all(r["rank"] == r["found_rank"] and r["size"] == size for r in found), results
    assert all((r["role"] == "leader") == (r["rank"] == 0) for r in found), results  # one leader: rank 0
    assert len({json.dumps(r["roster"]) for r in found}) <= 1, results
    if found:
        assert sorted(i for _, _, i in found[0]["roster"]) == sorted(r["instance"] for r in results)


@pytest.mark.parametrize("bridge, stranger_first", [(4, False), (4, True), (5, False)], indirect=["bridge"],
                         ids=["3-together", "3-stranger-leads-first", "4-together"])
def test_ranks_form_a_group_and_a_stranger_with_another_secret_never_joins(procs, bridge, tmp_path, stranger_first):
    # N ranks (3, and 4) and a stranger with the same model and another secret, on one link.
    # Together: all start looking at once. Stranger first: it already leads a group of 3 when
    # the three start, so each of them tries it first and the secret's proof must turn them
    # away, by name, before they find each other.
    size = len(bridge.ns) - 1
    go, go_stranger = tmp_path / "go", tmp_path / ("go-stranger" if stranger_first else "go")
    ranks = [spawn(procs, bridge, i, SECRET, go, size) for i in range(size)]
    stranger = spawn(procs, bridge, size, OTHER_SECRET, go_stranger, size, FIND_SEC + (10 if stranger_first else 0))
    ready([*ranks, stranger])
    if stranger_first:
        go_stranger.write_text("go")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and f"leads a group of {size}" not in stranger.err.text():
            time.sleep(0.02)
        assert f"leads a group of {size}" in stranger.err.text(), stranger.describe()
        time.sleep(0.5)  # its advert in state lead is on the link
    go.write_text("go")
    results = finish(ranks)
    for r, w in zip(results, ranks):
        assert "error" not in r, w.describe()
    check_group(results, size)
    formed = max(r["found_at"] for r in results) - min(r["began"] for r in results)
    meshed = max(r["formed_at"] for r in results) - min(r["began"] for r in results)
    print(f"group of {size} found {formed:.2f} s after the ranks began looking (mesh formed and "
          f"all_sum checked at {meshed:.2f} s)")

    gone = finish([stranger], FIND_SEC + 60)[0]
    assert gone.get("kind") == "not found", stranger.describe()
    assert re.search(rf"could not gather a group of {size} ranks .*missing \d of the {size} ranks", gone["error"]), \
        gone
    # It heard the others (the message names each), and where it proved a secret to one of them
    # it was refused by name (whether it got that far is the start's timing: the others may
    # have formed their group before it tried any of them).
    assert all(f"(instance {r['instance']}) at " in gone["error"] for r in results), gone["error"]
    tried = re.findall(r"refused by / refusing .*?\(instance [0-9a-f]+\): (.*)", stranger.err.text())
    assert all("authentication failed" in t for t in tried), stranger.err.text()
    # None of the group ever took the stranger in: not in a roster, never joined a lobby.
    assert all(gone["instance"] not in {i for _, _, i in r["roster"]} for r in results)
    for w in ranks:
        joined = re.findall(r"discovery: (.*) joined this group", w.err.text())
        assert not any(gone["instance"] in j or bridge.addr[size] in j for j in joined), w.err.text()
        assert all("authentication failed" in t for t in re.findall(r"this leader refused .*", w.err.text())
                   if bridge.addr[size] in t), w.err.text()
        if stranger_first:
            assert re.search(rf"refused by / refusing .* \(instance {gone['instance']}\): authentication failed: "
                             "the leader's proof does not match", w.err.text()), w.err.text()
    if stranger_first:
        assert len(re.findall(r"this leader refused .*authentication failed", stranger.err.text())) == size, \
            stranger.err.text()


@pytest.mark.parametrize("bridge", [4], indirect=True)
def test_a_rank_that_left_is_not_waited_for_and_a_short_group_names_the_missing(procs, bridge, tmp_path):
    # Two ranks of a group of 3: one leads, the other joins its lobby; the one that joined is
    # killed (no goodbye), then two more start: the group forms with them, not waiting for it.
    go = tmp_path / "go"
    first = [spawn(procs, bridge, i, SECRET, go, timeout=60.0) for i in (0, 1)]
    ready(first)
    go.write_text("go")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(re.search(r"joined this group \(1 of 2", w.err.text())
                                                  for w in first):
        time.sleep(0.02)
    lead_i = next((i for i, w in enumerate(first) if "joined this group (1 of 2" in w.err.text()), None)
    assert lead_i is not None, "\n".join(w.describe() for w in first)
    leader, member = first[lead_i], first[1 - lead_i]
    member.signal(signal.SIGKILL)
    assert member.wait_exit(10) is not None
    left = time.monotonic()
    while time.monotonic() < left + 10 and "left this group" not in leader.err.text():
        time.sleep(0.02)
    assert re.search(r"left this group \(its connection closed\); not waiting for it", leader.err.text()), \
        leader.describe()
    go2 = tmp_path / "go2"
    # These two make the group in one call: gate_ops.init_pair with discovering settings.
    later = [spawn(procs, bridge, i, SECRET, go2, 3, 60.0, "init_pair") for i in (2, 3)]
    ready(later)
    go2.write_text("go")
    results = finish([leader, *later])
    check_group(results, 3)
    assert results[0]["role"] == "leader"

    # A group of 3 with only two ranks on the link: both give up at their timeout, naming
    # what they saw and how many were missing (the leader may outlive its member by a moment:
    # then it names that one as left and two missing).
    go3 = tmp_path / "go3"
    short = [spawn(procs, bridge, i, SECRET, go3, timeout=4.0) for i in (0, 1)]
    ready(short)
    go3.write_text("go")
    for r in finish(short):
        assert r.get("kind") == "not found", r
        assert re.search(r"could not gather a group of 3 ranks with this model before the timeout "
                         r"\(4 s\): .*missing [12] of the 3 ranks; heard .*\(instance [0-9a-f]+\)", r["error"]), \
            r["error"]
