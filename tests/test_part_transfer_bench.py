"""bench/part_transfer.py end to end on a tiny model, one run: the part sent twice (the second
time from the leader's memo) and the plain copies, each into a child process; the second start
sends nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_bench_reports_both_transfers_the_plain_copy_and_a_second_start_that_sends_nothing(tmp_path):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    model = save_llama(tmp_path / "model", "tiny", seed=5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "mlx_ds4tp.bench.part_transfer", "--model", str(model), "--runs", "1"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    part_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2  # rank 1 of 2: about half
    assert 0.4 * part_bytes / 1e6 <= report["part_mb"] <= 0.7 * part_bytes / 1e6 + 1, report
    for key in ("part_transfer_mb_s", "part_again_mb_s", "plain_socket_mb_s", "plain_digest_both_sides_mb_s"):
        assert report[key] > 0, (key, report)
    assert report["second_start_sent_bytes"] == 0 and report["second_start_s"] > 0
    assert report["part_restarted_over_plain"] > 0  # a leader started again, from its memo file
    assert report["part_receiver_peak_rss_mb"] > 0 and report["plain_receiver_peak_rss_mb"] > 0
