"""`ds4tp serve --shrink-after` on a group found by discovery (serve/resize.py with
serve/held_links.py:Beacon): three ranks started with the same command (`--ranks 3
--interface lo`, no address anywhere) elect a leader; a worker killed (SIGKILL) and not back
within --shrink-after leaves the two ranks left serving the model; the killed worker started
again with its same command finds the leader's lobby (re-opened while a rank is missing),
knocks at the group's door, and the group grows back to three, that rank in its place. Every
greedy answer, before, while shrunk and after, is the unsplit model's.

Needs root and `ip netns`, as tests/test_discovery_nranks.py (whose namespace, model and rank
helpers it uses): skipped with the reason where this user cannot make namespaces. Prints what
it measured."""

from __future__ import annotations

import re
import signal
import time

import pytest

from test_discovery_nranks import _exact, _http, loop_ns, model, serving_by_rank, spawn  # noqa: F401

SHRINK_AFTER = "2"
TRANSPORTS = {"tcp": ("--transport", "tcp"), "ucsim": ("--transport", "rdma", "--rdma-device", "ucsim")}


def _wait_health(ns: str, leader, within: float, **want) -> dict:
    """/health's body once every field of `want` has its value (`code`: the status)."""
    deadline = time.monotonic() + within
    code, body = 0, None
    while time.monotonic() < deadline:
        assert leader.alive(), leader.describe()
        code, body = _http(ns, "/health")
        got = {"code": code, **(body if isinstance(body, dict) else {})}
        if all(got.get(k) == v for k, v in want.items()):
            return body
        time.sleep(0.2)
    raise AssertionError(f"/health never showed {want} within {within} s: {code} {body}\n{leader.describe()}")


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_group_found_by_discovery_shrinks_and_grows_back_when_the_rank_is_found_again(
        procs, loop_ns, model, tmp_path, transport):  # noqa: F811 - the fixtures imported above
    cmd = ["serve", "--model", str(model), "--port", "8080", "--max-kv-tokens", "4096",
           "--shrink-after", SHRINK_AFTER]
    by_rank = serving_by_rank(procs, loop_ns, cmd, tmp_path, TRANSPORTS[transport])
    leader, victim, survivor = by_rank[0], by_rank[1], by_rank[2]
    _wait_health(loop_ns, leader, 120, code=200, size=3, started_size=3, state="serving")
    _exact(loop_ns, model, "three Macs")

    victim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    victim.wait_exit(30)
    _wait_health(loop_ns, leader, 180, code=200, size=2, started_size=3, state="serving", shrinks=1)
    shrunk = time.monotonic() - killed
    _exact(loop_ns, model, "two Macs left")
    _exact(loop_ns, model, "three Macs")
    assert survivor.alive() and "rank 1 of 2 now" in survivor.err.text(), survivor.describe()
    # While the group is short of a rank its leader's lobby is open for the lost one.
    assert "discovery: this machine leads its group again" in leader.err.text(), leader.describe()

    again = spawn(procs, loop_ns, cmd, tmp_path, "rank1-again", TRANSPORTS[transport])
    started = time.monotonic()
    body = _wait_health(loop_ns, leader, 300, code=200, size=3, started_size=3, state="serving", grows=1)
    grown = time.monotonic() - started
    assert body["shrinks"] == 1, body
    _exact(loop_ns, model, "after")
    _exact(loop_ns, model, "three Macs")
    assert "re-joins it with the rank left free" in again.err.text(), again.describe()
    assert "rank 1 of 3" in again.err.text(), again.describe()
    assert survivor.alive() and "rank 2 of 3 now" in survivor.err.text(), survivor.describe()
    shrink_line = re.search(r"shrank from 3 to 2 ranks in ([0-9.]+) s \(([0-9.]+) s since the loss\)",
                            leader.err.text())
    grow_line = re.search(r"grew from 2 to 3 ranks in ([0-9.]+) s", leader.err.text())
    assert shrink_line and grow_line, leader.describe()
    assert f"transport {'rdma' if transport == 'ucsim' else 'tcp'}" in leader.err.text(), leader.describe()
    print(f"\nserve --ranks 3 by discovery over {transport}, --shrink-after {SHRINK_AFTER}: rank 1 killed: "
          f"serving at 2 {shrunk:.1f} s after the kill (/health polled; "
          f"the leader's shrink {shrink_line[1]} s, "
          f"{shrink_line[2]} s since the loss); restarted: serving at 3 {grown:.1f} s after its start "
          f"(the leader's grow {grow_line[1]} s)")
