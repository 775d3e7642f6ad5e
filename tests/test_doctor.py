"""`ds4tp doctor`: every check prints a line with what to fix."""

from __future__ import annotations

from pairutil import free_port, no_rdma_reason


def test_doctor_reports_each_check(procs):
    p = procs.spawn(["-m", "mlx_ds4tp", "doctor"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert "[  ok] mlx:" in out and "[  ok] C module" in out
    # No RDMA hardware here: a warning with what to check, not a failure.
    assert f"[warn] verbs device: tp rdma: {no_rdma_reason()}" in out
    if no_rdma_reason() == "no verbs devices":  # built with the provider: what to check
        assert "rdma_ctl status" in out and "ibv_devices" in out
    assert "[  ok] ucsim pair: bring-up, warm-up and 200 gates" in out
    assert "doctor: 8 checks, 0 failed" in out


def test_doctor_peer_round_trip(procs):
    port = free_port()
    listener = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--listen", "127.0.0.1", str(port),
                            "--transport", "tcp"])
    peer = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--peer", "127.0.0.1", str(port),
                        "--transport", "tcp"])
    for p in (peer, listener):
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, out + err
        assert f"[  ok] gate round trip with 127.0.0.1:{port}: transport tcp, 16 KiB p50" in out


def test_doctor_peer_unreachable_fails_with_the_reason(procs):
    port = free_port()
    p = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--peer", "127.0.0.1", str(port)],
                    env={"DS4_TP_TIMEOUT_SEC": "1"})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "[FAIL] gate round trip" in out and f"127.0.0.1:{port}" in out
