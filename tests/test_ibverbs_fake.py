"""The real ibverbs provider (mlx_ds4tp/csrc/rdma/ibv.c) end to end, over the
fake libibverbs of tests/fake_ibverbs/: rdma-core's ABI in front of ucsim's
engine, behaving as Apple's Thunderbolt RDMA device (UC only, 16 KiB
messages, rdma_enN names, the IPv4-mapped GID at index 1, a post past 63
outstanding refused with -ENOMEM, DS4_TP_UCSIM_FAULTS).

The provider is pointed at the fake with DS4_TP_VERBS_LIBRARY (LinkSettings.resolved()
passes it to lib.tp_set_verbs_library before every probe and open; the tests
of the bare C API call that directly); the fake reads its own configuration
from DS4_TP_FAKE_IBV_* (see fake_ibverbs.c).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_ds4tp as tp
from mlx_ds4tp._verbs import ffi, lib
from pairutil import REPO, both_ok, fake_verbs_library, free_port, run_both

RANK = os.path.join(REPO, "tests", "fake_ibverbs", "pair_rank.py")
ERRLEN = 512


@pytest.fixture(scope="session")
def fake_library():
    """The fake, built by the same script a user runs; its path."""
    return fake_verbs_library()


@pytest.fixture
def fake(fake_library, monkeypatch):
    """The provider loads the fake for this test (DS4_TP_VERBS_LIBRARY for the
    library's pairs, tp_set_verbs_library for the bare C API), the system
    library after."""
    for var in ("DS4_TP_FAKE_IBV_DEVICES", "DS4_TP_FAKE_IBV_REFUSE", "DS4_TP_FAKE_IBV_ROLE",
                "DS4_TP_UCSIM_FAULTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DS4_TP_VERBS_LIBRARY", fake_library)
    err = ffi.new("char[]", ERRLEN)
    assert lib.tp_set_verbs_library(fake_library.encode(), err, ERRLEN) == 0
    yield fake_library
    lib.tp_set_verbs_library(ffi.NULL, err, ERRLEN)


def probe(device=None):
    err = ffi.new("char[]", ERRLEN)
    ok = lib.tp_probe(device.encode() if device else ffi.NULL, err, ERRLEN)
    return ok, ffi.string(err).decode()


def rdma_groups(**kw):
    port = free_port()
    return both_ok(
        lambda: tp.init(role="leader", listen=("127.0.0.1", port), transport="rdma", timeout=20.0, **kw),
        lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), transport="rdma",
                        timeout=20.0, **kw))


def exact_sums(g, sizes=((4096, 20), (6000, 20), (1 << 18, 3))):
    """all_sum 16 KiB, 24000-byte and 1 MiB float32 vectors; the wrong ones."""
    rank, wrong = g.rank(), []
    for n, times in sizes:
        for k in range(times):
            y = tp.all_sum(mx.arange(n, dtype=mx.float32) * (rank + 1) + k, group=g)
            mx.eval(y)  # the collective runs (and fails) inside MLX's evaluation
            if not np.array_equal(np.array(y), np.arange(n, dtype=np.float32) * 3 + 2 * k):
                wrong.append((n, k))
    return wrong


# ----------------------------------------------------------------------------
# Devices: which one auto and a name choose
# ----------------------------------------------------------------------------


def test_the_system_library_is_used_again_after_the_test(fake):
    assert probe() == (1, "ibverbs device rdma_en1, port 1 ACTIVE, IPv4-mapped GID index 1")
    err = ffi.new("char[]", ERRLEN)
    lib.tp_set_verbs_library(ffi.NULL, err, ERRLEN)
    assert probe()[0] == 0  # this machine has no verbs device of its own
    lib.tp_set_verbs_library(b"/nonexistent/libverbs.so", err, ERRLEN)
    ok, why = probe()
    assert not ok and "cannot load the verbs library /nonexistent/libverbs.so" in why
    assert "DS4_TP_VERBS_LIBRARY" in why


def test_auto_skips_a_port_down_and_a_device_without_the_gid(fake, monkeypatch, capfd):
    monkeypatch.setenv("DS4_TP_FAKE_IBV_DEVICES", "rdma_en3:down,rdma_en4:nogid,rdma_en1,rdma_en2")
    assert probe() == (1, "ibverbs device rdma_en1, port 1 ACTIVE, IPv4-mapped GID index 1")
    # named: taken even with its port down (said so), refused without the GID
    assert probe("rdma_en3")[0] == 1
    assert "rdma device rdma_en3: port 1 is DOWN, not ACTIVE; using it because it was named" in \
        capfd.readouterr().err
    ok, why = probe("rdma_en4")
    assert not ok and "rdma_en4 port 1 (ACTIVE) has no IPv4-mapped GID" in why
    assert "give the Thunderbolt interface its own IPv4" in why
    ok, why = probe("rdma_en9")
    assert not ok and "no usable verbs device named rdma_en9 (devices: rdma_en3, rdma_en4, " \
                      "rdma_en1, rdma_en2)" in why
    monkeypatch.setenv("DS4_TP_FAKE_IBV_DEVICES", "rdma_en3:down,rdma_en4:nogid")
    ok, why = probe()
    assert not ok and why.startswith(
        "tp rdma: no verbs device has an ACTIVE port and an IPv4-mapped GID (rdma_en3: port 1 "
        "DOWN, rdma_en4: port 1 ACTIVE, no IPv4-mapped GID)"), why


def test_named_device_is_used_by_both_ranks(fake, monkeypatch):
    monkeypatch.setenv("DS4_TP_FAKE_IBV_DEVICES", "rdma_en3:down,rdma_en4:nogid,rdma_en1,rdma_en2")
    leader, worker = rdma_groups(rdma_device="rdma_en2")
    with leader, worker:
        assert ffi.string(lib.tp_device_name(leader.link_to(1).rdma.dev)) == b"rdma_en2"
        assert both_ok(lambda: exact_sums(leader, ((4096, 5),)),
                       lambda: exact_sums(worker, ((4096, 5),))) == ([], [])


# ----------------------------------------------------------------------------
# Gates and bulks through the real provider
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 20])
def test_rdma_pair_picks_the_fake_device_and_every_sum_is_exact(fake, monkeypatch, capfd, cap):
    if cap:
        monkeypatch.setenv("DS4_TP_UCSIM_FAULTS", f"post_cap={cap}")
    # Only DS4_TP_VERBS_LIBRARY points at the fake: the provider starts on the system library.
    lib.tp_set_verbs_library(ffi.NULL, ffi.new("char[]", ERRLEN), ERRLEN)
    assert probe()[0] == 0
    leader, worker = rdma_groups()  # no device named: auto
    with leader, worker:
        assert leader.transport == worker.transport == "rdma"
        for g in (leader, worker):
            assert ffi.string(lib.tp_device_name(g.link_to(1 - g.rank()).rdma.dev)) == b"rdma_en1"
        assert both_ok(lambda: exact_sums(leader), lambda: exact_sums(worker), timeout=90) == ([], [])
        want = cap or 63
        for g in (leader, worker):
            st = g.link_to(1 - g.rank()).rdma.stats()
            assert (st.recv_cap, st.bulk_slots) == (want, want // 2)
            assert st.dropped_unposted == 0 and st.direction_dead == 0
    err = capfd.readouterr().err
    assert err.count(f"rdma device rdma_en1 refused a receive with {want} outstanding (ENOMEM) "
                     "though it granted a depth of 1024") == 2, err


def test_a_library_that_cannot_load_stops_both_ranks_naming_it(fake, monkeypatch):
    monkeypatch.setenv("DS4_TP_VERBS_LIBRARY", "/nonexistent/libverbs.so")
    port = free_port()
    (_, le), (_, we) = run_both(
        lambda: tp.init(role="leader", listen=("127.0.0.1", port), transport="rdma", timeout=10.0),
        lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), transport="rdma",
                        timeout=10.0))
    for exc in (le, we):
        assert isinstance(exc, tp.TransportError), exc
        assert "cannot load the verbs library /nonexistent/libverbs.so (DS4_TP_VERBS_LIBRARY)" \
            in str(exc), exc


def spawn_pair(procs, fake, mode, faults, device=""):
    """Leader and worker as two processes (each its own fake role); their JSON results."""
    port = free_port()
    env = {"DS4_TP_UCSIM_FAULTS": faults, "PYTHONPATH": REPO}
    ranks = [procs.spawn([RANK, role, str(port), fake, device, mode],
                         env=dict(env, DS4_TP_FAKE_IBV_ROLE=role))
             for role in ("leader", "worker")]
    out = []
    for p in ranks:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stdout + stderr
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


def test_lost_messages_are_caught_through_the_real_provider(fake, procs):
    # loss=P drops messages over 64 bytes at random after a build's first 64:
    # the sequence tags, carried as the real provider's immediate data, must
    # stop the pair naming the gate, never hand back a wrong sum.
    res = spawn_pair(procs, fake, "lossy:3000", "loss=0.02,seed=7")
    errors = [r["error"] for r, _ in res]
    for r, _ in res:
        assert r["wrong"] == [] and r["error"], r
    assert any("lost message detected at gate seq" in e for e in errors), errors


def test_one_direction_drop_recovers_on_the_third_build(fake, procs):
    # drop=w2l:2: the worker's full-size messages vanish on the first two
    # builds; the warm-up finds it, rebuilds twice, and the third build works.
    # post_cap=20: a failing warm-up's 20 rounds keep 20 sends in flight, no more.
    for res, err in spawn_pair(procs, fake, "sums", "drop=w2l:2,post_cap=20"):
        assert res["transport"] == "rdma" and res["device"] == "rdma_en1" and res["wrong"] == []
        assert "recreating the queue pair (setup attempt 1)" in err
        assert "recreating the queue pair (setup attempt 2)" in err
        # Any number of rounds within build 3: on a loaded machine a 100 ms round can be missed.
        assert re.search(r"rdma warm-up ok \(\d+ attempts?\), queue depth recv 1024 send 1024 \[build 3",
                         err), err
        assert (res["recv_cap"], res["bulk_slots"]) == (20, 10)


# ----------------------------------------------------------------------------
# What only the real provider does
# ----------------------------------------------------------------------------


def test_send_with_imm_refused_falls_back_untagged_logged_once(fake, monkeypatch, capfd):
    monkeypatch.setenv("DS4_TP_FAKE_IBV_REFUSE", "send_imm")
    leader, worker = rdma_groups()
    with leader, worker:
        assert both_ok(lambda: exact_sums(leader), lambda: exact_sums(worker), timeout=90) == ([], [])
    err = capfd.readouterr().err
    assert err.count("rdma device rdma_en1 refused SEND_WITH_IMM on a UC queue pair (Invalid "
                     "argument): hot-path messages go untagged") == 2, err
    assert err.count("the peer's hot-path messages carry no sequence tag") == 2, err


def test_rdma_no_imm_reaches_the_provider(fake, monkeypatch, capfd):
    monkeypatch.setenv("DS4_TP_RDMA_NO_IMM", "1")
    leader, worker = rdma_groups()
    with leader, worker:
        assert both_ok(lambda: exact_sums(leader, ((4096, 10),)),
                       lambda: exact_sums(worker, ((4096, 10),))) == ([], [])
    err = capfd.readouterr().err
    assert err.count("rdma device rdma_en1: hot-path messages go untagged (no_imm set)") == 2, err
    assert err.count("the peer's hot-path messages carry no sequence tag") == 2, err


def test_queue_depths_refused_at_creation_are_halved_until_taken(fake, monkeypatch, capfd):
    monkeypatch.setenv("DS4_TP_FAKE_IBV_REFUSE", "qp_wr=256")
    leader, worker = rdma_groups()
    with leader, worker:
        assert leader.link_to(1).rdma.depths == (128, 256, 256)
        assert both_ok(lambda: exact_sums(leader), lambda: exact_sums(worker), timeout=90) == ([], [])
    err = capfd.readouterr().err
    assert err.count("queue pair depths cq 512 send 1024 recv 1024 refused; trying half") == 2
    assert err.count("queue pair depths cq 256 send 512 recv 512 refused; trying half") == 2
    assert err.count("queue pair granted cq 128 send 256 recv 256") == 2


def test_reg_mr_failing_is_a_clear_error_and_auto_falls_back_to_tcp(fake, monkeypatch, capfd):
    monkeypatch.setenv("DS4_TP_FAKE_IBV_REFUSE", "reg_mr")
    err = ffi.new("char[]", ERRLEN)
    slab = ffi.new("uint8_t[]", 1 << 16)
    dev = lib.tp_open(ffi.NULL, -1, b"127.0.0.1", 0, ffi.NULL, slab, 1 << 16, err, ERRLEN)
    assert dev == ffi.NULL
    assert "tp rdma: rdma_en1: reg_mr(" in ffi.string(err).decode()
    assert "65536 bytes) failed: Cannot allocate memory" in ffi.string(err).decode()
    port = free_port()
    leader, worker = both_ok(
        lambda: tp.init(role="leader", listen=("127.0.0.1", port), transport="auto", timeout=20.0),
        lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), transport="auto",
                        timeout=20.0))
    with leader, worker:
        assert leader.transport == worker.transport == "tcp"
    assert capfd.readouterr().err.count("failed: Cannot allocate memory; falling back to TCP") == 2


def test_rc_queue_pair_refused_and_raw_work_requests(fake):
    # The provider's raw path (warm-up's) and Apple's quirks, straight through cffi.
    import socket

    err = ffi.new("char[]", ERRLEN)
    sides, slabs = [], []
    for role in (0, 1):
        slab = ffi.new("uint8_t[]", lib.tp_slab_bytes() + (1 << 16))
        slabs.append(slab)  # the device registered it: it must outlive the device
        dev = lib.tp_open(b"rdma_en1", -1, b"127.0.0.1", role, ffi.NULL, slab,
                          lib.tp_slab_bytes() + (1 << 16), err, ERRLEN)
        assert dev != ffi.NULL, ffi.string(err)
        sides.append((dev, slab + lib.tp_slab_bytes()))
    try:
        (a, abuf), (b, bbuf) = sides
        assert lib.tp_build_qp(a, lib.TP_QPT_RC, 0, 0, 0, 0, err, ERRLEN) == lib.TP_ENOTSUP
        assert "refused an RC queue pair" in ffi.string(err).decode()
        assert lib.tp_build_qp(a, lib.TP_QPT_UD, 0, 0, 0, 0, err, ERRLEN) == lib.TP_ENOTSUP
        assert "UD queue pairs carry no connection" in ffi.string(err).decode()
        for dev in (a, b):
            assert lib.tp_build_qp(dev, lib.TP_QPT_UC, 0, 0, 0, 0, err, ERRLEN) == 0
        ia, ib = ffi.new("tp_info *"), ffi.new("tp_info *")
        lib.tp_local_info(a, ia)
        lib.tp_local_info(b, ib)
        assert bytes(ia.gid) == b"\0" * 10 + b"\xff\xff" + socket.inet_aton("127.0.0.1")
        assert ia.mtu == 1024 and ia.link_layer == 2  # Ethernet: addressed by GID
        bad = ffi.new("tp_info *", {"qpn": ib.qpn, "psn": ib.psn, "mtu": 1024, "lid": ib.lid,
                                    "link_layer": 2})
        bad.gid[0], bad.gid[1] = 0xfe, 0x80  # link-local: Apple connects only from ::ffff:a.b.c.d
        assert lib.tp_connect(a, bad, err, ERRLEN) == lib.TP_ESYS
        assert "modify_qp to RTR failed: Invalid argument" in ffi.string(err).decode()
        assert lib.tp_build_qp(a, lib.TP_QPT_UC, 1, 0, 0, 0, err, ERRLEN) == 0
        lib.tp_local_info(a, ia)
        assert lib.tp_connect(b, ia, err, ERRLEN) == 0, ffi.string(err)
        assert lib.tp_connect(a, ib, err, ERRLEN) == 0, ffi.string(err)
        for i in range(63):
            assert lib.tp_post_recv(b, bbuf, 4096, i, err, ERRLEN) == 0
        # Apple's -ENOMEM at the 64th outstanding receive, read as ENOMEM
        assert lib.tp_post_recv(b, bbuf, 4096, 63, err, ERRLEN) == lib.TP_ENOMEM
        assert "post_recv(4096 bytes, wr_id 0x3f) failed: Cannot allocate memory" in \
            ffi.string(err).decode()
        ffi.memmove(abuf, b"x" * 100, 100)
        assert lib.tp_post_send(a, abuf, 100, 7, lib.TP_OP_WRITE, 1, err, ERRLEN) == 0
        assert lib.tp_post_send(a, abuf, 100, 8, lib.TP_OP_SEND, 1, err, ERRLEN) == 0
        wc = ffi.new("tp_wc[]", 8)
        assert lib.tp_poll(b, wc, 8, 2.0, err, ERRLEN) == 1  # the WRITE never executed
        assert (wc[0].wr_id, wc[0].status, wc[0].opcode, wc[0].byte_len, wc[0].has_imm) == \
            (0, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 100, 0)
        assert bytes(ffi.buffer(bbuf, 100)) == b"x" * 100
        # and the 64th send in flight (not yet reaped), with Apple's -ENOMEM too
        assert lib.tp_poll(a, wc, 8, 1.0, err, ERRLEN) == 2
        for i in range(63):
            assert lib.tp_post_send(a, abuf, 8, 100 + i, lib.TP_OP_WRITE, 1, err, ERRLEN) == 0
        assert lib.tp_post_send(a, abuf, 8, 200, lib.TP_OP_WRITE, 1, err, ERRLEN) == lib.TP_ENOMEM
        assert "post_send(8 bytes, wr_id 0xc8) failed: Cannot allocate memory" in \
            ffi.string(err).decode()
    finally:
        for dev, _ in sides:
            lib.tp_close(dev)


def test_library_and_device_errors_name_the_fix(fake):
    err = ffi.new("char[]", ERRLEN)
    assert lib.tp_set_verbs_library(b"/x" * 400, err, ERRLEN) == lib.TP_EINVAL
    assert "path of 800 characters is too long" in ffi.string(err).decode()
    lib.tp_set_verbs_library(b"libm.so.6", err, ERRLEN)  # loads, but is no verbs library
    assert probe() == (0, "tp rdma: libm.so.6 (DS4_TP_VERBS_LIBRARY) lacks ibv_get_device_list")
    lib.tp_set_verbs_library(fake.encode(), err, ERRLEN)
    slab = ffi.new("uint8_t[]", 4096)
    assert lib.tp_open(b"rdma_en9", -1, b"", 0, ffi.NULL, slab, 4096, err, ERRLEN) == ffi.NULL
    assert "no usable verbs device named rdma_en9" in ffi.string(err).decode()
    dev = lib.tp_open(b"rdma_en1", 1, b"", 0, ffi.NULL, slab, 4096, err, ERRLEN)  # GID index given
    assert dev != ffi.NULL
    lib.tp_close(dev)
    assert lib.tp_open(b"rdma_en1", 7, b"", 0, ffi.NULL, slab, 4096, err, ERRLEN) == ffi.NULL
    assert "query_gid(port 1, index 7) failed" in ffi.string(err).decode()
    assert "omit the GID index to scan for the IPv4-mapped GID" in ffi.string(err).decode()


def test_doctor_finds_the_fake_device(fake, capsys):
    from mlx_ds4tp.cli import doctor

    lines = doctor.check_verbs()
    out = capsys.readouterr().out
    assert ("ok", "verbs device") in lines, out
    assert "[  ok] verbs device: ibverbs device rdma_en1, port 1 ACTIVE, IPv4-mapped GID index 1" in out


def test_ds4tp_doctor_lists_the_fake_device_from_the_variable(fake_library):
    env = dict(os.environ, DS4_TP_VERBS_LIBRARY=fake_library, PYTHONPATH=REPO,
               DS4_TP_FAKE_IBV_DEVICES="rdma_en3:down,rdma_en2")
    env.pop("DS4_TP_UCSIM_FAULTS", None)
    res = subprocess.run([sys.executable, "-m", "mlx_ds4tp", "doctor"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert f"[  ok] verbs library: {fake_library} (from DS4_TP_VERBS_LIBRARY)" in res.stdout, res.stdout
    assert "[  ok] verbs device: ibverbs device rdma_en2, port 1 ACTIVE, IPv4-mapped GID index 1" \
        in res.stdout, res.stdout + res.stderr
