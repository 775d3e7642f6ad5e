"""A part's transfer progress (split/transfer_progress.py) and the overlap that carries its bytes
(split/overlap.py): bytes, rate and time left, a log line every few seconds off a terminal; the
overlapped stage's items in order and its error raised in the caller."""

from __future__ import annotations

import pytest

from mlx_ds4tp.split.overlap import Overlap
from mlx_ds4tp.split.transfer_progress import LOG_EVERY_S, TransferProgress


def test_a_log_line_every_few_seconds_with_bytes_rate_and_time_left(capsys):
    now = [100.0]
    progress = TransferProgress("receiving rank 1's part", 10_000_000, tty=False, clock=lambda: now[0])
    now[0] += 1.0
    progress.add(1_000_000)
    assert capsys.readouterr().err == ""  # under LOG_EVERY_S since the start: no line yet
    now[0] += LOG_EVERY_S
    progress.add(2_000_000)
    line = capsys.readouterr().err
    assert line.startswith("ds4-tp: receiving rank 1's part: 3.0 MB of 10.0 MB (30%)")
    assert "500.0 KB/s" in line and "14 s left" in line
    assert progress.done() == pytest.approx(1.0 + LOG_EVERY_S)
    assert "3.0 MB in 6.0 s" in capsys.readouterr().err


def test_a_terminal_gets_a_bar_redrawn_in_place(capsys):
    now = [0.0]
    progress = TransferProgress("sending rank 2's part", 100, tty=True, clock=lambda: now[0])
    now[0] = 1.0
    progress.add(50)
    err = capsys.readouterr().err
    assert err.startswith("\rds4-tp: [###############...............] sending rank 2's part: 50 B of 100 B")


def test_a_terminal_gets_one_line_for_the_parts_sent_at_once(capsys):
    now = [0.0]
    two = TransferProgress("sending rank 2's part", 400, tty=True, clock=lambda: now[0], to_rank=2)
    one = TransferProgress("sending rank 1's part", 100, tty=True, clock=lambda: now[0], to_rank=1)
    try:
        now[0] = 1.0
        two.add(100)
        one.add(50)
        lines = capsys.readouterr().err.split("\r")[1:]
        assert lines[-1].startswith("ds4-tp: sending 2 parts: rank 1 50%, rank 2 25%; "
                                    "150 B of 500 B, 150 B/s, 2 s left")
        one.done()
        now[0] = 2.0
        two.add(100)
        assert "[###############...............] sending rank 2's part" in capsys.readouterr().err
    finally:
        one.close()
        two.close()


def test_the_overlap_keeps_order_and_raises_its_stage_error_in_the_caller():
    seen = []
    with Overlap(seen.append, depth=2) as stage:
        for i in range(50):
            stage.put(i)
        stage.finish()
    assert seen == list(range(50))

    def fail(item):
        raise OSError(f"disk full at {item}")

    with pytest.raises(OSError, match="disk full at 0"):
        with Overlap(fail, depth=1) as stage:
            for i in range(10):
                stage.put(i)
            stage.finish()
