"""The C module mlx_ds4tp._verbs, driven through cffi directly.

Most tests run two emulated Thunderbolt UC devices ("ucsim") in this process
on 127.0.0.1 and drive both sides; the blocking hot paths run in two threads
(cffi releases the GIL around API-mode calls). One test uses a second process.
"""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mlx_ds4tp._verbs import ffi, lib

ERRLEN = 512
MAX = lib.TP_MAX_MSG
ROUND = lib.TP_BULK_SLOTS * lib.TP_MAX_MSG
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------
# Harness
# ----------------------------------------------------------------------------


class Side:
    """One ucsim device with a slab; the caller's area starts at `user`."""

    def __init__(self, role, faults="", extra=1 << 20):
        self.role = role
        self.err = ffi.new("char[]", ERRLEN)
        self.size = lib.tp_slab_bytes() + extra
        self.slab = ffi.new("uint8_t[]", self.size)
        self.user = self.slab + lib.tp_slab_bytes()
        self.dev = lib.tp_open(b"ucsim", -1, b"127.0.0.1", role, faults.encode(),
                               self.slab, self.size, self.err, ERRLEN)
        assert self.dev != ffi.NULL, self.msg

    @property
    def msg(self):
        return ffi.string(self.err).decode()

    def ok(self, rc):
        assert rc >= 0, f"rc {rc}: {self.msg}"
        return rc

    def build(self, attempt=0, qpt=lib.TP_QPT_UC, cq=0, send=0, recv=0):
        return lib.tp_build_qp(self.dev, qpt, attempt, cq, send, recv, self.err, ERRLEN)

    def info(self):
        out = ffi.new("tp_info *")
        self.ok(lib.tp_local_info(self.dev, out))
        return out

    def stats(self):
        out = ffi.new("tp_stats *")
        lib.tp_get_stats(self.dev, out)
        return out

    def put(self, off, data):
        ffi.memmove(self.user + off, data, len(data))

    def get(self, off, n):
        return bytes(ffi.buffer(self.user + off, n))

    def post_recv(self, off, n, wr_id):
        return lib.tp_post_recv(self.dev, self.user + off, n, wr_id, self.err, ERRLEN)

    def post_send(self, off, n, wr_id, op=lib.TP_OP_SEND, signaled=1):
        return lib.tp_post_send(self.dev, self.user + off, n, wr_id, op, signaled, self.err, ERRLEN)

    def poll(self, timeout, max_wc=64):
        wc = ffi.new("tp_wc[]", max_wc)
        n = self.ok(lib.tp_poll(self.dev, wc, max_wc, timeout, self.err, ERRLEN))
        return [(wc[i].wr_id, wc[i].status, wc[i].opcode, wc[i].byte_len) for i in range(n)]

    def recvs(self, timeout):
        return [c for c in self.poll(timeout) if c[2] == lib.TP_WC_RECV]

    def gate(self, src, dst, nbytes, seq, timeout=10.0):
        return lib.tp_gate(self.dev, src, dst, nbytes, seq, timeout, self.err, ERRLEN)

    def bulk(self, src, dst, nbytes, timeout=20.0):
        return lib.tp_bulk(self.dev, src, dst, nbytes, timeout, self.err, ERRLEN)

    def close(self):
        if self.dev is not None:
            lib.tp_close(self.dev)
            self.dev = None


class Pair:
    """Leader a (role 0) and worker b (role 1), connected, with socketpairs
    as the control channel and the barrier (data) socket."""

    def __init__(self, faults="", faults_b=None, extra=1 << 20):
        self.a = Side(0, faults, extra)
        self.b = Side(1, faults if faults_b is None else faults_b, extra)
        self.ctl = socket.socketpair()
        self.data = socket.socketpair()
        lib.tp_set_fds(self.a.dev, self.ctl[0].fileno(), self.data[0].fileno())
        lib.tp_set_fds(self.b.dev, self.ctl[1].fileno(), self.data[1].fileno())
        self.build(0)

    def build(self, attempt):
        for s in (self.a, self.b):
            s.ok(s.build(attempt))
        self.connect()

    def connect(self):
        ia, ib = self.a.info(), self.b.info()
        self.a.ok(lib.tp_connect(self.a.dev, ib, self.a.err, ERRLEN))
        self.b.ok(lib.tp_connect(self.b.dev, ia, self.b.err, ERRLEN))

    def close(self):
        self.a.close()
        self.b.close()
        for s in (*self.ctl, *self.data):
            s.close()


@pytest.fixture
def make_pair():
    made = []

    def make(*args, **kw):
        p = Pair(*args, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def both(f0, f1, timeout=30.0):
    """Run the two sides' blocking calls concurrently; return both results."""
    out, errs = [None, None], []

    def wrap(i, f):
        try:
            out[i] = f()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, f), daemon=True) for i, f in enumerate((f0, f1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a side hung"
    if errs:
        raise errs[0]
    return out


def run_gates(side, sizes, first_seq, rng_seed, peer_seed, src_area=None):
    """Gate through `sizes` from first_seq; return the list of mismatching seqs."""
    mine, theirs = random.Random(rng_seed), random.Random(peer_seed)
    dst = ffi.new("uint8_t[]", 2 * MAX)
    bad = []
    for i, n in enumerate(sizes):
        seq = first_seq + i
        data, want = mine.randbytes(n), theirs.randbytes(n)
        if src_area is not None and i % 2:
            side.put(src_area, data)  # registered: sent straight from here
            src = side.user + src_area
        else:
            src = ffi.from_buffer(data)  # unregistered: through the send slot
        rc = side.gate(src, dst, n, seq)
        assert rc == 0, f"gate seq {seq}: rc {rc}: {side.msg}"
        if bytes(ffi.buffer(dst, n)) != want:
            bad.append(seq)
    return bad


# ----------------------------------------------------------------------------
# Providers and setup
# ----------------------------------------------------------------------------


def _have_verbs_devices():
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def test_ibverbs_provider_on_this_machine():
    err = ffi.new("char[]", ERRLEN)
    slab = ffi.new("uint8_t[]", 4096)
    if lib.tp_built_with_ibverbs():
        if _have_verbs_devices():
            pytest.skip("this machine has verbs devices")
        want = "tp rdma: no verbs devices (ibv_get_device_list found 0); check `rdma_ctl status`"
    else:
        want = "tp rdma: built without infiniband/verbs.h; install libibverbs-dev"
    assert lib.tp_probe(ffi.NULL, err, ERRLEN) == 0
    assert ffi.string(err).decode().startswith(want)
    assert lib.tp_probe(b"rdma_en1", err, ERRLEN) == 0
    dev = lib.tp_open(ffi.NULL, -1, b"127.0.0.1", 0, ffi.NULL, slab, 4096, err, ERRLEN)
    assert dev == ffi.NULL
    assert ffi.string(err).decode().startswith(want)
    assert lib.tp_probe(b"ucsim", err, ERRLEN) == 1


def test_local_info_and_rebuild_gets_new_qpn_and_offset_psn(make_pair):
    p = make_pair()
    ia, ib = p.a.info(), p.b.info()
    assert bytes(ia.gid) == b"\0" * 10 + b"\xff\xff" + socket.inet_aton("127.0.0.1")
    assert ia.lid > 0 and ib.lid > 0 and ia.lid != ib.lid
    assert 0 < ia.qpn < 1 << 24 and ia.psn < 1 << 24 and ia.mtu == 1024
    old = (ia.qpn, ia.psn)
    p.build(1)
    ia = p.a.info()
    assert ia.qpn != old[0]
    assert (ia.psn - old[1]) % (1 << 24) == 0x1000
    depths = ffi.new("int[3]")
    lib.tp_depths(p.a.dev, depths, depths + 1, depths + 2)
    assert list(depths) == [512, 1024, 1024]
    assert ffi.string(lib.tp_device_name(p.a.dev)) == b"ucsim"


@pytest.mark.parametrize("qpt,name", [(lib.TP_QPT_RC, "RC"), (lib.TP_QPT_UD, "UD")])
def test_rc_and_ud_queue_pairs_refused(qpt, name):
    s = Side(0)
    try:
        assert s.build(0, qpt=qpt) == lib.TP_ENOTSUP
        assert name in s.msg and "UC" in s.msg
        assert s.build(0) == 0  # UC is fine
    finally:
        s.close()


@pytest.mark.parametrize("bad", ["drop=x2y:1", "drop=l2w", "loss=2", "kill_unposted=yes",
                                 "max_msg=0", "bogus", "delay_us=-3", "drop_nth=l2w:0",
                                 "drop_nth=5", "drop_nth=x2y:3"])
def test_bad_faults_string_names_item_and_forms(bad):
    err = ffi.new("char[]", ERRLEN)
    slab = ffi.new("uint8_t[]", 4096)
    faults = f"kill_unposted=1, {bad},seed=3".encode()
    dev = lib.tp_open(b"ucsim", -1, b"127.0.0.1", 0, faults, slab, 4096, err, ERRLEN)
    assert dev == ffi.NULL
    msg = ffi.string(err).decode()
    assert f"'{bad}'" in msg and "drop=l2w:K" in msg and "delay_us=N" in msg
    assert "drop_nth=l2w:N" in msg


def test_good_faults_string_accepted():
    s = Side(1, "drop=l2w:2, drop=w2l:1,kill_unposted=0,loss=0.25,seed=9,max_msg=8192,"
                "max_recv=7,delay_us=10,drop_nth=w2l:3,drop_nth=l2w:1")
    s.close()


# ----------------------------------------------------------------------------
# Raw work requests and the Apple driver's quirks
# ----------------------------------------------------------------------------


def test_send_recv_delivers_data_and_completions(make_pair):
    p = make_pair()
    payload = os.urandom(1000)
    p.a.put(0, payload)
    assert p.b.post_recv(0, 4096, 77) == 0
    assert p.a.post_send(0, 1000, 5) == 0
    assert p.a.poll(1.0) == [(5, lib.TP_WC_SUCCESS, lib.TP_WC_SEND, 1000)]
    assert p.b.poll(1.0) == [(77, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 1000)]
    assert p.b.get(0, 1000) == payload
    st = p.b.stats()
    assert (st.recvs, st.recv_bytes, st.direction_dead) == (1, 1000, 0)


def test_receive_posted_before_send_is_not_a_false_kill_when_polled_late(make_pair):
    # Processing is lazy: the datagram sits in the kernel until we poll. The
    # receive was posted before it arrived, so it must be delivered.
    p = make_pair()
    for i in range(20):
        assert p.b.post_recv(0, 4096, i) == 0
        assert p.a.post_send(0, 512, i) == 0
        time.sleep(0.005)
        assert p.b.recvs(1.0) == [(i, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 512)]
    assert p.b.stats().dropped_unposted == 0


def test_message_above_16k_vanishes_sender_sees_success(make_pair):
    p = make_pair()
    assert p.b.post_recv(0, 2 * MAX, 1) == 0
    assert p.a.post_send(0, MAX + 1, 9) == 0
    assert p.a.poll(1.0) == [(9, lib.TP_WC_SUCCESS, lib.TP_WC_SEND, MAX + 1)]
    assert p.b.poll(0.2) == []
    assert p.a.stats().dropped_oversize == 1
    # Nothing arrived, so nothing was killed: a 16 KiB message still lands.
    assert p.a.post_send(0, MAX, 10) == 0
    assert p.b.recvs(1.0) == [(1, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, MAX)]


def test_send_to_unposted_receive_kills_direction_for_good(make_pair):
    p = make_pair()
    assert p.a.post_send(0, 100, 1) == 0
    time.sleep(0.02)  # it has arrived by now; b has not looked yet
    assert p.b.post_recv(0, 4096, 1) == 0  # posted after the arrival
    assert p.b.poll(0.2) == []
    st = p.b.stats()
    assert st.direction_dead == 1 and st.dropped_unposted == 1
    # Later sends into a properly posted receive never arrive either.
    for i in range(3):
        assert p.a.post_send(0, 64, 2 + i) == 0
    assert p.b.poll(0.2) == []
    assert p.b.stats().dropped_unposted == 4
    # The other direction is alive.
    assert p.a.post_recv(0, 4096, 50) == 0
    assert p.b.post_send(4096, 200, 51) == 0
    assert p.a.recvs(1.0) == [(50, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 200)]
    # Only a new queue pair delivers again.
    p.build(1)
    assert p.b.stats().direction_dead == 0
    assert p.b.post_recv(0, 4096, 60) == 0
    assert p.a.post_send(0, 100, 61) == 0
    assert p.b.recvs(1.0) == [(60, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 100)]


def test_kill_unposted_off_only_drops(make_pair):
    p = make_pair("kill_unposted=0")
    assert p.a.post_send(0, 100, 1) == 0
    time.sleep(0.02)
    assert p.b.post_recv(0, 4096, 2) == 0
    assert p.b.poll(0.1) == []
    assert p.a.post_send(0, 100, 3) == 0
    assert p.b.recvs(1.0) == [(2, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 100)]
    st = p.b.stats()
    assert st.direction_dead == 0 and st.dropped_unposted == 1


def test_rdma_write_is_accepted_and_never_executed(make_pair):
    p = make_pair()
    p.b.put(0, b"\x11" * 256)
    p.a.put(0, b"\x22" * 256)
    assert p.b.post_recv(0, 4096, 1) == 0
    assert p.a.post_send(0, 256, 7, op=lib.TP_OP_WRITE) == 0
    assert p.a.poll(1.0) == [(7, lib.TP_WC_SUCCESS, lib.TP_WC_SEND, 256)]
    assert p.b.poll(0.2) == []
    assert p.b.get(0, 256) == b"\x11" * 256
    # It neither consumed the receive nor killed the direction.
    assert p.a.post_send(0, 256, 8) == 0
    assert p.b.recvs(1.0) == [(1, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 256)]
    assert p.b.get(0, 256) == b"\x22" * 256


def test_message_longer_than_receive_buffer_is_loc_len_err(make_pair):
    p = make_pair()
    assert p.b.post_recv(0, 100, 3) == 0
    assert p.a.post_send(0, 200, 4) == 0
    (wc,) = p.b.recvs(1.0)
    assert wc[0] == 3 and wc[1] == lib.TP_WC_LOC_LEN_ERR


def test_one_direction_drop_on_first_build_then_rebuild_works(make_pair):
    p = make_pair("drop=l2w:1")
    assert p.b.post_recv(0, MAX, 1) == 0
    assert p.a.post_send(0, 65, 1) == 0  # over 64 bytes: lost
    assert p.a.post_send(0, MAX, 2) == 0  # lost
    assert p.b.poll(0.2) == []
    assert p.a.post_send(0, 64, 3) == 0  # 64 bytes pass
    assert p.b.recvs(1.0) == [(1, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 64)]
    assert p.a.stats().dropped_fault == 2
    # worker -> leader is unaffected
    assert p.a.post_recv(0, MAX, 5) == 0
    assert p.b.post_send(MAX, MAX, 6) == 0
    assert p.a.recvs(1.0) == [(5, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, MAX)]
    # setup attempt 1 is past the fault
    p.build(1)
    assert p.b.post_recv(0, MAX, 7) == 0
    assert p.a.post_send(0, MAX, 8) == 0
    assert p.b.recvs(1.0) == [(7, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, MAX)]


def _lossy_run(seed):
    p = Pair(f"loss=0.5,seed={seed},post_cap=1000")  # 264 receives posted at once
    try:
        n = 64 + 200
        for i in range(n):
            assert p.b.post_recv((i % 32) * 1024, 1024, i) == 0 or pytest.fail(p.b.msg)
        got = []
        for i in range(n):
            size = 64 if i < 32 else 1000  # the first 64 messages are spared anyway
            p.a.put(65536, i.to_bytes(4, "little"))
            assert p.a.post_send(65536, size, i, signaled=0 if i % 16 else 1) == 0, p.a.msg
            for wr_id, status, _, _ in p.b.recvs(0.0):
                assert status == lib.TP_WC_SUCCESS
                got.append(int.from_bytes(p.b.get((wr_id % 32) * 1024, 4), "little"))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for wr_id, _status, _, _ in p.b.recvs(0.05):
                got.append(int.from_bytes(p.b.get((wr_id % 32) * 1024, 4), "little"))
            if len(got) + p.a.stats().dropped_fault == n:
                break
        return got, p.a.stats().dropped_fault, p.b.stats().direction_dead
    finally:
        p.close()


def test_loss_is_seeded_spares_first_64_and_later_messages_resync():
    got, dropped, dead = _lossy_run(7)
    assert got[:64] == list(range(64))  # the build's first 64 messages always pass
    assert got == sorted(got)  # in order, gaps skipped (UC resync)
    assert 60 <= dropped <= 140 and len(got) + dropped == 264
    assert dead == 0
    again, _, _ = _lossy_run(7)
    other, _, _ = _lossy_run(8)
    assert again == got and other != got


def test_max_recv_caps_outstanding_receives(make_pair):
    p = make_pair("max_recv=4")
    depths = ffi.new("int[3]")
    lib.tp_depths(p.b.dev, depths, depths + 1, depths + 2)
    assert depths[2] == 4
    for i in range(4):
        assert p.b.post_recv(i * 1024, 1024, i) == 0
    assert p.b.post_recv(0, 1024, 9) == lib.TP_ENOMEM
    assert "receive queue full" in p.b.msg
    assert p.a.post_send(0, 10, 1) == 0
    time.sleep(0.01)
    assert p.b.post_recv(0, 1024, 10) == 0  # the arrival consumed one


def test_delay_us_defers_visibility_and_arrival(make_pair):
    p = make_pair("delay_us=100000")
    assert p.b.post_recv(0, 4096, 1) == 0
    t0 = time.monotonic()
    assert p.a.post_send(0, 100, 2) == 0
    assert p.b.poll(0.0) == []
    assert p.b.recvs(1.0) == [(1, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 100)]
    assert time.monotonic() - t0 >= 0.09
    # A receive posted while the message is still on the (slow) link is in time.
    assert p.a.post_send(0, 100, 3) == 0
    time.sleep(0.005)
    assert p.b.post_recv(0, 4096, 4) == 0
    assert p.b.recvs(1.0) == [(4, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 100)]
    assert p.b.stats().direction_dead == 0


def test_datagrams_for_a_recreated_queue_pair_are_stale(make_pair):
    p = make_pair()
    # b re-creates its queue pair and learns a's info; a still targets b's old one.
    assert p.b.build(1) == 0
    assert lib.tp_connect(p.b.dev, p.a.info(), p.b.err, ERRLEN) == 0
    assert p.b.post_recv(0, 4096, 1) == 0
    assert p.a.post_send(0, 100, 2) == 0
    assert p.b.poll(0.1) == []
    st = p.b.stats()
    assert st.dropped_stale == 1 and st.direction_dead == 0
    # a re-creates too; both connect to the new pairs: b's receive is still posted
    assert p.a.build(1) == 0
    p.connect()
    assert p.a.post_send(0, 100, 4) == 0
    assert p.b.recvs(1.0) == [(1, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 100)]


def test_unregistered_address_refused_and_region_cap(make_pair):
    p = make_pair()
    outside = ffi.new("uint8_t[]", 8192)
    rc = lib.tp_post_recv(p.b.dev, outside, 100, 1, p.b.err, ERRLEN)
    assert rc == lib.TP_EINVAL and "registered" in p.b.msg
    # straddling the end of the slab is refused too
    assert p.a.post_send(p.a.size - lib.tp_slab_bytes() - 50, 100, 1) == lib.TP_EINVAL
    h = lib.tp_reg(p.b.dev, outside, 8192, p.b.err, ERRLEN)
    assert h > 0
    assert lib.tp_post_recv(p.b.dev, outside, 100, 1, p.b.err, ERRLEN) == 0
    assert lib.tp_dereg(p.b.dev, h) == 0
    assert lib.tp_post_recv(p.b.dev, outside, 100, 1, p.b.err, ERRLEN) == lib.TP_EINVAL
    assert lib.tp_dereg(p.b.dev, 0) == lib.TP_EINVAL  # the slab stays
    bufs = [ffi.new("uint8_t[]", 64) for _ in range(96)]
    handles = [lib.tp_reg(p.a.dev, b, 64, p.a.err, ERRLEN) for b in bufs]
    assert all(h > 0 for h in handles[:95])  # the slab is the 96th
    assert handles[95] == lib.TP_ENOMEM and "96" in p.a.msg


def test_send_queue_overflow_is_enomem_until_reaped(make_pair):
    p = make_pair()
    for s in (p.a, p.b):
        assert s.build(0, send=8) == 0
    p.connect()
    assert p.b.post_recv(0, 64, 0) == 0
    for i in range(7):
        assert p.a.post_send(0, 8, i, signaled=0) == 0
    assert p.a.post_send(0, 8, 7, signaled=1) == 0
    assert p.a.post_send(0, 8, 8) == lib.TP_ENOMEM and "send queue full" in p.a.msg
    assert [c[0] for c in p.a.poll(1.0)] == [7]  # frees it and the 7 before
    assert p.a.post_send(0, 8, 9, signaled=0) == 0


# ----------------------------------------------------------------------------
# Hot paths
# ----------------------------------------------------------------------------


def test_gates_exact_over_many_seqs_with_two_chunks_and_size_changes(make_pair):
    p = make_pair()
    sizes = ([MAX] * 60 + [24 * 1024] * 40 + [100] * 20 + [2 * MAX] * 30 + [4] * 5
             + [MAX + 1] * 20 + [1] * 5 + [MAX] * 20)
    bad = both(lambda: run_gates(p.a, sizes, 1, 1, 2, src_area=0),
               lambda: run_gates(p.b, sizes, 1, 2, 1))
    assert bad == [[], []]
    for s in (p.a, p.b):
        st = s.stats()
        assert st.recv_done == len(sizes) and st.window_armed == 1
        assert st.dropped_unposted == 0 and st.direction_dead == 0 and st.dropped_stale == 0


def test_drain_then_bulk_then_gates_again(make_pair):
    p = make_pair(extra=8 << 20)
    sizes = [1, MAX, ROUND, ROUND + 4, 7 << 20, 3]
    # the leader sends straight from its registered slab, the worker through staging
    blobs = {r: [os.urandom(n) for n in sizes] for r in (0, 1)}

    def side(s, r):
        bad = run_gates(s, [MAX] * 10, 1, 10 + r, 11 - r)
        for i, n in enumerate(sizes):
            if r == 0:  # straight from the registered slab
                s.put(0, blobs[r][i])
                src = s.user
            else:  # through the slab's bulk staging
                src = ffi.from_buffer(blobs[r][i])
            dst = ffi.new("uint8_t[]", n)
            rc = s.bulk(src, dst, n)
            assert rc == 0, f"bulk {n}: {s.msg}"
            assert s.stats().window_armed == 0
            if bytes(ffi.buffer(dst, n)) != blobs[1 - r][i]:
                bad.append(("bulk", n))
        bad += run_gates(s, [MAX] * 5 + [24 * 1024] * 5, 11, 20 + r, 21 - r)
        assert lib.tp_drain(s.dev, 5.0, s.err, ERRLEN) == 0, s.msg
        bad += run_gates(s, [MAX] * 5, 21, 30 + r, 31 - r)
        return bad

    assert both(lambda: side(p.a, 0), lambda: side(p.b, 1), timeout=40) == [[], []]
    for s in (p.a, p.b):
        assert s.stats().dropped_unposted == 0 and s.stats().direction_dead == 0


def test_bulk_direct_into_registered_dst(make_pair):
    p = make_pair(extra=6 << 20)
    n = 2 * ROUND + 12345
    data = [os.urandom(n), os.urandom(n)]

    def side(s, r):
        s.put(0, data[r])
        rc = s.bulk(s.user, s.user + (3 << 20), n)
        assert rc == 0, s.msg
        return s.get(3 << 20, n) == data[1 - r]

    assert both(lambda: side(p.a, 0), lambda: side(p.b, 1)) == [True, True]


def test_gate_timeout_names_the_seq_and_wedges(make_pair):
    p = make_pair()
    both(lambda: run_gates(p.a, [MAX] * 5, 1, 1, 2), lambda: run_gates(p.b, [MAX] * 5, 1, 2, 1))
    dst = ffi.new("uint8_t[]", MAX)
    t0 = time.monotonic()
    rc = p.a.gate(dst, dst, MAX, 6, timeout=0.3)
    elapsed = time.monotonic() - t0
    assert rc == lib.TP_ETIMEOUT
    assert "timeout after 0.3 s waiting for gate seq 6 (recv_done 5)" in p.a.msg
    assert 0.25 <= elapsed < 1.5
    assert p.a.gate(dst, dst, MAX, 7, timeout=5.0) == lib.TP_ETIMEOUT
    assert "unusable" in p.a.msg and "gate seq 6" in p.a.msg


def test_gate_seq_is_a_label_callers_may_skip_or_jump(make_pair):
    # gate_ops gives gates and bulks one counter (a bulk takes a seq); the
    # bench starts at 10_000_001. Matching is by order, never by label.
    p = make_pair()
    labels = [1, 2, 3, 5, 6, 10_000_001, 10_000_002, 7, 8]

    def side(s, r):
        mine, theirs = random.Random(r), random.Random(1 - r)
        dst = ffi.new("uint8_t[]", MAX)
        bad = []
        for seq in labels:
            data = mine.randbytes(MAX)
            assert s.gate(ffi.from_buffer(data), dst, MAX, seq) == 0, s.msg
            bad += [seq] if bytes(ffi.buffer(dst, MAX)) != theirs.randbytes(MAX) else []
            assert s.stats().recv_done == seq
        return bad

    assert both(lambda: side(p.a, 0), lambda: side(p.b, 1)) == [[], []]
    dst = ffi.new("uint8_t[]", MAX)
    assert p.a.gate(dst, dst, MAX, 42, timeout=0.2) == lib.TP_ETIMEOUT
    assert "gate seq 42 (recv_done 8)" in p.a.msg


def test_peer_closed_control_socket_is_tp_epeer_quickly(make_pair):
    p = make_pair()
    both(lambda: run_gates(p.a, [MAX] * 3, 1, 1, 2), lambda: run_gates(p.b, [MAX] * 3, 1, 2, 1))
    threading.Timer(0.1, p.ctl[1].close).start()
    dst = ffi.new("uint8_t[]", MAX)
    t0 = time.monotonic()
    rc = p.a.gate(dst, dst, MAX, 4, timeout=30.0)
    elapsed = time.monotonic() - t0
    assert rc == lib.TP_EPEER
    assert "peer closed the control channel during gate seq 4" in p.a.msg
    assert "the peer's gate message for it never arrived" in p.a.msg
    assert elapsed < 1.0


def test_poll_reports_closed_control_socket(make_pair):
    p = make_pair()
    p.ctl[1].close()
    wc = ffi.new("tp_wc[]", 4)
    assert lib.tp_poll(p.a.dev, wc, 4, 5.0, p.a.err, ERRLEN) == lib.TP_EPEER
    assert "peer closed the control channel" in p.a.msg


def test_barrier_catches_ranks_disagreeing_on_gate_size(make_pair):
    p = make_pair()
    d0, d1 = ffi.new("uint8_t[]", MAX), ffi.new("uint8_t[]", MAX)
    rcs = both(lambda: p.a.gate(d0, d0, MAX, 1, 5.0), lambda: p.b.gate(d1, d1, 8192, 1, 5.0))
    assert rcs == [lib.TP_EINVAL, lib.TP_EINVAL]
    assert "desync" in p.a.msg and "16384-byte" in p.a.msg and "8192-byte" in p.a.msg


def test_gate_needs_barrier_socket_and_empty_receive_queue(make_pair):
    p = make_pair()
    dst = ffi.new("uint8_t[]", MAX)
    assert p.b.post_recv(0, 64, 1) == 0
    assert p.b.gate(dst, dst, MAX, 1) == lib.TP_EINVAL
    assert "receives are still posted" in p.b.msg
    lib.tp_set_fds(p.a.dev, -1, -1)
    assert p.a.gate(dst, dst, MAX, 1) == lib.TP_EINVAL
    assert "tp_set_fds" in p.a.msg


def test_hot_paths_validate_arguments(make_pair):
    p = make_pair()
    buf = ffi.new("uint8_t[]", 3 * MAX)
    assert p.a.gate(buf, buf, 2 * MAX + 1, 1) == lib.TP_EINVAL
    assert p.a.gate(buf, buf, 0, 1) == lib.TP_EINVAL
    assert p.a.gate(buf, buf, MAX, 1, timeout=0.0) == lib.TP_EINVAL
    assert "timeout_s must be > 0" in p.a.msg
    # a slab smaller than the hot paths' area
    err = ffi.new("char[]", ERRLEN)
    slab = ffi.new("uint8_t[]", 4096)
    tiny = lib.tp_open(b"ucsim", -1, b"127.0.0.1", 0, ffi.NULL, slab, 4096, err, ERRLEN)
    assert tiny != ffi.NULL
    try:
        assert lib.tp_build_qp(tiny, lib.TP_QPT_UC, 0, 0, 0, 0, err, ERRLEN) == 0
        assert lib.tp_gate(tiny, buf, buf, MAX, 1, 1.0, err, ERRLEN) == lib.TP_EINVAL
        assert "not connected" in ffi.string(err).decode()
        assert lib.tp_connect(tiny, p.b.info(), err, ERRLEN) == 0
        assert lib.tp_gate(tiny, buf, buf, MAX, 1, 1.0, err, ERRLEN) == lib.TP_EINVAL
        assert "tp_slab_bytes" in ffi.string(err).decode()
    finally:
        lib.tp_close(tiny)
    assert lib.tp_open(b"ucsim", -1, b"0.0.0.0", 0, ffi.NULL, slab, 4096, err, ERRLEN) == ffi.NULL
    assert "specific IPv4" in ffi.string(err).decode()


def test_bulk_stall_times_out_naming_the_round(make_pair):
    # loss=1 spares each build's first 64 messages: round 0 passes, round 1 is lost.
    # post_cap=1000 lifts the device's post-time cap so rounds are the full 64.
    p = make_pair("loss=1,seed=1,post_cap=1000")
    n = 3 * ROUND
    src = [os.urandom(n), os.urandom(n)]
    dst = [ffi.new("uint8_t[]", n), ffi.new("uint8_t[]", n)]
    rcs = both(lambda: p.a.bulk(ffi.from_buffer(src[0]), dst[0], n, timeout=0.5),
               lambda: p.b.bulk(ffi.from_buffer(src[1]), dst[1], n, timeout=0.5))
    assert rcs == [lib.TP_ETIMEOUT, lib.TP_ETIMEOUT]
    assert "timeout after 0.5 s waiting for bulk round 1 of 3 (0/64 receives in" in p.a.msg
    assert bytes(ffi.buffer(dst[0], ROUND)) == src[1][:ROUND]


# ----------------------------------------------------------------------------
# The post-time cap: Apple's driver grants large depths, then refuses the 64th
# ----------------------------------------------------------------------------


def test_post_cap_refuses_the_64th_receive_and_send_whatever_the_depth(make_pair):
    p = make_pair()
    depths = ffi.new("int[3]")
    lib.tp_depths(p.b.dev, depths, depths + 1, depths + 2)
    assert list(depths) == [512, 1024, 1024]  # granted at creation ...
    for i in range(63):
        assert p.b.post_recv(0, 64, i) == 0, p.b.msg
    assert p.b.post_recv(0, 64, 63) == lib.TP_ENOMEM  # ... refused at the post
    assert "63 outstanding already (post_cap 63" in p.b.msg and "granted depth, here 1024" in p.b.msg
    assert p.a.post_send(0, 8, 0) == 0
    assert p.b.recvs(1.0) == [(0, lib.TP_WC_SUCCESS, lib.TP_WC_RECV, 8)]
    assert p.b.post_recv(0, 64, 64) == 0  # the arrival made room
    assert p.a.poll(1.0) == [(0, lib.TP_WC_SUCCESS, lib.TP_WC_SEND, 8)]
    for i in range(62):  # then 63 sends in flight
        assert p.a.post_send(0, 8, 100 + i, signaled=0) == 0, p.a.msg
    assert p.a.post_send(0, 8, 200) == 0
    assert p.a.post_send(0, 8, 201) == lib.TP_ENOMEM and "63 in flight already" in p.a.msg
    assert 200 in [c[0] for c in p.a.poll(1.0)]  # reaping frees them
    assert p.a.post_send(0, 8, 202) == 0


def _gates_and_bulks(s, r, rng_seed):
    """16 KiB, 24000-byte and 32 KiB gates with size changes (drains), bulks of
    1 MiB and 1 MiB + 3 through staging and straight from registered memory.
    Returns what came back wrong."""
    mine, theirs = random.Random(rng_seed + r), random.Random(rng_seed + 1 - r)
    sizes = [MAX] * 30 + [24000] * 30 + [2 * MAX] * 20 + [MAX] * 5
    bad = run_gates(s, sizes, 1, rng_seed + r, rng_seed + 1 - r)
    for k, n in enumerate([1 << 20, (1 << 20) + 3, 5 * MAX]):
        data, want = mine.randbytes(n), theirs.randbytes(n)
        if k == 1:
            s.put(0, data)
            src, dst = s.user, s.user + (2 << 20)  # registered: no staging
        else:
            src, dst = ffi.from_buffer(data), ffi.new("uint8_t[]", n)
        assert s.bulk(src, dst, n) == 0, s.msg
        if bytes(ffi.buffer(dst, n)) != want:
            bad.append(("bulk", n))
        bad += run_gates(s, [24000] * 20, 100 + 20 * k, rng_seed + 7 + r, rng_seed + 8 - r)
    return bad


@pytest.mark.parametrize("cap", [63, 20])
def test_hot_paths_exact_within_the_post_cap(make_pair, capfd, cap):
    # Every hot path keeps within what the device accepts: the gate window
    # (two-chunk gates post 2 receives each), drains, bulk rounds. The first
    # refused post teaches the depth, logged once per device and direction.
    p = make_pair(f"post_cap={cap}", extra=4 << 20)
    res = both(lambda: _gates_and_bulks(p.a, 0, 40), lambda: _gates_and_bulks(p.b, 1, 40),
               timeout=60)
    assert res == [[], []]
    for s in (p.a, p.b):
        st = s.stats()
        assert st.recv_cap == cap and st.bulk_slots == min(64, cap // 2), (st.recv_cap, st.bulk_slots)
        assert st.window == min(16, cap // 2)  # two-chunk gates at the end
        assert st.dropped_unposted == 0 and st.direction_dead == 0
    err = capfd.readouterr().err
    assert err.count(f"rdma device ucsim refused a receive with {cap} outstanding (ENOMEM) though "
                     f"it granted a depth of 1024: hot paths now keep at most {cap} receives "
                     "posted") == 2, err


def test_ranks_with_different_post_caps_agree_on_rounds_and_drain_counts(make_pair):
    # The leader's device takes 63, the worker's 12: windows differ (each side
    # posts what its device takes; the drain word says how many), bulk rounds
    # use the smaller offer (6 messages).
    p = make_pair("post_cap=63", faults_b="post_cap=12", extra=4 << 20)
    res = both(lambda: _gates_and_bulks(p.a, 0, 50), lambda: _gates_and_bulks(p.b, 1, 50),
               timeout=60)
    assert res == [[], []]
    assert (p.a.stats().window, p.b.stats().window) == (16, 6)
    assert p.a.stats().bulk_slots == p.b.stats().bulk_slots == 6


def test_a_device_taking_fewer_than_two_gates_fails_clearly(make_pair):
    p = make_pair("post_cap=3")
    dst = [ffi.new("uint8_t[]", 2 * MAX) for _ in range(2)]
    rcs = both(lambda: p.a.gate(dst[0], dst[0], 2 * MAX, 1, 2.0),
               lambda: p.b.gate(dst[1], dst[1], 2 * MAX, 1, 2.0))
    assert rcs == [lib.TP_ENOMEM, lib.TP_ENOMEM]
    assert "the device took only 3 receives; a gate window of 32768-byte vectors needs 2 gates" in p.a.msg


def test_no_imm_sends_untagged_and_the_receiver_says_so_once(make_pair, capfd):
    p = make_pair()
    lib.tp_set_no_imm(p.a.dev, 1)
    lib.tp_set_no_imm(p.b.dev, 1)
    assert both(lambda: run_gates(p.a, [MAX] * 10, 1, 1, 2), lambda: run_gates(p.b, [MAX] * 10, 1, 2, 1)) == [[], []]
    err = capfd.readouterr().err
    assert err.count("hot-path messages go untagged (no_imm set)") == 2
    assert err.count("the peer's hot-path messages carry no sequence tag") == 2


# ----------------------------------------------------------------------------
# Lost messages: UC drops silently, the sequence tags must catch it
# ----------------------------------------------------------------------------

LOST_RE = re.compile(r"lost message detected at (?:gate seq|the gate after seq) (\d+)")


def _lossy_gates(p, s, r, nbytes, iters, timeout=5.0):
    """Gate until the first failure. Returns (gates done, wrong payloads, rc, msg);
    on failure closes this side's control socket so the peer stops at once."""
    mine, theirs = random.Random(100 + r), random.Random(101 - r)
    dst = ffi.new("uint8_t[]", nbytes)
    bad = []
    for seq in range(1, iters + 1):
        data, want = mine.randbytes(nbytes), theirs.randbytes(nbytes)
        rc = s.gate(ffi.from_buffer(data), dst, nbytes, seq, timeout=timeout)
        if rc != 0:
            msg = s.msg
            p.ctl[r].close()
            return seq - 1, bad, rc, msg
        if bytes(ffi.buffer(dst, nbytes)) != want:
            bad.append(seq)
    return iters, bad, 0, ""


def test_raw_sends_carry_no_tag(make_pair):
    p = make_pair()
    assert p.b.post_recv(0, 4096, 1) == 0
    assert p.a.post_send(0, 100, 2) == 0
    wc = ffi.new("tp_wc[]", 4)
    assert lib.tp_poll(p.b.dev, wc, 4, 1.0, p.b.err, ERRLEN) == 1
    assert (wc[0].wr_id, wc[0].status, wc[0].has_imm, wc[0].imm) == (1, 0, 0, 0)


@pytest.mark.parametrize("nbytes,seed", [(MAX, 3), (2 * MAX, 5), (24 * 1024, 11), (24 * 1024, 2)])
def test_lost_gate_message_is_an_error_naming_the_seq_never_a_wrong_payload(make_pair, nbytes, seed):
    # loss=P spares each build's first 64 messages, then drops messages over
    # 64 bytes at random: the receive for the lost one stays posted and, UC
    # being in order, the peer's next message lands in it.
    p = make_pair(f"loss=0.05,seed={seed}")
    iters = 3000
    res = both(lambda: _lossy_gates(p, p.a, 0, nbytes, iters),
               lambda: _lossy_gates(p, p.b, 1, nbytes, iters), timeout=40)
    dropped = p.a.stats().dropped_fault + p.b.stats().dropped_fault
    assert dropped >= 1
    lost = []
    for r, (done, bad, rc, msg) in enumerate(res):
        assert bad == [], f"rank {r} got a wrong payload at gates {bad[:5]} (silent loss)"
        assert rc != 0, f"rank {r} ran all {iters} gates despite {dropped} lost messages"
        assert rc in (lib.TP_ELOST, lib.TP_EPEER), f"rank {r}: rc {rc}: {msg}"
        if rc == lib.TP_ELOST:
            m = LOST_RE.search(msg)
            assert m, msg
            # the seq named is the gate in progress, the one after the last that returned
            assert int(m.group(1)) == done + 1, (done, msg)
            assert "UC dropped a message" in msg and "rebuilt" in msg
            lost.append(r)
            # the queue pair stays unusable, naming the failure
            dst = ffi.new("uint8_t[]", nbytes)
            s = (p.a, p.b)[r]
            assert s.gate(dst, dst, nbytes, done + 2, timeout=1.0) == lib.TP_ELOST
            assert "unusable" in s.msg and "lost message detected" in s.msg
    assert lost, [x[3] for x in res]
    assert all(done >= 64 // ((nbytes + MAX - 1) // MAX) for done, *_ in res)


def _lossy_bulks(p, s, r, n, times, timeout=5.0):
    rng, peer = random.Random(200 + r), random.Random(201 - r)
    dst = ffi.new("uint8_t[]", n)
    bad = []
    for k in range(times):
        data, want = rng.randbytes(n), peer.randbytes(n)
        rc = s.bulk(ffi.from_buffer(data), dst, n, timeout=timeout)
        if rc != 0:
            msg = s.msg
            p.ctl[r].close()
            return k, bad, rc, msg
        if bytes(ffi.buffer(dst, n)) != want:
            bad.append(k)
    return times, bad, 0, ""


@pytest.mark.parametrize("seed", [1, 2])
def test_lost_bulk_message_is_an_error_naming_the_round(make_pair, seed):
    p = make_pair(f"loss=0.02,seed={seed}", extra=4 << 20)
    # Four rounds, the last chunk short. These seeds lose a message
    # mid-exchange first, caught by the tag of the next one (the loss of an
    # exchange's very last message is revealed by the data socket instead:
    # test_lost_last_bulk_chunk_is_elost_within_a_second).
    n = 4 * ROUND - 100
    res = both(lambda: _lossy_bulks(p, p.a, 0, n, 10), lambda: _lossy_bulks(p, p.b, 1, n, 10),
               timeout=40)
    lost = []
    for r, (_done, bad, rc, msg) in enumerate(res):
        assert bad == [], f"rank {r}: bulk exchanges {bad} returned wrong data"
        assert rc in (lib.TP_ELOST, lib.TP_EPEER), f"rank {r}: rc {rc}: {msg}"
        if rc == lib.TP_ELOST:
            assert re.search(r"lost message detected at bulk round \d+ slot \d+ of a "
                             rf"{n}-byte exchange: received the peer's bulk round \d+ slot \d+",
                             msg), msg
            lost.append(r)
    assert lost, [x[3] for x in res]


def test_lost_message_after_bulk_in_regated_window(make_pair):
    # Gates, a bulk (drains the window: markers are tagged too), gates again
    # until a loss: still caught, naming the seq.
    p = make_pair("loss=0.03,seed=21", extra=2 << 20)

    def side(s, r):
        done, bad, rc, msg = _lossy_gates(p, s, r, MAX, 20)
        assert (done, bad, rc) == (20, [], 0), msg
        blob = bytes([r]) * ROUND
        dst = ffi.new("uint8_t[]", ROUND)
        rc = s.bulk(ffi.from_buffer(blob), dst, ROUND, timeout=5.0)
        if rc != 0:
            p.ctl[r].close()
            return 0, [], rc, s.msg
        assert bytes(ffi.buffer(dst, ROUND)) == bytes([1 - r]) * ROUND
        return _lossy_gates(p, s, r, MAX, 2000)

    res = both(lambda: side(p.a, 0), lambda: side(p.b, 1), timeout=40)
    assert all(bad == [] for _, bad, _, _ in res)
    assert any(rc == lib.TP_ELOST and ("lost message detected at" in msg) for _, _, rc, msg in res), res


# ----------------------------------------------------------------------------
# A lost message that nothing follows: the data socket reveals it
# ----------------------------------------------------------------------------

MOVED_RE = re.compile(r"lost message detected at (.*?): the peer has moved past it \(its next "
                      r"data-socket word arrived (\d+) ms ago\) but its (.*?) never landed "
                      r"\(UC dropped a message without an error; the queue pair must be rebuilt\)")


def _gates_then(p, s, r, n_gates, then, timeout=10.0):
    """n_gates 16 KiB gates (checked), then `then(s)`. Returns (gates done,
    rc, msg, seconds the failing call took); on failure closes this side's
    control socket so the peer stops at once."""
    mine, theirs = random.Random(300 + r), random.Random(301 - r)
    dst = ffi.new("uint8_t[]", MAX)
    for seq in range(1, n_gates + 1):
        data = mine.randbytes(MAX)
        t0 = time.monotonic()
        rc = s.gate(ffi.from_buffer(data), dst, MAX, seq, timeout=timeout)
        if rc != 0:
            took, msg = time.monotonic() - t0, s.msg
            p.ctl[r].close()
            return seq - 1, rc, msg, took
        assert bytes(ffi.buffer(dst, MAX)) == theirs.randbytes(MAX), f"rank {r} seq {seq}"
    t0 = time.monotonic()
    rc = then(s)
    took, msg = time.monotonic() - t0, s.msg
    if rc != 0:
        p.ctl[r].close()
    return n_gates, rc, msg, took


def _drain(s):
    return lib.tp_drain(s.dev, 10.0, s.err, ERRLEN)


def _bulk(s):
    n = ROUND + 100
    return s.bulk(ffi.from_buffer(bytes(n)), ffi.new("uint8_t[]", n), n, timeout=10.0)


def _half_gate(s):
    dst = ffi.new("uint8_t[]", MAX // 2)
    return s.gate(ffi.from_buffer(bytes(MAX // 2)), dst, MAX // 2, 99, timeout=10.0)


@pytest.mark.parametrize("then", [_drain, _bulk, _half_gate], ids=["drain", "bulk", "resize"])
def test_lost_last_gate_before_a_barrier_is_elost_within_a_second(make_pair, then):
    # drop_nth=w2l:5 loses exactly the worker's gate 5 message. Nothing
    # follows it on the queue pair: the worker goes on to a drain, a bulk
    # exchange or a gate of another size, all of which start with a
    # receives-posted barrier word on the data socket. That word, unread
    # while the leader still waits for gate 5, says the worker moved past it.
    p = make_pair("drop_nth=w2l:5")
    res = both(lambda: _gates_then(p, p.a, 0, 5, then), lambda: _gates_then(p, p.b, 1, 5, then),
               timeout=30)
    (adone, arc, amsg, atook), (bdone, brc, bmsg, _) = res
    assert p.b.stats().dropped_fault == 1 and p.a.stats().dropped_fault == 0
    assert (adone, arc) == (4, lib.TP_ELOST), amsg
    m = MOVED_RE.search(amsg)
    assert m, amsg
    assert m.group(1) == "gate seq 5 (recv_done 4)" and m.group(3) == "gate message", amsg
    assert int(m.group(2)) >= 100, amsg  # the grace ran out first
    assert atook < 1.0, atook  # not the 10 s timeout
    # the worker, waiting at its barrier, sees the leader give up
    assert (bdone, brc) == (5, lib.TP_EPEER), bmsg
    # the leader's queue pair stays unusable, naming the failure
    dst = ffi.new("uint8_t[]", MAX)
    assert p.a.gate(dst, dst, MAX, 6, timeout=1.0) == lib.TP_ELOST
    assert "unusable" in p.a.msg and "moved past" in p.a.msg


def test_lost_last_bulk_chunk_is_elost_within_a_second(make_pair):
    # A bulk of 2 x 64 chunks + 100 bytes is 129 messages; the worker's 129th
    # hot message (no gates before) is the exchange's last: the leader waits
    # in the last round while the worker, done, arms a gate window (barrier
    # word). The device refuses the 64th outstanding receive (post_cap 63),
    # so rounds are of 31 messages: 4 x 31 + 5, the last round 4 of 5.
    n = 2 * ROUND + 100
    p = make_pair("drop_nth=w2l:129", extra=2 * n)

    def side(s, r):
        t0 = time.monotonic()
        rc = s.bulk(ffi.from_buffer(bytes([r + 1]) * n), s.user + n, n, timeout=10.0)
        if rc != 0:
            took, msg = time.monotonic() - t0, s.msg
            p.ctl[r].close()
            return rc, msg, took
        assert s.get(n, n) == bytes([2 - r]) * n
        dst = ffi.new("uint8_t[]", MAX)
        return s.gate(ffi.from_buffer(bytes(MAX)), dst, MAX, 1, timeout=10.0), s.msg, 0.0

    (arc, amsg, atook), (brc, bmsg, _) = both(lambda: side(p.a, 0), lambda: side(p.b, 1))
    assert arc == lib.TP_ELOST, amsg
    m = MOVED_RE.search(amsg)
    assert m and m.group(3) == "bulk message", amsg
    assert m.group(1) == "bulk round 4 of 5 (4/5 receives in, 0 sends pending)", amsg
    assert p.a.stats().bulk_slots == 31 and p.a.stats().recv_cap == 63
    assert atook < 1.0, atook
    assert brc == lib.TP_EPEER, bmsg


def test_slow_delivery_within_the_grace_is_not_a_loss(make_pair):
    # The leader sees the worker's messages 150 ms late (longer than the
    # 100 ms grace), the worker sees the leader's at once: the worker leaves
    # each exchange and writes its next data-socket word (drain and bulk
    # barriers) well before its last message is visible to the leader. The
    # grace grows by the delay, so this is no loss.
    p = make_pair("delay_us=150000", faults_b="", extra=2 * ROUND)

    def side(s, r):
        assert run_gates(s, [MAX, MAX, 4096, MAX], 1, r, 1 - r) == []
        blob = bytes([r]) * ROUND
        assert s.bulk(ffi.from_buffer(blob), s.user + ROUND, ROUND, timeout=10.0) == 0, s.msg
        assert s.get(ROUND, ROUND) == bytes([1 - r]) * ROUND
        assert run_gates(s, [MAX], 6, r + 7, 8 - r) == []
        return True

    assert both(lambda: side(p.a, 0), lambda: side(p.b, 1), timeout=60) == [True, True]


def test_peer_exit_after_its_last_gate_was_lost_is_epeer_saying_so(make_pair):
    # End of a run: the worker's last gate message is lost, the worker
    # finishes (the leader's reached it) and closes both sockets. The data
    # socket at EOF is no "moved past": the control socket reports it.
    p = make_pair("drop_nth=w2l:3")

    def worker():
        done = _gates_then(p, p.b, 1, 3, lambda s: 0)
        p.ctl[1].close()
        p.data[1].close()
        return done

    (adone, arc, amsg, atook), (bdone, brc, _, _) = both(
        lambda: _gates_then(p, p.a, 0, 3, lambda s: 0), worker)
    assert (bdone, brc) == (3, 0)
    assert (adone, arc) == (2, lib.TP_EPEER), amsg
    assert ("peer closed the control channel during gate seq 3 (recv_done 2), and the peer's "
            "gate message for it never arrived (lost on the link, or the peer died)") in amsg
    assert atook < 1.0


# ----------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import random, socket, sys
    from mlx_ds4tp._verbs import ffi, lib
    port, iters = int(sys.argv[1]), int(sys.argv[2])
    ctl = socket.create_connection(("127.0.0.1", port))
    data = socket.create_connection(("127.0.0.1", port))
    err = ffi.new("char[]", 512)
    size = lib.tp_slab_bytes()
    slab = ffi.new("uint8_t[]", size)
    dev = lib.tp_open(b"ucsim", -1, b"127.0.0.1", 1, b"", slab, size, err, 512)
    assert lib.tp_build_qp(dev, lib.TP_QPT_UC, 0, 0, 0, 0, err, 512) == 0
    mine = ffi.new("tp_info *")
    lib.tp_local_info(dev, mine)
    ctl.sendall(bytes(ffi.buffer(mine)))
    peer = ffi.new("tp_info *")
    want = ffi.sizeof("tp_info")
    raw = b""
    while len(raw) < want:
        raw += ctl.recv(want - len(raw))
    ffi.memmove(peer, raw, want)
    assert lib.tp_connect(dev, peer, err, 512) == 0
    lib.tp_set_fds(dev, ctl.fileno(), data.fileno())
    mine_rng, peer_rng = random.Random(2), random.Random(1)
    dst = ffi.new("uint8_t[]", 16384)
    bad = 0
    for seq in range(1, iters + 1):
        src = mine_rng.randbytes(16384)
        rc = lib.tp_gate(dev, src, dst, 16384, seq, 10.0, err, 512)
        if rc != 0:
            sys.exit("child gate %d: %s" % (seq, ffi.string(err).decode()))
        bad += bytes(ffi.buffer(dst, 16384)) != peer_rng.randbytes(16384)
    ctl.sendall(b"ok" if bad == 0 else b"XX")
    """
)


def test_gates_between_two_processes_and_peer_exit_is_epeer():
    iters = 300
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(2)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(lsock.getsockname()[1]), str(iters)],
                             env=env, stderr=subprocess.PIPE)
    s = Side(0, extra=0)
    try:
        lsock.settimeout(20)
        ctl, _ = lsock.accept()
        data, _ = lsock.accept()
        assert s.build(0) == 0, s.msg
        raw = b""
        want = ffi.sizeof("tp_info")
        while len(raw) < want:
            raw += ctl.recv(want - len(raw))
        ctl.sendall(bytes(ffi.buffer(s.info())))
        peer = ffi.new("tp_info *")
        ffi.memmove(peer, raw, want)
        s.ok(lib.tp_connect(s.dev, peer, s.err, ERRLEN))
        lib.tp_set_fds(s.dev, ctl.fileno(), data.fileno())
        assert run_gates(s, [MAX] * iters, 1, 1, 2) == []
        assert ctl.recv(2) == b"ok"
        assert child.wait(20) == 0, child.stderr.read().decode()
        dst = ffi.new("uint8_t[]", MAX)
        t0 = time.monotonic()
        assert s.gate(dst, dst, MAX, iters + 1, timeout=30.0) == lib.TP_EPEER
        assert time.monotonic() - t0 < 1.0
        assert f"gate seq {iters + 1}" in s.msg
        ctl.close()
        data.close()
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait()
        s.close()
        lsock.close()


# ----------------------------------------------------------------------------
# The build without infiniband/verbs.h
# ----------------------------------------------------------------------------

NO_IBVERBS_CHECK = textwrap.dedent(
    """
    import os
    import mlx_ds4tp
    from mlx_ds4tp._verbs import ffi, lib
    assert os.path.dirname(mlx_ds4tp.__file__) == os.path.abspath("mlx_ds4tp")
    err = ffi.new("char[]", 512)
    assert lib.tp_built_with_ibverbs() == 0
    assert lib.tp_probe(ffi.NULL, err, 512) == 0
    print(ffi.string(err).decode())
    slab = ffi.new("uint8_t[]", 4096)
    assert lib.tp_open(b"rdma_en1", -1, b"", 0, ffi.NULL, slab, 4096, err, 512) == ffi.NULL
    print(ffi.string(err).decode())
    assert lib.tp_set_verbs_library(b"/x/libverbs.so", err, 512) == 0  # nothing to load it into
    assert lib.tp_probe(b"ucsim", err, 512) == 1  # ucsim needs no header
    """
)


def test_build_switch_without_ibverbs_reports_the_missing_header(tmp_path):
    # MLX_DS4TP_NO_IBVERBS=1 builds as a machine without libibverbs-dev would:
    # the same API, ucsim only, and a provider that says how to get the header.
    pkg = tmp_path / "mlx_ds4tp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")  # this copy, not the installed package, is imported
    src = os.path.join(REPO, "mlx_ds4tp")
    shutil.copytree(os.path.join(src, "csrc"), pkg / "csrc")
    shutil.copy(os.path.join(src, "_verbs_build.py"), pkg / "_verbs_build.py")
    env = dict(os.environ, MLX_DS4TP_NO_IBVERBS="1", PYTHONPATH=str(tmp_path))
    build = ("import sys; sys.path.insert(0, 'mlx_ds4tp'); import _verbs_build; "
             "_verbs_build.ffibuilder.compile(tmpdir='.')")
    res = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-c", NO_IBVERBS_CHECK], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    want = ("tp rdma: built without infiniband/verbs.h; install libibverbs-dev (Linux) or the "
            "macOS SDK and reinstall")
    assert res.stdout.splitlines() == [want, want]
