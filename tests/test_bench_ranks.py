"""`ds4tp bench --ranks`: the N-rank all_sum bench runs its contenders (ours over tcp, MLX's
ring) at each N and prints every record and the ratios; with --ring ours again over each mesh's
ring alone, in the same run; bad --ranks values are named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlx_ds4tp.bench.ranks import check_sizes, ratios, ring_ratios
from pairutil import REPO


def test_the_bench_prints_its_numbers_for_a_tiny_config():
    res = subprocess.run([sys.executable, "-m", "mlx_ds4tp", "bench", "--ranks", "2,3", "--transport",
                          "tcp", "--iters", "30", "--ring", "--json"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    got = {(r["name"], r["ranks"], r["bytes"]) for r in records}
    sizes = (16384, 1 << 20)
    # The ring from N = 3 (a pair's one link is its ring).
    assert got == ({(name, n, b) for name in ("tcp", "mlx-ring") for n in (2, 3) for b in sizes}
                   | {("tcp-ring", 3, b) for b in sizes})
    for rec in records:
        assert rec["p50_us"] > 0 and rec["p99_us"] >= rec["p50_us"], rec
        assert rec["iters"] == (30 if rec["bytes"] == 16384 else 20), rec
    lines = ratios(records)
    assert len(lines) == 6 and all("vs mlx-ring" in line and "x faster" in line for line in lines), lines
    lines = ring_ratios(records)
    assert len(lines) == 2 and all("tcp-ring" in line and "vs the full mesh" in line for line in lines), lines


def test_ring_needs_ranks():
    res = subprocess.run([sys.executable, "-m", "mlx_ds4tp", "bench", "--ring"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert res.returncode != 0 and "--ring times groups of --ranks" in res.stderr, res.stderr


@pytest.mark.parametrize("text", ["1", "2,9", "two", ""])
def test_bad_ranks_are_named(text):
    with pytest.raises(ValueError, match="give group sizes 2 to 8"):
        check_sizes(text)
    assert check_sizes("2, 3,4") == [2, 3, 4]
