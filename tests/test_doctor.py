"""`ds4tp doctor`: every check prints a line with what to fix."""

from __future__ import annotations

import pytest

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
    assert "[  ok] ucsim group of 2: bring-up, warm-up and 200 all_sums" in out
    assert "[  ok] split auto: local figures only, no peer (this Mac: " in out
    assert "doctor: 9 checks, 0 failed" in out


def test_doctor_peer_round_trip(procs):
    port = free_port()
    listener = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--listen", "127.0.0.1", str(port),
                            "--transport", "tcp"])
    peer = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--peer", "127.0.0.1", str(port),
                        "--transport", "tcp"])
    for p, ends in ((peer, "rank 1 <-> rank 0"), (listener, "rank 0 <-> rank 1")):
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, out + err
        assert f"[  ok] all_sum round trip with 127.0.0.1:{port}: 2 ranks, transport tcp, 16 KiB p50" in out
        assert "exact on every rank" in out
        assert f"[  ok] wiring {ends}: no cable: over the route to rank" in out and "; transport tcp; gate" in out, out


def test_doctor_peer_unreachable_fails_with_the_reason(procs):
    port = free_port()
    p = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--peer", "127.0.0.1", str(port)],
                    env={"DS4_TP_TIMEOUT_SEC": "1"})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "[FAIL] all_sum round trip" in out and f"127.0.0.1:{port}" in out


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    root = tmp_path_factory.mktemp("doctor-models")
    return save_llama(root / "a", "tiny", seed=0), save_llama(root / "b", "tiny", seed=1)


@pytest.mark.parametrize("same", [True, False], ids=["same-model", "other-weights"])
def test_doctor_peer_compares_model_fingerprints(procs, two_models, same):
    from mlx_ds4tp import model_fingerprint

    a, b = two_models
    mine, theirs = (a, a) if same else (a, b)
    la, lb = model_fingerprint(mine).label, model_fingerprint(theirs).label
    port = free_port()
    listener = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--listen", "127.0.0.1", str(port),
                            "--transport", "tcp", "--model", str(mine)])
    peer = procs.spawn(["-m", "mlx_ds4tp", "doctor", "--peer", "127.0.0.1", str(port),
                        "--transport", "tcp", "--model", str(theirs)])
    for p, here, there, other in ((listener, la, lb, 1), (peer, lb, la, 0)):
        out, err = p.communicate(timeout=180)
        if same:
            assert p.returncode == 0, out + err
            assert f"[  ok] model fingerprint: {here} here; rank {other} {there}" in out, out
        else:
            assert p.returncode == 1, out + err
            assert "[FAIL] all_sum round trip: model mismatch" in out, out
            assert here in out and there in out, out


def test_a_build_without_the_provider_names_the_switch_when_the_header_is_installed(tmp_path, monkeypatch):
    # MLX_DS4TP_NO_IBVERBS=1 builds without the ibverbs provider on purpose: doctor must not say
    # to install the header that is installed, but name the switch and the rebuild.
    from mlx_ds4tp.cli import doctor

    reason = ("tp rdma: built without infiniband/verbs.h; install libibverbs-dev (Linux) or the "
              "macOS SDK and reinstall")
    (tmp_path / "infiniband").mkdir()
    (tmp_path / "infiniband" / "verbs.h").write_text("")
    monkeypatch.setattr(doctor, "VERBS_HEADER_DIRS", (str(tmp_path),))
    monkeypatch.setenv("MLX_DS4TP_NO_IBVERBS", "1")
    said = doctor.no_provider_cause(reason)
    assert said.startswith("tp rdma: built without infiniband/verbs.h, yet ")
    assert "install libibverbs-dev" not in said
    assert "MLX_DS4TP_NO_IBVERBS=1 is set here: the module was built with that switch" in said
    assert "rebuild without it: `env -u MLX_DS4TP_NO_IBVERBS pip install -e .`" in said
    monkeypatch.delenv("MLX_DS4TP_NO_IBVERBS")
    assert "built with MLX_DS4TP_NO_IBVERBS=1 or before the header was installed" in \
        doctor.no_provider_cause(reason)
    # No header here: installing it is the fix, as the C module says.
    monkeypatch.setattr(doctor, "VERBS_HEADER_DIRS", (str(tmp_path / "none"),))
    assert doctor.no_provider_cause(reason) == reason
