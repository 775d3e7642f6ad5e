"""A cable pulled out of a running group (issue 57): three ranks in network namespaces cabled
as a full mesh of veth pairs plus a bridge as their LAN (tests/test_wiring.py's Cables), a
generation running with `--transport rdma --rdma-device ucsim`; then one cable goes: one end
set down (the other end loses its carrier, as a Mac's port does when the cable comes out) or
the veth pair deleted. Every rank must stop within 30 s, far inside the gate timeout the ranks
run with (DS4_TP_TIMEOUT_SEC 120), with an error naming the two ranks without a cable now,
never a bare timeout (link/cable_watch.py).

Needs root and `ip netns`, as tests/test_wiring.py: where namespaces cannot be made the tests
FAIL with the reason.
"""

from __future__ import annotations

import time

import pytest

from faultutil import wait_all_exit
from test_discovery_link import ip
from test_wiring import Cables, describe, model, start  # noqa: F401 - model is a fixture

STOPPED_WITHIN = 30.0  # the bound; the gate timeout is 120 s


@pytest.mark.parametrize("bridge", [3], indirect=True)
@pytest.mark.parametrize("pulled,how", [((1, 2), "down"), ((0, 1), "down"), ((0, 2), "delete")])
def test_a_cable_pulled_mid_run_stops_every_rank_naming_the_two_ranks(procs, bridge, model, pulled, how):  # noqa: F811
    cables = Cables(bridge, [(0, 1), (0, 2), (1, 2)])
    ranks = start(procs, bridge, cables, model, "--transport", "rdma", "--max-tokens", "1000000")
    deadline = time.monotonic() + 240
    while not ranks[0].out.text():
        if time.monotonic() > deadline or not all(r.alive() for r in ranks):
            pytest.fail("the group never started decoding\n" + describe(ranks))
        time.sleep(0.05)
    time.sleep(0.5)
    a, b = pulled
    if how == "down":
        ip("-n", bridge.ns[a], "link", "set", cables.name(a, b), "down")
    else:
        ip("-n", bridge.ns[a], "link", "del", cables.name(a, b))
    t_pull = time.monotonic()
    exits = wait_all_exit(ranks, STOPPED_WITHIN + 30)
    stopped = {r.name: (None if t is None else round(t - t_pull, 2)) for r, t in zip(ranks, exits)}
    print(f"\ncable {a}-{b} pulled ({how}): stopped after {stopped}")
    for r, t in zip(ranks, exits):
        assert t is not None and t - t_pull < STOPPED_WITHIN, (stopped, describe(ranks))
        err = r.err.text()
        assert r.proc.returncode != 0 and "Traceback" not in err, describe(ranks)
        last = [line for line in err.splitlines() if "ds4-tp: error:" in line][-1]
        print(f"{r.name}: {last[:300]}")
        assert f"rank {a} and rank {b} have no cable now" in last, describe(ranks)
    for end, peer in ((a, b), (b, a)):  # each end names both interfaces of the cable
        said = ranks[end].err.text()
        assert (f"the cable between rank {end} ({cables.name(end, peer)} {cables.addr[(end, peer)]}) and "
                f"rank {peer} ({cables.name(peer, end)} {cables.addr[(peer, end)]}) stopped") in said, describe(ranks)
