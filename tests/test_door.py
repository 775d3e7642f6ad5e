"""A group rank's door (link/door.py) and the group's membership (link/mesh.py), for any N, 2
included: what the one listener lets in and what it refuses, how ranks are given out, and the
errors for bad size and rank values. The ranks run as threads of this process on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest

import mlx_ds4tp as tp
from mlx_ds4tp.errors import HelloMismatchError, TransportError, TransportTimeoutError
from mlx_ds4tp.link.control import ControlChannel
from mlx_ds4tp.link.door import Door
from mlx_ds4tp.link.hello import Hello
from mlx_ds4tp.link.mesh import assign_ranks
from mlx_ds4tp.link.wire import (
    FRAME_HEADER,
    MAGIC,
    MESH_ID_PAYLOAD,
    PROTOCOL_VERSION,
    WORKER,
    FrameType,
)
from pairutil import dial_when_listening, free_port


class Ranks:
    """tp.init calls in threads; each one's group or exception, by name."""

    def __init__(self) -> None:
        self.out: Dict[str, object] = {}
        self.threads: List[threading.Thread] = []

    def start(self, name: str, **kw) -> None:
        def run() -> None:
            try:
                self.out[name] = tp.init(timeout=20.0, **kw)
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                self.out[name] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, within: float = 60.0) -> Dict[str, object]:
        deadline = time.monotonic() + within
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a rank hung"
        return self.out

    def close(self) -> None:
        for value in self.out.values():
            if hasattr(value, "close"):
                value.close()


def leader(port: int, size: int, **kw) -> dict:
    return dict(role="leader", listen=("127.0.0.1", port), transport="tcp", size=size, **kw)


def worker(port: int, size: Optional[int], rank: Optional[int] = None, **kw) -> dict:
    return dict(role="worker", coordinator=("127.0.0.1", port), transport="tcp", size=size, rank=rank, **kw)


def test_ranks_asked_come_first_the_rest_in_join_order():
    assert assign_ranks([-1, 3, -1], 4) == [1, 3, 2]
    assert assign_ranks([2, -1, -1], 4) == [2, 1, 3]
    assert assign_ranks([-1, -1], 3) == [1, 2]


def test_a_stranger_and_a_bad_secret_are_refused_and_the_mesh_still_forms():
    port = free_port()
    ranks = Ranks()
    try:
        ranks.start("leader", **leader(port, 3, secret="s3cret"))
        # A stranger (not our frames) and a worker with another secret knock first.
        stranger = dial_when_listening(port)
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
        ranks.start("intruder", **worker(port, 3, secret="wrong"))
        ranks.threads[-1].join(20)
        assert isinstance(ranks.out["intruder"], TransportError), ranks.out["intruder"]
        assert "authentication failed" in str(ranks.out["intruder"])
        ranks.start("w1", **worker(port, 3, secret="s3cret"))
        ranks.start("w2", **worker(port, 3, secret="s3cret"))
        out = ranks.join()
        groups = [out[n] for n in ("leader", "w1", "w2")]
        assert all(isinstance(g, tp.Group) for g in groups), groups
        assert sorted(g.rank() for g in groups) == [0, 1, 2]
        stranger.close()
    finally:
        ranks.close()


def test_an_asked_rank_is_given_and_a_second_ask_for_it_refused():
    port = free_port()
    ranks = Ranks()
    try:
        ranks.start("leader", **leader(port, 3))
        dial_when_listening(port).close()
        ranks.start("first", **worker(port, 3, rank=1))
        time.sleep(1.0)  # the first joins first (the JOIN is its first word)
        ranks.start("again", **worker(port, 3, rank=1))
        ranks.threads[-1].join(20)
        assert isinstance(ranks.out["again"], TransportError), ranks.out["again"]
        assert "rank 1 was asked for by a worker that joined first" in str(ranks.out["again"])
        ranks.start("any", **worker(port, 3))
        out = ranks.join()
        assert out["first"].rank() == 1 and out["any"].rank() == 2 and out["leader"].rank() == 0
    finally:
        ranks.close()


def test_a_worker_given_another_size_or_a_pair_is_refused_naming_both_sizes():
    port = free_port()
    ranks = Ranks()
    try:
        ranks.start("leader", **leader(port, 3))
        dial_when_listening(port).close()
        for name, size in (("four", 4), ("pair", 2)):
            ranks.start(name, **worker(port, size))
            ranks.threads[-1].join(20)
            assert isinstance(ranks.out[name], HelloMismatchError), ranks.out[name]
            assert (f"the group has 3 ranks and this rank was started for {size}; give every rank "
                    "--ranks 3") in str(ranks.out[name])
        ranks.start("w1", **worker(port, 3))
        ranks.start("w2", **worker(port, 3))
        out = ranks.join()
        assert out["leader"].size() == 3
    finally:
        ranks.close()


def test_workers_without_a_size_join_a_mesh_of_three_and_rejoin_it_with_that_size():
    port = free_port()
    ranks = Ranks()
    try:
        ranks.start("leader", **leader(port, 3))
        ranks.start("w1", **worker(port, None))
        ranks.start("w2", **worker(port, None, rank=2))
        out = ranks.join()
        groups = [out[n] for n in ("leader", "w1", "w2")]
        assert all(isinstance(g, tp.Group) for g in groups), groups
        assert [(g.rank(), g.size()) for g in groups] == [(0, 3), (1, 3), (2, 3)]
        # The group keeps the size it learned: every rank re-forms the mesh with it.
        for g in groups:
            g.close()
        again: Dict[str, object] = {}
        threads = [threading.Thread(target=_reconnect, args=(g, name, again), daemon=True)
                   for name, g in zip(("leader", "w1", "w2"), groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a rank hung re-forming the mesh"
        assert [(g.rank(), g.size()) for g in (again[n] for n in ("leader", "w1", "w2"))] == \
            [(0, 3), (1, 3), (2, 3)], again
    finally:
        ranks.close()


def _reconnect(group, name: str, out: Dict[str, object]) -> None:
    try:
        out[name] = tp.reconnect(group)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out[name] = exc


def test_a_worker_without_a_size_joins_a_pair_leader_as_its_pair():
    port = free_port()
    ranks = Ranks()
    try:
        ranks.start("leader", role="leader", listen=("127.0.0.1", port), transport="tcp")
        ranks.start("worker", **worker(port, None))
        out = ranks.join()
        assert all(isinstance(out[n], tp.Group) for n in ("leader", "worker")), out
        assert (out["leader"].rank(), out["worker"].rank(), out["worker"].size()) == (0, 1, 2)
    finally:
        ranks.close()


def test_a_pair_forms_at_the_door_as_any_group_and_a_worker_without_a_size_says_the_same():
    """Two ranks form as N do (JOIN, ROSTER, MESH_ID, one link's hellos); a worker started
    without a size sends exactly the frames one given size 2 sends (the ROSTER tells it)."""
    from collections import Counter

    sent: List[str] = []
    send = ControlChannel.send

    def recording_send(self, ftype, payload=b""):
        sent.append(FrameType(ftype).name)
        return send(self, ftype, payload)

    seen = {}
    for size in (2, None):
        sent.clear()
        port = free_port()
        ranks = Ranks()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ControlChannel, "send", recording_send)
            try:
                ranks.start("leader", role="leader", listen=("127.0.0.1", port), transport="tcp")
                ranks.start("worker", **worker(port, size))
                out = ranks.join()
                assert out["worker"].size() == 2 and out["worker"].rank() == 1, out
            finally:
                ranks.close()
        seen[size] = Counter(sent)
    assert seen[2]["JOIN"] == 1 and seen[2]["ROSTER"] == 1 and seen[2]["HELLO"] == 2, seen
    assert seen[None] == seen[2], seen


def test_a_mesh_worker_dialing_a_pair_leader_is_told_both_sizes_and_the_leader_waits_on():
    port = free_port()
    ranks = Ranks()
    try:
        ranks.start("leader", role="leader", listen=("127.0.0.1", port), transport="tcp")
        ranks.start("three", **worker(port, 3))
        ranks.threads[-1].join(20)
        assert isinstance(ranks.out["three"], HelloMismatchError), ranks.out["three"]
        assert "the group has 2 ranks and this rank was started for 3" in str(ranks.out["three"])
        ranks.start("two", **worker(port, None, rank=2))
        ranks.threads[-1].join(20)
        assert "rank 2 is not a worker's rank of a group of 2 (1 .. 1)" in str(ranks.out["two"])
        ranks.start("pair", **worker(port, None))
        out = ranks.join()
        assert out["leader"].size() == 2 and out["pair"].rank() == 1
    finally:
        ranks.close()


def _door_answer(door: Door, hello: Hello) -> Tuple[FrameType, bytes]:
    """What a gathering door answers to `hello` (a rank that said hello where ranks JOIN)."""
    threading.Thread(target=lambda: _swallow_join(door), daemon=True).start()
    sock = socket.create_connection(("127.0.0.1", door.port), timeout=5)
    try:
        channel = ControlChannel(sock, 5.0)
        channel.send(FrameType.HELLO, hello.pack())
        return channel.recv(timeout=5.0)
    finally:
        sock.close()


def _swallow_join(door: Door) -> None:
    try:
        door.next_join(time.monotonic() + 3.0)
    except (TransportError, OSError):
        pass


def _hello(**kw) -> Hello:
    return Hello(role=WORKER, transport="tcp", rdma_ok=False, rdma_reason="", session_id=0,
                 identity=tp.ModelIdentity(), **kw)


def test_a_hello_at_a_gathering_door_is_refused_naming_the_versions():
    door = Door("127.0.0.1", 0, 4, hello_timeout=2.0)
    try:
        # A pair's worker of protocol 13 said hello first: told the versions.
        with pytest.raises(TransportError, match=f"the dialing rank speaks 13, this rank {PROTOCOL_VERSION}"):
            _door_answer(door, _hello(version=13))
        with pytest.raises(TransportError, match="where a group's rank JOINs first"):
            _door_answer(door, _hello())
    finally:
        door.close()


def test_a_hello_once_the_group_has_its_workers_is_refused():
    door = Door("127.0.0.1", 0, 3, hello_timeout=2.0)
    door.mesh_id = b"A" * 16
    try:
        threading.Thread(target=lambda: _swallow(door), daemon=True).start()
        sock = socket.create_connection(("127.0.0.1", door.port), timeout=5)
        channel = ControlChannel(sock, 5.0)
        channel.send(FrameType.HELLO, _hello().pack())
        with pytest.raises(TransportError, match="where a group's rank JOINs first"):
            channel.recv(FrameType.HELLO)
        sock.close()
    finally:
        door.close()


def test_a_link_from_a_stale_mesh_is_refused_at_the_door():
    door = Door("127.0.0.1", 0, 3, hello_timeout=2.0)
    door.mesh_id = b"A" * 16
    try:
        result: dict = {}

        def wait() -> None:
            try:
                door.accept(time.monotonic() + 3.0, "control", None, 1)
            except BaseException as exc:  # noqa: BLE001
                result["exc"] = exc

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        sock = socket.create_connection(("127.0.0.1", door.port), timeout=5)
        channel = ControlChannel(sock, 5.0)
        channel.send(FrameType.MESH_ID, MESH_ID_PAYLOAD.pack(b"B" * 16, 1))
        with pytest.raises(TransportError, match="earlier mesh"):
            channel.recv(FrameType.HELLO)
        sock.close()
        t.join(10)
        assert isinstance(result.get("exc"), TransportTimeoutError), result
    finally:
        door.close()


def test_a_join_once_the_mesh_is_formed_is_refused():
    door = Door("127.0.0.1", 0, 3, hello_timeout=2.0)
    door.mesh_id = b"A" * 16
    try:
        threading.Thread(target=lambda: _swallow(door), daemon=True).start()
        sock = socket.create_connection(("127.0.0.1", door.port), timeout=5)
        sock.sendall(FRAME_HEADER.pack(MAGIC, int(FrameType.JOIN), 0))
        channel = ControlChannel(sock, 5.0)
        with pytest.raises(TransportError):
            channel.recv(FrameType.ROSTER)
        sock.close()
    finally:
        door.close()


def _swallow(door: Door) -> None:
    try:
        door.accept(time.monotonic() + 3.0, "control", None, 1)
    except (TransportError, OSError):
        pass


@pytest.mark.parametrize("kw,text", [
    (dict(size=1), "size=1: give the number of ranks, 2 to 8"),
    (dict(size=9), "size=9"),
    (dict(size="3"), "size='3'"),
    (dict(size=3, rank=3), "rank=3: give a rank 0 .. 2"),
    (dict(size=3, rank=0), "rank 0 is the leader"),
    (dict(size=3, rank=True), "rank=True"),
])
def test_bad_size_and_rank_values_are_named(kw, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(".", r"\.")):
        tp.init(role="worker", coordinator=("127.0.0.1", 1), transport="tcp", **kw)


def test_a_leader_asking_for_a_worker_rank_is_named():
    with pytest.raises(ValueError, match="rank 0 is the leader"):
        tp.init(role="leader", listen=("127.0.0.1", 0), transport="tcp", size=3, rank=2)


def test_fault_links_are_checked():
    from mlx_ds4tp.link.config import parse_fault_links

    assert parse_fault_links("2-1, 0-3") == {(1, 2), (0, 3)}
    with pytest.raises(ValueError, match="DS4_TP_UCSIM_FAULT_LINKS"):
        parse_fault_links("1-1")


def test_a_link_that_fails_its_bring_up_names_both_ranks_and_the_device():
    import dataclasses

    from mlx_ds4tp.gate_ops import init_pair
    from mlx_ds4tp.link.config import LinkSettings

    port, out = free_port(), {}

    def rank(r: int) -> None:
        base = LinkSettings.of("leader", listen=("127.0.0.1", port)) if r == 0 else \
            LinkSettings.of("worker", coordinator=("127.0.0.1", port))
        devices = {2: "no-such-device"} if r == 1 else None
        link = dataclasses.replace(base, transport="rdma", rdma_device="ucsim", size=3, timeout=20.0,
                                   ask_rank=None if r == 0 else r, rdma_devices=devices)
        try:
            out[r] = init_pair(link)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for r in (1, 2):
        assert isinstance(out[r], TransportError), out[r]
    assert "rank 1 <-> rank 2 (device no-such-device; on this link the leader is rank 1" in str(out[1]), out[1]
    assert "mesh link rank 1 <-> rank 2 (device ucsim; " in str(out[2]), out[2]
    assert "RDMA is unavailable" in str(out[2]), out[2]  # the peer's cause, as a pair's hello says it
    assert isinstance(out[0], TransportError), out[0]  # the leader's mesh fails with it
    for value in out.values():
        if hasattr(value, "close"):
            value.close()


def test_a_join_dropped_unread_by_a_closing_door_dials_again_and_joins_the_next():
    """A leader forming its group again closes its old door and opens the new one at the same
    port: a JOIN that reached the old one in between is dropped unread. The worker dials again
    (until its timeout) and joins the new group, rather than failing on the closed connection."""
    port = free_port()
    old = socket.create_server(("127.0.0.1", port))
    ranks = Ranks()
    try:
        ranks.start("worker", **worker(port, 2))
        conn, _ = old.accept()  # the worker's JOIN reached the old door ...
        conn.close()  # ... which closes it unanswered
        old.close()
        ranks.start("leader", **leader(port, 2))
        out = ranks.join()
        assert all(isinstance(out[n], tp.Group) for n in ("leader", "worker")), out
        assert (out["worker"].rank(), out["worker"].size()) == (1, 2)
    finally:
        old.close()
        ranks.close()
