"""A lost Mac under load (bench/shrink.py): three ranks served to 8 clients for 60 s, a worker
killed and started again: every answer the unsplit model's or a clean error, none hung, none
failed while the group grew back; the time from the kill to serving again printed."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm computes the reference answers")

from mlx_ds4tp.bench.shrink import ShrinkLoad, run_load  # noqa: E402


@pytest.mark.parametrize("transport", ["tcp"])
def test_eight_clients_across_a_shrink_and_a_grow(transport):
    record = run_load(ShrinkLoad(seconds=60.0, transport=transport))
    print(f"\n{record}")
    assert record["wrong"] == 0, record["wrong_examples"]
    assert record["hung"] == 0 and record["stuck_clients"] == 0, record
    assert record["exact"] > 0 and record["kill_to_serving_s"] is not None, record
    assert record["restart_to_grown_s"] is not None and record["errors_during_grow"] == 0, record
