"""`ds4tp bench --serve --soak`: a short load run against a served pair on 127.0.0.1, every
answer received in full checked against mlx-lm, bad requests refused with a 4xx, nothing hung;
a worker killed at mid-run and taken back; a running server's --url (loopback only)."""

from __future__ import annotations

import json

import pytest

from serveutil import API_KEY, ServedPair, build_chat_model


def soak_record(out: str, err: str) -> dict:
    """The bench's soak record; a failure names what the bench said on stderr."""
    recs = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    found = [r for r in recs if r["name"] == "soak"]
    assert found, f"the bench printed no soak record; its stderr ends:\n{err[-4000:]}"
    return found[0]


def records(out: str) -> dict:
    return {r["name"]: r for r in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("soak"), seed=11)


def test_soak_checks_answers_counts_bad_requests_and_reports_memory(procs, model_dir):
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--serve", "--soak", "20", "--clients", "4",
                     "--model", str(model_dir), "--max-tokens", "12", "--seed", "3",
                     "--bad-share", "0.15", "--cancel-share", "0.15", "--request-timeout", "60",
                     "--json"])
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err
    rec = soak_record(out, err)
    for key in ("requests", "completed", "cancelled", "bad_requests", "errors", "hung", "mismatches",
                "first_mismatch", "ttft_p50_ms", "ttft_p99_ms", "tok_s", "tok_s_per_minute",
                "rss_leader_start_kib", "rss_leader_end_kib", "rss_leader_ratio",
                "rss_worker_start_kib", "rss_worker_end_kib", "rss_worker_ratio", "failures", "ok"):
        assert key in rec, (key, rec)
    assert rec["ok"] is True and rec["failures"] == [], rec
    assert rec["clients"] == 4 and rec["seconds"] == 20 and rec["variants"] == 16
    # The first variant's prompt reaches the tiny model's whole context with its answer.
    assert rec["context_reach"] == 4096
    assert rec["mismatches"] == 0 and rec["first_mismatch"] is None, rec
    assert rec["hung"] == 0 and "hung" not in rec["errors"], rec
    # Every answer in full is checked, the warm-up's too: each of its 16 variants once, then the
    # fill at full width (whose answers in full are checked as well, its cancels and bad ones not).
    assert rec["completed"] > 0 and rec["checked"] >= rec["completed"] + 16, rec
    assert rec["warmup_requests"] > 16, rec
    assert rec["cancelled"] > 0, rec
    # Every bad request got its 4xx: no other outcome for them.
    assert rec["bad_requests"] > 0 and rec["errors"].get("bad_request_4xx") == rec["bad_requests"], rec
    assert set(rec["errors"]) <= {"bad_request_4xx", "busy"}, rec
    assert 0 < rec["ttft_p50_ms"] <= rec["ttft_p99_ms"], rec
    # One figure per started minute of the run (20 s: one).
    assert len(rec["tok_s_per_minute"]) == 1 and rec["tok_s_per_minute"][0] > 0, rec
    assert rec["tokens"] > 0 and rec["tok_s"] > 0, rec
    for name in ("leader", "worker"):
        start, end = rec[f"rss_{name}_start_kib"], rec[f"rss_{name}_end_kib"]
        assert start > 10_000 and end > 10_000, rec
        assert rec[f"rss_{name}_ratio"] == round(end / start, 3), rec
    assert "restart" not in rec


def test_soak_restart_worker_times_the_outage_and_counts_pair_down(procs, model_dir):
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--serve", "--soak", "16", "--clients", "4",
                     "--model", str(model_dir), "--max-tokens", "12", "--context-length", "1024",
                     "--restart-worker", "--request-timeout", "60", "--json"],
                    env={"DS4_TP_TIMEOUT_SEC": "20"})
    out, err = p.communicate(timeout=240)
    rec = soak_record(out, err)
    restart = rec["restart"]
    assert p.returncode == 0, (rec, err)
    assert rec["ok"] is True, rec
    assert restart["rejoined"] is True and 0 < restart["outage_s"] < 60, rec
    # No answer can end while the pair was seen down: the last 503 probe was sent before it.
    # (outage_s is read by a poll and can land after the first answer.)
    assert 0 < restart["down_seen_s"] <= restart["outage_s"], rec
    assert restart["first_answer_after_kill_s"] >= restart["down_seen_s"], rec
    # The requests caught by the outage are pair_down, expected; the answers around it are
    # still checked against mlx-lm.
    assert rec["pair_down"] == rec["errors"].get("pair_down", 0), rec
    assert rec["mismatches"] == 0 and rec["hung"] == 0 and rec["completed"] > 0, rec


def test_soak_against_a_running_servers_url_with_client_counts(procs, model_dir, tmp_path):
    pair = ServedPair(model_dir, tmp_path)
    try:
        pair.wait_healthy()
        p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--serve", "--soak", "6", "--clients", "3",
                         "--url", pair.base, "--api-key", API_KEY, "--model", str(model_dir),
                         "--max-tokens", "8", "--context-length", "512", "--variants", "6",
                         "--client-counts", "1,2", "--rounds", "1", "--json"])
        out, err = p.communicate(timeout=240)
    finally:
        pair.close()
    assert p.returncode == 0, err
    got = records(out)
    rec = got["soak"]
    assert rec["ok"] is True and rec["mismatches"] == 0 and rec["completed"] > 0, rec
    # The ranks were found behind the URL's port: their memory is reported.
    assert rec["rss_leader_start_kib"] > 10_000 and rec["rss_worker_start_kib"] > 10_000, rec
    for n in (1, 2):
        ours, theirs = got[f"serve-{n}"], got[f"mlx-lm-server-{n}"]
        assert ours["clients"] == theirs["clients"] == n and ours["tok_s"] > 0 < theirs["tok_s"]
        assert ours["tok_s_vs_mlx_lm_server"] == round(ours["tok_s"] / theirs["tok_s"], 3)


def test_soak_refuses_a_url_off_this_machine(procs):
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--serve", "--soak", "5", "--url",
                     "http://10.1.2.3:8080", "--model", "demo"])
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "not a loopback address" in err, err
    p = procs.spawn(["-m", "mlx_ds4tp", "bench", "--serve", "--soak", "5", "--restart-worker",
                     "--url", "http://127.0.0.1:8080", "--model", "demo"])
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "not with --url" in err, err


def test_the_pair_behind_a_port_is_found_whatever_the_terminal_width(procs, monkeypatch):
    """Rank command lines far past 80 columns, with COLUMNS=80 set (as pytest-xdist's workers
    and some shells set it): `ps` would cut them there without -ww, losing --port and --listen."""
    import sys

    from mlx_ds4tp.bench.soak_pair import find_pair_pids
    from pairutil import free_port

    http, pair = free_port(), free_port()
    model = "/tmp/" + "a-long-model-directory/" * 8
    sleeper = ["-c", "import time; time.sleep(60)", "ds4tp", "serve", "--model", model]
    leader = procs.spawn(sleeper + ["--role", "leader", "--listen", "127.0.0.1", str(pair),
                                    "--port", str(http)])
    worker = procs.spawn(sleeper + ["--role", "worker", "--coordinator", "127.0.0.1", str(pair)])
    monkeypatch.setenv("COLUMNS", "80")
    assert len(" ".join([sys.executable] + sleeper)) > 200
    assert find_pair_pids(http) == (leader.pid, worker.pid)
