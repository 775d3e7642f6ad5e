"""GET /cluster and GET / (serve/cluster.py, serve/http/cluster_page.py): over a group of three
ranks on 127.0.0.1, /cluster lists the three ranks with their memory figures and the three links
with their transport and gate latencies (the link between the two workers from their RANK_STATS
answers), the page is HTML naming no URL outside the server, and a killed worker is shown down
while the one still alive is shown rejoining."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from mlx_ds4tp.bench.serve import ClusterPoller
from mlx_ds4tp.lockstep.protocol.commands import RankStats
from mlx_ds4tp.serve.cluster import ClusterView, percentiles_ms, share_fractions
from mlx_ds4tp.split.share import SplitShare
from serveutil import API_KEY, ServedPair, build_chat_model, get_raw, post_raw


def test_rank_stats_round_trips_and_refuses_what_is_not_an_object():
    figures = {"rank": 2, "host": "mac-b", "links": [{"peer": 0, "gate_p50_us": 41.5}]}
    assert RankStats.unpack(RankStats.pack(figures)) == (figures,)
    with pytest.raises(Exception, match="not JSON"):
        RankStats.unpack(b"{nope")
    with pytest.raises(Exception, match="expected a JSON object"):
        RankStats.unpack(b"[1, 2]")


def test_percentiles_and_shares():
    assert percentiles_ms([]) == {"p50": None, "p90": None, "p99": None, "count": 0}
    got = percentiles_ms([0.010] * 99 + [1.0])
    assert got["p50"] == 10.0 and got["count"] == 100 and got["p99"] > 10.0
    assert share_fractions(SplitShare(), 3) == [0.3333, 0.3333, 0.3333]
    assert share_fractions(SplitShare.parse("2:1:1"), 3) == [0.5, 0.25, 0.25]


class _Engine:
    def __init__(self, error):
        self.error = error


@pytest.mark.parametrize("error,size,want", [
    (None, 3, ["up", "up", "up"]),
    ("TransportError: rank 2 closed the connection", 3, ["up", "rejoining", "down"]),
    ("TransportError: rank 1 closed the connection", 2, ["up", "down"]),
    ("a gate failed", 3, ["up", "down", "down"]),  # which worker died cannot be told
    ("the connection closed", 2, ["up", "down"])])
def test_a_broken_group_shows_the_named_rank_down(error, size, want):
    view = ClusterView.__new__(ClusterView)
    view.engine, view.size = _Engine(error), size
    assert view._states() == want


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("cluster"), preset="tiny8")


def _cluster(served: ServedPair) -> dict:
    code, body = get_raw(served, "/cluster")
    assert code == 200, body
    return body


def wait_cluster(served: ServedPair, check, within: float, what: str) -> dict:
    """/cluster's body once `check(body)` holds; AssertionError naming `what` past `within` s."""
    deadline = time.monotonic() + within
    while True:
        body = _cluster(served)
        if check(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"/cluster: {what} not within {within} s: {json.dumps(body)[:3000]}\n"
                                 f"{served.log('leader')[-2000:]}")
        time.sleep(0.2)


def worker_rank(served: ServedPair, name: str) -> int:
    """The rank the worker process `name` holds, as its log says."""
    found = re.search(r"rank (\d+)/3 holds its part", served.log(name))
    assert found, served.log(name)[-2000:]
    return int(found.group(1))


def _figures_in(body: dict) -> bool:
    ranks_ok = all(r["memory_total_bytes"] and r["memory_used_bytes"] and r["host"] for r in body["ranks"])
    links_ok = all(link["transport"] and (link["gate_p50_us"] or 0) > 0 for link in body["links"])
    return ranks_ok and links_ok


def test_cluster_lists_three_ranks_and_links_and_a_killed_worker_turns_down(model_dir, tmp_path):
    served = ServedPair(model_dir, tmp_path, ranks=3, env={"DS4_TP_TIMEOUT_SEC": "8"})
    try:
        served.wait_healthy(within=180)
        with urllib.request.urlopen(served.base + "/", timeout=30) as r:  # open: no key
            assert r.headers["Content-Type"].startswith("text/html")
            html = r.read().decode()
        assert "<html" in html and not re.search(r"https?://", html), "the page names a URL outside the server"
        assert get_raw(served, "/cluster", api_key="wrong")[0] == 401
        # Gates run (a request decodes), then the idle engine asks the workers their figures.
        code, answer = post_raw(served, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 8}).encode())
        assert code == 200, answer
        body = wait_cluster(served, _figures_in, 60, "every rank's memory and every link's latency")
        assert body["size"] == 3 and body["up"] and body["error"] is None
        assert [r["rank"] for r in body["ranks"]] == [0, 1, 2]
        assert [r["state"] for r in body["ranks"]] == ["up"] * 3
        assert sum(r["share"] for r in body["ranks"]) == pytest.approx(1, abs=1e-3)
        for rank in body["ranks"]:
            assert 0 < rank["memory_used_bytes"] < rank["memory_total_bytes"], rank
        assert sorted(tuple(link["ranks"]) for link in body["links"]) == [(0, 1), (0, 2), (1, 2)]
        for link in body["links"]:
            assert link["transport"] == "tcp" and link["device"] == "127.0.0.1", link
            assert 0 < link["gate_p50_us"] <= link["gate_p99_us"] and link["gates"] > 0, link
        work = body["work"]
        assert work["ttft_ms"]["count"] == 1 and work["ttft_ms"]["p50"] > 0, work
        assert work["tpot_ms"]["count"] >= 1 and work["sessions_queued"] == 0, work
        # `ds4tp bench --serve --poll-cluster`'s poller reads it as the page does.
        with ClusterPoller(served.base, API_KEY) as poller:
            deadline = time.monotonic() + 30
            while poller.polls < 2 and poller.failure is None and time.monotonic() < deadline:
                time.sleep(0.1)
        assert poller.polls >= 2 and poller.failure is None, (poller.polls, poller.failure)
        victim = worker_rank(served, "worker2")  # the ranks go by the order the workers joined in
        served.kill("worker2")
        t0 = time.monotonic()
        down = wait_cluster(served, lambda b: b["ranks"][victim]["state"] == "down", 10, f"rank {victim} down")
        shown = time.monotonic() - t0
        assert not down["up"] and down["ranks"][0]["state"] == "up", down["ranks"]
        assert down["ranks"][3 - victim]["state"] == "rejoining", down["ranks"]
        assert {tuple(link["ranks"]): link["state"] for link in down["links"]}[(0, victim)] == "down"
        print(f"\n/cluster: rank {victim} shown down {shown:.2f} s after its kill")
    finally:
        served.close()
