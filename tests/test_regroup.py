"""lockstep/regroup.py's arithmetic, no processes: RESIZE packed and checked, the share of the
ranks left, and the memory check that refuses a shrink naming the figures."""

from __future__ import annotations

import pytest

from mlx_ds4tp.errors import FrameError
from mlx_ds4tp.link.hello import RankFigures
from mlx_ds4tp.lockstep.regroup import Regroup, memory_refusal, share_of
from mlx_ds4tp.split.auto import ModelNeed
from mlx_ds4tp.split.share import EVEN, SplitShare

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
