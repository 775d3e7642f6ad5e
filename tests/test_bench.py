"""`ds4tp bench`: the records a user (and the closing notes) rely on."""

from __future__ import annotations

import json
import re

import pytest


def records(out: str):
    return {r["name"]: r for r in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))}


def test_gate_bench_prints_every_record(procs):
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--json", "--iters", "300"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    got = records(out)
    # "tcp" and "rdma-ucsim": the exchange the backend calls (tp_link_exchange on the group's link).
    for name in ("tcp", "raw-floor", "mlx-ring", "rdma-ucsim", "tcp-all_sum", "rdma-ucsim-all_sum"):
        rec = got[name]
        assert rec["bytes"] == 16384 and rec["iters"] == 300
        assert 0 < rec["p50_us"] <= rec["p99_us"]
        assert "samples_us" not in rec
    for name in ("tcp-in-graph", "rdma-ucsim-in-graph"):
        # The in-graph gate's own cost: chains with gates less chains without (MLX's op cost).
        rec = got[name]
        assert rec["bytes"] == 16384 and rec["chain"] == 64 and rec["op_us"] > 0, rec
        assert rec["p50_us"] <= rec["p99_us"], rec
    assert 0 < got["rdma-ucsim"]["warmup_ms"] < 1000
    assert "rdma-ucsim-registered" not in got  # no second send path beside the exchange


def test_model_bench_reports_tok_s_and_token_match(procs, tmp_path):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    path = save_llama(tmp_path / "m", "tiny", seed=5)
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--json", "--model", str(path), "--max-tokens", "6",
                     "--rounds", "2", "--prompt-tokens", "40"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    got = records(out)
    # mlx-lm-tcp / -rdma-ucsim: mlx-lm's own plan and loading over our pair (the MLX backend).
    for name in ("single", "tp2-tcp", "tp2-rdma-ucsim", "mlx-lm-ring", "mlx-lm-tcp", "mlx-lm-rdma-ucsim"):
        rec = got[name]
        assert rec["tok_s"] > 0 and rec["tokens_match"] is True, rec
        # The median of the rounds, each of which is reported.
        assert len(rec["tok_s_rounds"]) == 2 and rec["tok_s"] == round(sum(rec["tok_s_rounds"]) / 2, 2), rec
        # Prompt processing of the same 40-token prompt, timed the same way.
        assert rec["prompt_tokens"] == 40 and rec["prefill_tok_s"] > 0, rec
        assert rec["prefill_tok_s"] == round(sum(rec["prefill_tok_s_rounds"]) / 2, 2), rec
    for name in ("tp2-tcp", "tp2-rdma-ucsim"):
        # The leader's time in exchanges (waits included) is part of each decode token's time,
        # round by round (the medians of the two may come from different rounds: on a loaded
        # machine one round can be several times slower than the other).
        rec = got[name]
        for tok_s, exchange in zip(rec["tok_s_rounds"], rec["exchange_ms_per_token_rounds"]):
            assert 0 < exchange < 1e3 / tok_s, rec
    ceiling = got["tp2-compute-ceiling"]
    assert ceiling["tok_s"] > 0 and ceiling["tokens"] == 6 and ceiling["tokens_match"] is None, ceiling
    assert ceiling["prefill_tok_s"] > 0 and ceiling["prompt_tokens"] == 40, ceiling
    assert "skipped" in ceiling["gates"]


def test_model_bench_text_output_gives_ratios_against_the_baselines_and_the_ceiling(procs, tmp_path):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    path = save_llama(tmp_path / "m", "tiny", seed=6)
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--transport", "tcp", "--model", str(path),
                     "--max-tokens", "4", "--rounds", "1", "--prompt-tokens", "24"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "tokens_match=True" in out
    assert "tp2-compute-ceiling" in out and "(gates skipped: the bound for any transport)" in out
    for phase in ("prefill", "decode"):
        for ratio in ("x single", "x mlx-lm-ring", "x the compute ceiling"):
            assert f"tp2-tcp  {phase} = " in out and ratio in out, (phase, ratio, out)
    # What decode loses to the ceiling, beside the leader's time in exchanges.
    assert re.search(r"tp2-tcp  decode = [0-9.]+x the compute ceiling \([+-][0-9.]+ ms/token; the leader "
                     r"spent [0-9.]+ ms/token in exchanges", out), out
    assert re.search(r"tp2-tcp  prefill .* decode .* exchanges [0-9.]+ ms/token", out), out


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_ranks_run_on_the_cpus_they_are_placed_on():
    import os
    import sys

    from mlx_ds4tp.onehost import localpair

    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1 (this process may use "
                    f"{sorted(os.sched_getaffinity(0))})")
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with localpair.busy_core(1):
        outs = localpair.run_ranks([show, show], cpus=localpair.SLOW_WORKER.cpus, timeout=60)
    assert [o.strip() for o in outs] == ["[0]", "[1]"]


def test_the_busy_core_ends_with_a_bench_killed_by_a_signal(procs):
    import os
    import time

    if 1 not in os.sched_getaffinity(0):
        pytest.skip(f"needs CPU 1 (this process may use {sorted(os.sched_getaffinity(0))})")
    # SIGKILL runs no finally: the busy process must notice its parent is gone by itself.
    bench = procs.spawn(["-c", "import os, time\n"
                               "from mlx_ds4tp.onehost import localpair\n"
                               "with localpair.busy_core(1):\n"
                               "    print(open(f'/proc/self/task/{os.getpid()}/children').read().split()[0])\n"
                               "    time.sleep(600)\n"])
    busy = int(bench.stdout.readline())
    bench.kill()
    bench.wait(timeout=10)

    deadline = time.monotonic() + 10
    while _running(busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(busy):
        os.kill(busy, 9)
        pytest.fail(f"the busy process {busy} outlived its killed bench")


def test_a_bench_killed_with_sigterm_stops_the_ranks_it_started(procs):
    import os
    import signal
    import time

    bench = procs.spawn(["-m", "mlx_ds4tp", "bench", "--serve", "--max-tokens", "256"])
    children = f"/proc/{bench.pid}/task/{bench.pid}/children"
    ranks: list = []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and bench.poll() is None and time.monotonic() < deadline:
        ranks = [int(pid) for pid in open(children).read().split()]
        time.sleep(0.05)
    assert len(ranks) == 2, f"the bench did not start its two serve ranks: {bench.communicate()}"
    try:
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        deadline = time.monotonic() + 15
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if _running(pid)], f"ranks left running; the bench said: {err}"
    finally:
        for pid in ranks:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_bench_rejects_zero_rounds(procs, tmp_path):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    path = save_llama(tmp_path / "m", "tiny", seed=7)
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--model", str(path), "--rounds", "0"])
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "--rounds 0 must be >= 1" in err


def test_bench_rejects_bad_sizes(procs):
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--bytes", "70000"])
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "--bytes 70000 is over the 32768-byte gate limit" in err


def test_plot_writes_a_histogram_png(procs, tmp_path):
    png = tmp_path / "lat.png"
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--transport", "tcp", "--iters", "200",
                     "--plot", str(png)])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "tcp" in out and "raw-floor" in out and "mlx-ring" in out
    # The gate op is also put against its own transport's bare gate.
    assert re.search(r"tcp-all_sum  p50 = .*[0-9.]+x tcp$", out, re.M), out
