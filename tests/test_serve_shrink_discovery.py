"""`ds4tp serve --shrink-after` on a group found by discovery (serve/resize.py with
serve/held_links.py:Beacon): ranks started with the same command (`--ranks N --interface lo`,
no address anywhere) elect a leader; a worker killed (SIGKILL) and not back within
--shrink-after leaves the ranks left serving the model (a pair: the leader alone); the killed
worker started again with its same command finds the leader's door advertised again (a group
of three's lobby, re-opened while a rank is missing, sends it there; a pair's worker elects
the lone leader, which advertises its door, at once), knocks at the group's door, and the group
grows back, that rank in its place. A group of three shrinks twice, to its leader alone, and
grows back a rank at a time (a rank re-joining by the lobby takes the leader's size). Every
greedy answer, before, while shrunk and after, is the unsplit model's.

Needs root and `ip netns`, as tests/test_discovery_nranks.py (whose namespace, model and rank
helpers it uses): skipped with the reason where this user cannot make namespaces. Prints what
it measured."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from test_discovery_link import wait_for
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


def _resize_lines(leader, transport: str, size: int) -> tuple:
    """The leader's log lines of its one shrink from `size` and its grow back (the seconds each
    took), on `transport`'s links."""
    text = leader.err.text()
    shrink = re.search(rf"shrank from {size} to {size - 1} ranks in ([0-9.]+) s \(([0-9.]+) s since the loss\)", text)
    grow = re.search(rf"grew from {size - 1} to {size} ranks in ([0-9.]+) s", text)
    assert shrink and grow, leader.describe()
    assert f"transport {'rdma' if transport == 'ucsim' else 'tcp'}" in text, leader.describe()
    return shrink, grow


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
    shrink_line, grow_line = _resize_lines(leader, transport, 3)
    print(f"\nserve --ranks 3 by discovery over {transport}, --shrink-after {SHRINK_AFTER}: rank 1 killed: "
          f"serving at 2 {shrunk:.1f} s after the kill (/health polled; "
          f"the leader's shrink {shrink_line[1]} s, "
          f"{shrink_line[2]} s since the loss); restarted: serving at 3 {grown:.1f} s after its start "
          f"(the leader's grow {grow_line[1]} s)")


def _serving_pair(procs, ns: str, cmd, tmp_path, transport) -> tuple:
    """Two `ds4tp serve --ranks 2` started alike (link/meet.py elects the leader), once the
    leader serves: (leader, worker)."""
    ranks = [spawn(procs, ns, cmd, tmp_path, f"rank{i}", transport, ranks=2) for i in range(2)]
    wait_for(ranks, "the pair serving", r"serving .* on http://", within=300)
    leaders = [r for r in ranks if re.search(r"discovery: this machine \(.*\) leads", r.err.text())]
    assert len(leaders) == 1, "\n".join(r.describe() for r in ranks)
    worker = ranks[1 - ranks.index(leaders[0])]
    wait_for([worker], "the worker working for the leader", r"works for it", within=60)
    return leaders[0], worker


class _Asker:
    """A client asking the same greedy completion back to back until stopped: every answer
    must be the unsplit model's, so the one under way when the group grows comes back whole
    (the grow lets it finish) and the ones that arrive meanwhile wait, then are answered."""

    PROMPT, TOKENS = "kept whole while the group grows", 64

    def __init__(self, ns: str, model_dir) -> None:
        from serveutil import reference, text_ids

        self.ns, self.want = ns, reference(model_dir, text_ids(model_dir, self.PROMPT), self.TOKENS)
        self.answers, self.wrong = 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._ask, daemon=True)
        self.thread.start()

    def _ask(self) -> None:
        while not self.stop.is_set():
            code, body = _http(self.ns, "/v1/completions",
                               {"prompt": self.PROMPT, "max_tokens": self.TOKENS, "temperature": 0})
            if code == 200 and body["choices"][0]["text"] == self.want:
                self.answers += 1
            else:
                self.wrong.append((code, body))

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(180)
        assert not self.thread.is_alive(), "a request hung"
        assert self.answers and not self.wrong, (self.answers, self.wrong)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_pair_found_by_discovery_shrinks_to_its_leader_and_grows_back_when_the_worker_is_found_again(
        procs, loop_ns, model, tmp_path, transport):  # noqa: F811 - the fixtures imported above
    cmd = ["serve", "--model", str(model), "--port", "8080", "--max-kv-tokens", "4096",
           "--shrink-after", SHRINK_AFTER]
    leader, worker = _serving_pair(procs, loop_ns, cmd, tmp_path, TRANSPORTS[transport])
    _wait_health(loop_ns, leader, 120, code=200, size=2, started_size=2, state="serving")
    _exact(loop_ns, model, "two Macs")

    worker.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    worker.wait_exit(30)
    # The bound: serving again within --shrink-after + 30 s of the loss.
    _wait_health(loop_ns, leader, float(SHRINK_AFTER) + 30, code=200, size=1, started_size=2,
                 state="serving", shrinks=1)
    shrunk = time.monotonic() - killed
    _exact(loop_ns, model, "the leader alone")
    _exact(loop_ns, model, "two Macs")
    # Serving alone, the leader advertises its door as a leader that must lead.
    assert "discovery: this machine leads its group again" in leader.err.text(), leader.describe()

    asker = _Asker(loop_ns, model)
    again = spawn(procs, loop_ns, cmd, tmp_path, "worker-again", TRANSPORTS[transport], ranks=2)
    started = time.monotonic()
    body = _wait_health(loop_ns, leader, 60, code=200, size=2, started_size=2, state="serving", grows=1)
    grown = time.monotonic() - started
    asker.finish()
    assert body["shrinks"] == 1, body
    _exact(loop_ns, model, "after")
    _exact(loop_ns, model, "two Macs")
    # The restarted worker's election picked the lone leader: it never led a pair of its own.
    assert "works for it" in again.err.text(), again.describe()
    assert not re.search(r"this machine \(.*\) leads", again.err.text()), again.describe()
    shrink_line, grow_line = _resize_lines(leader, transport, 2)
    print(f"\nserve pair by discovery over {transport}, --shrink-after {SHRINK_AFTER}: worker killed: "
          f"serving alone {shrunk:.1f} s after the kill (/health polled; the leader's shrink "
          f"{shrink_line[1]} s, {shrink_line[2]} s since the loss); restarted: serving at 2 {grown:.1f} s "
          f"after its start (the leader's grow {grow_line[1]} s); {asker.answers} answers across the grow, all exact")


def test_a_group_of_three_found_by_discovery_shrinks_twice_and_grows_back_a_rank_at_a_time(
        procs, loop_ns, model, tmp_path):  # noqa: F811 - the fixtures imported above
    cmd = ["serve", "--model", str(model), "--port", "8080", "--max-kv-tokens", "4096",
           "--shrink-after", SHRINK_AFTER]
    by_rank = serving_by_rank(procs, loop_ns, cmd, tmp_path)
    leader = by_rank[0]
    _wait_health(loop_ns, leader, 120, code=200, size=3, started_size=3, state="serving")
    _exact(loop_ns, model, "three Macs")
    for lost, left in ((by_rank[1], 2), (by_rank[2], 1)):
        lost.proc.send_signal(signal.SIGKILL)
        lost.wait_exit(30)
        _wait_health(loop_ns, leader, float(SHRINK_AFTER) + 30, code=200, size=left, started_size=3,
                     state="serving", shrinks=3 - left)
        _exact(loop_ns, model, f"{left} Macs left")
        _exact(loop_ns, model, "three Macs")
    log = leader.err.text()
    assert "shrank from 3 to 2 ranks" in log and "shrank from 2 to 1 ranks" in log, leader.describe()
    # The two started again, one after the other: each finds the lobby and joins with the
    # leader's size (it re-joins a group short of ranks), so the group grows to 2, then to 3.
    for name, size in (("rank1-again", 2), ("rank2-again", 3)):
        again = spawn(procs, loop_ns, cmd, tmp_path, name)
        _wait_health(loop_ns, leader, 60, code=200, size=size, started_size=3, state="serving", grows=size - 1)
        _exact(loop_ns, model, f"{size} Macs again")
        assert f"rank {size - 1} of {size}" in again.err.text(), again.describe()
    assert "grew from 1 to 2 ranks" in leader.err.text() and "grew from 2 to 3 ranks" in leader.err.text()


def test_a_pair_found_by_discovery_that_does_not_shrink_takes_its_worker_back_at_its_door(
        procs, loop_ns, model, tmp_path):  # noqa: F811 - the fixtures imported above
    """--shrink-after 0: the leader waits for its worker (503 meanwhile), forming the pair again
    at the door it found at the start, which it advertises; the worker started again with its
    same command elects it at once and joins there."""
    cmd = ["serve", "--model", str(model), "--port", "8080", "--max-kv-tokens", "4096", "--shrink-after", "0"]
    leader, worker = _serving_pair(procs, loop_ns, cmd, tmp_path, TRANSPORTS["tcp"])
    door = re.search(r"leads; waiting for its worker on lo \(127\.0\.0\.1 port (\d+)\)", leader.err.text())
    assert door, leader.describe()
    _exact(loop_ns, model, "two Macs")
    worker.proc.send_signal(signal.SIGKILL)
    worker.wait_exit(30)
    wait_for([leader], "the leader's door advertised again", rf"leads its group again \(port {door[1]}\)", within=60)
    assert _http(loop_ns, "/health")[0] == 503
    again = spawn(procs, loop_ns, cmd, tmp_path, "worker-again", TRANSPORTS["tcp"], ranks=2)
    started = time.monotonic()
    _wait_health(loop_ns, leader, 60, code=200, size=2, started_size=2, state="serving", shrinks=0)
    back = time.monotonic() - started
    _exact(loop_ns, model, "after")
    assert re.search(rf"found on lo at 127\.0\.0\.1 port {door[1]}\); this machine .* works for it",
                     again.err.text()), again.describe()
    print(f"\nserve pair by discovery, --shrink-after 0: the worker restarted, serving again {back:.1f} s "
          "after its start")


def test_a_rank_started_again_while_its_discovered_group_shrinks_finds_it_after_and_the_group_grows(
        procs, loop_ns, model, tmp_path):  # noqa: F811 - the fixtures imported above
    """Three ranks by discovery; rank 1 killed, and started again with its same command while
    the two left re-form without it (lockstep/regroup.py's test hook holds the survivor back a
    moment so the restarted rank looks during the shrink, when the leader advertises no lobby):
    the survivor takes its own place, the pair serves, then the group grows back to three with
    the restarted rank at rank 1. Every rank alive, every answer exact."""
    from mlx_ds4tp.lockstep.regroup import TEST_WAIT_FILE_ENV

    gate = tmp_path / "the-survivor-may-join"
    cmd = ["serve", "--model", str(model), "--port", "8080", "--max-kv-tokens", "4096",
           "--shrink-after", SHRINK_AFTER]
    by_rank = serving_by_rank(procs, loop_ns, cmd, tmp_path, extra_env={TEST_WAIT_FILE_ENV: str(gate)})
    leader, victim, survivor = by_rank[0], by_rank[1], by_rank[2]
    _wait_health(loop_ns, leader, 120, code=200, size=3, state="serving")
    _exact(loop_ns, model, "three Macs")
    victim.proc.send_signal(signal.SIGKILL)
    victim.wait_exit(30)
    wait_for([leader], "the shrink begun", r"the group shrinks from 3 to 2", within=90)
    again = spawn(procs, loop_ns, cmd, tmp_path, "rank1-again", extra_env={TEST_WAIT_FILE_ENV: str(gate)})
    # It looks while the leader's lobby is closed (the group re-forms): it hears two ranks in a
    # group and none to join, so it waits (or leads a lobby nobody joins) until the leader,
    # short of a rank again, re-opens its lobby.
    wait_for([again], "the restarted rank looking", r"discovery: looking on lo", within=120)
    time.sleep(3)  # not a timing assertion: only that it looks during the shrink, as a user's would
    gate.touch()
    body = _wait_health(loop_ns, leader, 180, code=200, size=3, started_size=3, state="serving", grows=1)
    assert body["shrinks"] == 1, body
    for rank in (leader, survivor, again):
        assert rank.alive(), rank.describe()
    assert "rank 1 of 2 now" in survivor.err.text() and "rank 2 of 3 now" in survivor.err.text(), survivor.describe()
    assert "rank 1 of 3" in again.err.text(), again.describe()
    assert "did not form" not in leader.err.text(), leader.describe()
    assert "this machine is rank 1 of 2 now" not in again.err.text(), again.describe()
    _exact(loop_ns, model, "after")
    _exact(loop_ns, model, "three Macs")
