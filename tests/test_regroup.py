"""lockstep/regroup.py's arithmetic, no processes: RESIZE packed and checked, the share of the
ranks left, and the memory check that refuses a shrink naming the figures; and a regrouping
leader's door (LinkSettings.regrouping), its ranks as threads on 127.0.0.1: a rank started
again held, never a member's place, and a rank back that never comes given up on at once."""

from __future__ import annotations

import threading
import time

import pytest

import mlx_ds4tp as tp
from mlx_ds4tp import gate_ops
from mlx_ds4tp.errors import FrameError, PeerClosedError, TransportError
from mlx_ds4tp.link.config import LinkSettings, Regrouping, pair_address
from mlx_ds4tp.link.hello import RankFigures
from mlx_ds4tp.lockstep.regroup import Regroup, memory_refusal, share_of
from mlx_ds4tp.split.auto import ModelNeed
from mlx_ds4tp.split.share import EVEN, SplitShare
from pairutil import free_port

GIB = 1 << 30


@pytest.mark.parametrize("regroup", [Regroup(2, 1, EVEN), Regroup(3, 2, SplitShare((2, 1, 1))),
                                     Regroup(8, 7, SplitShare(tuple(range(1, 9))))])
def test_resize_round_trips(regroup):
    assert Regroup.unpack(regroup.pack()) == regroup


@pytest.mark.parametrize("payload, why", [
    (b"\x02", "need"),                                  # too short
    (bytes([2, 0, 0]), "rank 0 of 2"),                  # the leader's rank to a worker
    (bytes([2, 2, 0]), "rank 2 of 2"),                  # past the group
    (bytes([9, 1, 0]), "rank 1 of 9"),                  # past the largest group
    (bytes([2, 1, 2]) + b"\x01\x00", "share parts"),    # parts cut short
    (bytes([2, 1, 3]) + b"\x01\x00" * 3, "share parts"),  # parts for another size
    (bytes([2, 1, 2]) + b"\x01\x00\x00\x00", "nothing"),  # a rank with no part
])
def test_a_bad_resize_is_refused_naming_why(payload, why):
    with pytest.raises(FrameError, match=why):
        Regroup.unpack(payload)


def test_the_share_of_the_ranks_left_is_the_started_one_scaled():
    assert share_of(EVEN, 3, [0, 2]) == EVEN
    assert share_of(SplitShare((2, 1, 1)), 3, [0, 2]) == SplitShare((2, 1))
    assert share_of(SplitShare((2, 1, 1)), 3, [1, 2]) == EVEN
    assert share_of(SplitShare((4, 2, 2)), 3, [0, 1]) == SplitShare((2, 1))
    assert share_of(SplitShare((3, 1)), 2, [0]) == EVEN  # the leader alone holds it all


def test_a_shrink_the_memory_cannot_hold_names_what_is_needed_and_had():
    need = ModelNeed(4 * GIB, 1 * GIB)
    plenty = RankFigures(memory_bytes=64 * GIB, speed=1)
    assert memory_refusal(need, [plenty, plenty], EVEN) is None
    assert memory_refusal(need, [plenty], EVEN) is None
    small = RankFigures(memory_bytes=2 * GIB, speed=1)
    why = memory_refusal(need, [plenty, small], EVEN)
    assert why is not None and "the 2 ranks left cannot hold the model" in why
    assert "rank 1 needs 3.25 GiB and has 2.00 GiB" in why and "rank 0" not in why.split("(rank")[-1], why
    assert "4.00 GiB of weights, 1.00 GiB of KV cache, 10% and 512.0 MiB a rank" in why
    # The leader alone must hold the whole: 5 GiB, 10% and the reserve.
    alone = memory_refusal(need, [RankFigures(memory_bytes=5 * GIB, speed=1)], EVEN)
    assert alone is not None and "the 1 rank left" in alone and "has 5.00 GiB" in alone
    # A rank that measured nothing is not refused for it.
    assert memory_refusal(need, [plenty, RankFigures()], EVEN) is None


def test_shrink_after_is_checked_naming_the_value_and_the_fix(tmp_path, monkeypatch):
    from mlx_ds4tp.cli import build_parser, serve

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("DS4_TP_TIMEOUT_SEC", "20")

    def check(*flags):
        argv = ["serve", "--model", str(model), "--role", "leader", "--listen", "127.0.0.1", "9911", *flags]
        return serve.check_args(build_parser().parse_args(argv))

    assert check().shrink_after == 10.0  # 30, or half the timeout when that is less
    assert check("--shrink-after", "0").shrink_after == 0.0
    assert check("--shrink-after", "2.5").shrink_after == 2.5
    for bad, said in (("-1", "--shrink-after -1: give the seconds"), ("nan", "--shrink-after nan"),
                      ("20", "--shrink-after 20 is not below the timeout"), ("inf", "--shrink-after inf")):
        with pytest.raises(SystemExit) as info:
            check("--shrink-after", bad)
        assert said in str(info.value) and ("or 0 for never" in str(info.value)
                                            or "DS4_TP_TIMEOUT_SEC" in str(info.value)), str(info.value)
    worker = serve.check_args(build_parser().parse_args(
        ["serve", "--model", str(model), "--role", "worker", "--coordinator", "127.0.0.1", "9911"]))
    assert worker.shrink_after == 0.0  # the leader's decides
    # Ranks found by discovery (a pair, or three and more) keep their leader's door once met:
    # any rank may lead, so each keeps the value.
    for ranks in ("2", "3"):
        found = serve.check_args(build_parser().parse_args(
            ["serve", "--model", str(model), "--interface", "lo", "--ranks", ranks, "--shrink-after", "5"]))
        assert found.shrink_after == 5.0, ranks



def _in_thread(out: dict, name: str, make) -> threading.Thread:
    def run() -> None:
        try:
            out[name] = make()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[name] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _leader(port: int, size: int, regrouping: Regrouping):
    link = LinkSettings(pair_address("leader", ("127.0.0.1", port), None), "tcp", timeout=20.0, size=size,
                        regrouping=regrouping)
    return lambda: gate_ops.init_pair(link)


def _worker(port: int, size=None, rank=None):
    return lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), transport="tcp", timeout=20.0,
                           size=size, rank=rank)


def test_a_shrinking_door_holds_a_rank_started_again_and_the_member_takes_its_place(capfd):
    """A rank asking for none (started again) JOINs a shrinking group's door first: held there,
    unanswered; the member told its rank takes that place; the held JOIN is the group's to
    grow with (Door.held), and it dials again once let go: a door gone, it ends with an error."""
    port = free_port()
    out: dict = {}
    threads = [_in_thread(out, "leader", _leader(port, 2, Regrouping()))]
    threads.append(_in_thread(out, "again", _worker(port)))
    deadline = time.monotonic() + 30
    seen = ""
    while "holds the JOIN of a rank started again" not in seen:
        assert time.monotonic() < deadline and "leader" not in out, (seen, out)
        seen += capfd.readouterr().err
        time.sleep(0.05)
    threads.append(_in_thread(out, "member", _worker(port, size=2, rank=1)))
    for thread in threads[::2]:
        thread.join(30)
    leader, member = out["leader"], out["member"]
    try:
        assert not isinstance(leader, BaseException) and not isinstance(member, BaseException), out
        assert member.rank() == 1 and member.size() == 2 and "again" not in out
        assert len(leader.mesh.door.held) == 1
    finally:
        for group in (member, leader):
            if hasattr(group, "close"):
                group.close()  # the held JOIN closed with the door: the rank dials a door gone
    threads[1].join(30)
    assert isinstance(out["again"], TransportError) and "it is gone" in str(out["again"]), out["again"]


def test_a_growing_door_gives_up_on_a_rank_back_that_never_joins():
    """The rank back must JOIN the grown group's door soon after it was let go at the old one
    (it dials again at once): not there by Regrouping.unasked_within, the forming fails naming
    it, well before the connect timeout, and no member is left waiting for it."""
    port = free_port()
    out: dict = {}
    thread = _in_thread(out, "leader", _leader(port, 2, Regrouping(unasked=1, unasked_within=0.5)))
    thread.join(30)
    assert isinstance(out["leader"], PeerClosedError), out
    assert "the rank back did not JOIN this door in time" in str(out["leader"]), out


def test_a_regrouping_takes_as_many_ranks_asking_none_as_it_has_places_for_them():
    assert not Regrouping().takes_unasked([])
    assert Regrouping(unasked=1).takes_unasked([2]) and not Regrouping(unasked=1).takes_unasked([2, -1])


def test_a_rank_that_dies_after_its_join_fails_the_leader_at_once_not_at_the_timeout():
    """A rank that JOINed and died before its link came up (the rank back gone again while the
    grown group forms): its JOIN connection closes, and the leader, waiting at its door for
    that link, fails at once naming it (its connect timeout here is 20 s)."""
    from mlx_ds4tp.link.mesh import form_mesh

    port = free_port()
    out: dict = {}
    leading = _in_thread(out, "leader", _leader(port, 2, Regrouping(unasked=1)))

    def dies_before_its_link(settings, **seams):
        raise TransportError("killed before its link")

    link = LinkSettings(pair_address("worker", None, ("127.0.0.1", port)), "tcp", timeout=20.0, size=None)
    with pytest.raises(TransportError, match="killed before its link"):
        form_mesh(link.resolved(), connect=dies_before_its_link)
    leading.join(30)
    assert isinstance(out["leader"], PeerClosedError), out
    assert "rank 1 closed its JOIN connection before it opened this link: it is gone" in str(out["leader"]), out
