"""Control channel, hello, and gates (every gate test runs over tcp and over
the emulated Thunderbolt UC device)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import textwrap
import time

import numpy as np
import pytest

from mlx_ds4tp import transport as tr
from mlx_ds4tp.errors import (
    DesyncError,
    FrameError,
    HelloMismatchError,
    PeerClosedError,
    RdmaUnavailableError,
    TransportError,
    TransportTimeoutError,
)
from mlx_ds4tp.link.exchange import Exchange
from mlx_ds4tp.link.native import load_verbs
from mlx_ds4tp.lockstep.protocol.commands import COMMANDS  # noqa: F401 - registers the commands' bounds
from pairutil import (
    both_ok,
    dial_when_listening,
    exchange,
    free_port,
    groups_of,
    make_groups,
    no_rdma_reason,
    run_both,
    swap,
)

TRANSPORTS = ["tcp", "rdma"]
MiB = 1024 * 1024


def channel_pair(timeout: float = 5.0):
    a, b = socket.socketpair()
    return tr.ControlChannel(a, timeout), tr.ControlChannel(b, timeout)


# ============================================================================
# Frames
# ============================================================================


@pytest.mark.parametrize("ftype", list(tr.FrameType))
def test_every_frame_type_round_trips(ftype):
    a, b = channel_pair()
    for payload in (b"", bytes(range(min(37, tr.FRAME_MAX_BYTES[ftype])))):
        a.send(ftype, payload)
        got_type, got = b.recv(ftype)
        assert (got_type, got) == (ftype, payload)
    limit = tr.FRAME_MAX_BYTES[ftype]
    if limit <= 4096:
        a.send(ftype, b"x" * limit)
        assert b.recv(ftype)[1] == b"x" * limit
        with pytest.raises(FrameError, match=str(limit)):
            a.send(ftype, b"x" * (limit + 1))


def raw_header(magic, ftype, nbytes):
    return tr.FRAME_HEADER.pack(magic, ftype, nbytes)


def test_bad_magic_is_a_clear_error():
    a, b = channel_pair()
    a.sock.sendall(raw_header(0x12345678, tr.FrameType.REWIND, 0))
    with pytest.raises(FrameError, match="bad frame magic 0x12345678"):
        b.recv()


def test_byte_swapped_magic_is_reported():
    a, b = channel_pair()
    swapped = struct.unpack("<I", struct.pack(">I", tr.MAGIC))[0]
    a.sock.sendall(raw_header(swapped, tr.FrameType.HELLO, 0))
    with pytest.raises(FrameError, match="byte order"):
        b.recv()


def test_unknown_frame_type():
    a, b = channel_pair()
    a.sock.sendall(raw_header(tr.MAGIC, 999, 4) + b"abcd")
    with pytest.raises(FrameError, match="unknown frame type 999"):
        b.recv()


def test_oversized_header_is_refused_before_allocation():
    a, b = socket.socketpair()
    allocated = []

    def spy(n):  # the payload buffer must never be created
        allocated.append(n)
        return bytearray(n)

    ch = tr.ControlChannel(b, 5.0, alloc=spy)
    a.sendall(raw_header(tr.MAGIC, tr.FrameType.REWIND, 0xFFFFFFFF))
    with pytest.raises(FrameError, match="4294967295 bytes, over its 64-byte bound"):
        ch.recv()
    assert allocated == []
    a.sendall(raw_header(tr.MAGIC, tr.FrameType.REWIND, 3) + b"abc")
    assert ch.recv() == (tr.FrameType.REWIND, b"abc") and allocated == [3]


def test_truncated_frame_eof_mid_payload():
    a, b = channel_pair()
    a.sock.sendall(raw_header(tr.MAGIC, tr.FrameType.HASH, 32) + b"x" * 10)
    a.sock.close()
    with pytest.raises(PeerClosedError, match="truncated at 10/32"):
        b.recv()


def test_a_streamed_frame_passes_through_its_piece_buffer_and_other_frames_come_whole():
    """recv_streamed (a part's receiver over TCP): PART_DATA's payload handed on a piece at a
    time in the one buffer given, the PART_END after it returned as recv returns it; an ERROR
    from the peer raised; the leader gone mid-frame: the pieces before the cut were handed on."""
    a, b = channel_pair()
    data = os.urandom(10_000)
    a.send(tr.FrameType.PART_DATA, data)
    a.send(tr.FrameType.PART_END, b'{"name": "x"}')
    a.send(tr.FrameType.ERROR, b"the leader's disk failed")
    buffer = bytearray(4096)
    pieces = []

    def consume(piece):
        assert piece.obj is buffer and len(piece) <= 4096
        pieces.append(bytes(piece))

    assert b.recv_streamed(tr.FrameType.PART_DATA, memoryview(buffer), consume) == (tr.FrameType.PART_DATA, b"")
    assert [len(p) for p in pieces] == [4096, 4096, 1808] and b"".join(pieces) == data
    ftype, payload = b.recv_streamed(tr.FrameType.PART_DATA, memoryview(buffer), consume)
    assert (ftype, bytes(payload)) == (tr.FrameType.PART_END, b'{"name": "x"}') and len(pieces) == 3
    with pytest.raises(TransportError, match="peer reported: the leader's disk failed"):
        b.recv_streamed(tr.FrameType.PART_DATA, memoryview(buffer), consume)

    pieces.clear()
    a.sock.sendall(raw_header(tr.MAGIC, tr.FrameType.PART_DATA, 10_000) + data[:5000])
    a.sock.close()
    with pytest.raises(PeerClosedError, match="PART_DATA payload from byte 4096 of 10000 truncated at 904/4096"):
        b.recv_streamed(tr.FrameType.PART_DATA, memoryview(buffer), consume)
    assert pieces == [data[:4096]]


def test_eof_mid_header():
    a, b = channel_pair()
    a.sock.sendall(b"\x54\x34")
    a.sock.close()
    with pytest.raises(PeerClosedError, match="truncated at 2/12"):
        b.recv()


def test_clean_eof_between_frames():
    a, b = channel_pair()
    a.sock.close()
    with pytest.raises(PeerClosedError, match="EOF"):
        b.recv()


def test_wrong_frame_type_names_both():
    a, b = channel_pair()
    a.send(tr.FrameType.STOP)
    with pytest.raises(FrameError, match="expected a RDMA_READY frame, got STOP"):
        b.recv(tr.FrameType.RDMA_READY)


def test_control_recv_times_out():
    a, b = channel_pair(timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeoutError):
        b.recv()
    assert time.monotonic() - t0 < 2.0


def test_poll_readable_watches_for_the_next_frame_within_its_limit():
    a, b = channel_pair(timeout=5.0)
    t0 = time.monotonic()
    # Nothing sent: gives up after its limit (or sooner, when another task takes the core).
    assert b.poll_readable(0.05) is False
    assert time.monotonic() - t0 < 1.0
    assert b.poll_readable(0) is False
    assert b.poll_readable() is False  # its default (spin_s) is 0 here: no watch at all
    a.send(tr.FrameType.STOP)
    assert b.poll_readable(1.0) is True
    assert b.recv(tr.FrameType.STOP)[0] == tr.FrameType.STOP


_CORE_TAKEN = """
import os, subprocess, sys, time, socket
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})
spin = subprocess.Popen([sys.executable, "-c", "import os\\nwhile os.getppid() == %d: pass" % os.getpid()],
                        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
try:
    from mlx_ds4tp.link.control import ControlChannel
    from mlx_ds4tp.link.native import load_verbs
    from mlx_ds4tp.lockstep.protocol.commands import COMMANDS  # noqa: F401 - registers the commands' bounds
    lib = load_verbs()[1]
    deadline = time.monotonic() + 10
    while spin.poll() is None and not lib.tp_yield_lost():  # until the spinner has the core once
        assert time.monotonic() < deadline, "no yield ever gave the core away"
    a, b = socket.socketpair()
    start = time.monotonic()
    watched = ControlChannel(b, 5.0).poll_readable(5.0)
    print(watched, round(time.monotonic() - start, 3))
finally:
    spin.kill()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's sched_setaffinity")
def test_a_watch_whose_core_another_task_takes_ends_for_a_blocking_read(procs):
    # A yielding watcher is runnable, not asleep, so a frame arriving while another task holds
    # the core does not wake it: it waits out that task's slice. Once a yield gives the core
    # away, the watch ends and the caller's blocking read is woken by the frame.
    child = procs.spawn(["-c", _CORE_TAKEN])
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    watched, seconds = out.split()
    assert watched == "False" and float(seconds) < 2.5, out  # a 5 s watch, given up early


def test_error_frame_is_raised_with_peer_text():
    a, b = channel_pair()
    a.send_error("model mismatch: hidden is 64 here and 128 on the worker")
    with pytest.raises(TransportError, match="peer reported: model mismatch"):
        b.recv(tr.FrameType.HELLO)


# ============================================================================
# Hello
# ============================================================================


def hello(role=0, **ident):
    return tr.Hello(role=role, transport="auto", rdma_ok=False, rdma_reason="none",
                    session_id=7, identity=tr.ModelIdentity(**ident))


def test_hello_round_trip():
    h = hello(1, layers=32, hidden=4096, vocab=32000, quant_bits=4, gates_per_token=64)
    assert tr.Hello.unpack(h.pack()) == h


def test_hello_bad_magic_and_version():
    h = hello()
    h.magic = 0x54345344
    with pytest.raises(HelloMismatchError, match="byte order"):
        tr.Hello.unpack(h.pack())
    h = hello()
    h.version = 99
    with pytest.raises(HelloMismatchError, match=f"peer speaks 99, this side {tr.PROTOCOL_VERSION}"):
        tr.Hello.unpack(h.pack())


def test_hello_truncated():
    with pytest.raises(FrameError, match="hello payload is 5 bytes"):
        tr.Hello.unpack(b"12345")


@pytest.mark.parametrize("field", tr.ModelIdentity.FIELDS)
def test_hello_identity_mismatch_names_both(field):
    mine = hello(0, **{field: 8})
    theirs = hello(1, **{field: 16})
    with pytest.raises(HelloMismatchError, match=f"{field} is 8 here and 16 on the worker"):
        tr.check_hello(mine, theirs)


def test_transport_choice():
    def h(role, transport, ok):
        x = hello(role)
        x.transport, x.rdma_ok, x.rdma_reason = transport, ok, "" if ok else "no verbs devices"
        return x

    assert tr.choose_transport(h(0, "auto", True), h(1, "auto", True)) == "rdma"
    assert tr.choose_transport(h(0, "auto", True), h(1, "auto", False)) == "tcp"
    assert tr.choose_transport(h(0, "tcp", False), h(1, "auto", True)) == "tcp"
    with pytest.raises(RdmaUnavailableError, match="the worker \\(no verbs devices\\)"):
        tr.choose_transport(h(0, "rdma", True), h(1, "auto", False))
    with pytest.raises(RdmaUnavailableError, match="same --transport"):
        tr.choose_transport(h(0, "rdma", True), h(1, "tcp", False))


def _connect_both(leader_kw, worker_kw, timeout=5.0):
    port = free_port()
    lc = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=timeout, **leader_kw)
    wc = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=timeout, **worker_kw)
    return run_both(lambda: tr.connect(lc), lambda: tr.connect(wc), timeout=30)


def test_connect_identity_mismatch_fails_on_both_sides():
    (lp, le), (wp, we) = _connect_both(
        {"identity": tr.ModelIdentity(layers=2, hidden=64)},
        {"identity": tr.ModelIdentity(layers=2, hidden=128)},
    )
    assert isinstance(le, HelloMismatchError) and "hidden is 64 here and 128 on the worker" in str(le)
    assert isinstance(we, TransportError) and "hidden is 128 here and 64 on the leader" in str(we)


def test_both_claim_leader():
    port = free_port()

    def fake_worker():
        sock = dial_when_listening(port)
        ch = tr.ControlChannel(sock, 5.0)
        ch.send(tr.FrameType.HELLO, hello(0).pack())
        ch.recv(tr.FrameType.HELLO)
        try:
            return ch.recv()
        finally:
            sock.close()

    cfg = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=5.0)
    (lp, le), (wv, we) = run_both(lambda: tr.connect(cfg), fake_worker)
    assert isinstance(le, HelloMismatchError) and "both sides claim role leader" in str(le)
    assert isinstance(we, TransportError) and "both sides claim role leader" in str(we)


def test_leader_drops_garbage_connections_and_keeps_waiting():
    port = free_port()
    cfg = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=10.0)
    wcfg = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=10.0)

    def scanners_then_worker():
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"", b"\x00" * 64):
            s = dial_when_listening(port)
            s.sendall(junk)
            s.close()
        return tr.connect(wcfg)

    lp, wp = both_ok(lambda: tr.connect(cfg), scanners_then_worker)
    assert lp.transport == wp.transport == "tcp"
    lp.close()
    wp.close()


def test_worker_retries_until_leader_appears():
    port = free_port()
    cfg = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=10.0)
    wcfg = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=10.0)
    lp, wp = both_ok(lambda: (time.sleep(1.0), tr.connect(cfg))[1], lambda: tr.connect(wcfg))
    lp.close()
    wp.close()


def test_first_dial_retries_are_quiet_and_a_long_wait_says_one_calm_line(capfd, monkeypatch):
    """A worker started before its leader listens is normal: its refused dials print
    nothing; only a wait past DIAL_QUIET_SEC says one line, and it is not an error."""
    from mlx_ds4tp.link import control

    port = free_port()
    cfg = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=10.0)
    wcfg = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=10.0)
    lp, wp = both_ok(lambda: (time.sleep(1.0), tr.connect(cfg))[1], lambda: tr.connect(wcfg))
    lp.close()
    wp.close()
    err = capfd.readouterr().err
    assert "refused" not in err and "error" not in err.lower() and "still waiting" not in err, err
    monkeypatch.setattr(control, "DIAL_QUIET_SEC", 0.2)
    with pytest.raises(TransportTimeoutError, match="cannot connect control"):
        tr.dial("127.0.0.1", free_port(), time.monotonic() + 0.6, "control")
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "still waiting for the leader" in ln]
    assert len(lines) == 1 and "error" not in lines[0].lower(), lines


def test_rdma_advice_is_for_this_platform_and_said_once_per_process(capfd, monkeypatch):
    import mlx_ds4tp as tp
    from mlx_ds4tp.link import advice

    reason = ("tp rdma: no verbs devices (ibv_get_device_list found 0); check `rdma_ctl status` "
              "(macOS: `sudo rdma_ctl enable` in recovery)")
    assert advice.short_reason(reason) == "no verbs devices (ibv_get_device_list found 0)"
    linux, mac = advice.platform_advice(reason, "linux"), advice.platform_advice(reason, "darwin")
    assert "rdma_ctl" not in linux and "loopback" in linux and "ucsim" in linux
    assert "rdma_ctl" in mac and "Mac" in mac
    monkeypatch.setattr(advice, "_advised", False)
    for _ in range(2):  # two pairs, each of two ranks, in this one process
        port = free_port()
        lg, wg = both_ok(
            lambda port=port: tp.init(role="leader", listen=("127.0.0.1", port), transport="auto", timeout=5.0),
            lambda port=port: tp.init(role="worker", coordinator=("127.0.0.1", port), transport="auto",
                                      timeout=5.0),
        )
        lg.close()
        wg.close()
    err = capfd.readouterr().err
    said = [ln for ln in err.splitlines() if "so the gates run over TCP" in ln]
    assert said == ["ds4-tp: " + advice.platform_advice(tr.rdma_probe(None, "")[1])], err
    assert ("rdma_ctl" in err) == (sys.platform == "darwin")


def test_worker_gives_up_after_timeout():
    port = free_port()
    wcfg = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeoutError, match=f"127.0.0.1:{port}"):
        tr.connect(wcfg)
    assert time.monotonic() - t0 < 3.0


def test_leader_gives_up_after_timeout():
    cfg = tr.LinkSettings.of("leader", listen=("127.0.0.1", free_port()), timeout=0.5)
    with pytest.raises(TransportTimeoutError, match="no worker connected"):
        tr.connect(cfg)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"role": "boss", "listen": ("h", 1)}, "role='boss'"),
        ({"role": "leader"}, "the leader needs listen"),
        ({"role": "worker", "coordinator": ("h", 70000)}, "coordinator=\\('h', 70000\\)"),
        ({"role": "leader", "listen": ("h", 1), "transport": "udp"}, "transport='udp'"),
        ({"role": "leader", "listen": ("h", 1), "timeout": -1}, "timeout=-1"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tr.LinkSettings.of(**kwargs)


def test_pair_address_checks_the_triple_once():
    lead = tr.pair_address("leader", ("h", 1), None)
    assert (lead.role, lead.address, lead.rank, lead.coordinator) == ("leader", ("h", 1), 0, None)
    work = tr.pair_address("worker", None, ["h", 2])
    assert (work.address, work.rank, work.listen) == (("h", 2), 1, None)
    with pytest.raises(ValueError, match="--role leader --listen HOST PORT"):
        tr.pair_address("leader", None, ("h", 2))
    with pytest.raises(ValueError, match="--role worker --coordinator HOST PORT"):
        tr.pair_address("worker", ("h", 1), None)
    with pytest.raises(ValueError, match="need a role"):
        tr.pair_address(None, ("h", 1), None)
    with pytest.raises(ValueError, match="--listen HOST PORT"):
        tr.pair_address("leader", ("h", "port"), None)


def test_bad_timeout_env(monkeypatch):
    monkeypatch.setenv("DS4_TP_TIMEOUT_SEC", "soon")
    with pytest.raises(ValueError, match="DS4_TP_TIMEOUT_SEC='soon'"):
        tr.default_timeout()


# ============================================================================
# The exchange (tcp and ucsim rdma): the C entry point the MLX backend calls,
# run on each group's own link from numpy buffers
# ============================================================================


@pytest.fixture(params=TRANSPORTS)
def groups(request):
    lg, wg = make_groups(request.param, timeout=5.0)
    assert lg.transport == wg.transport == request.param
    yield lg, wg
    lg.close()
    wg.close()


def set_timeout(group, seconds: float) -> None:
    """Shorten one rank's waits: the link's deadline (RDMA's hot loops) and the data
    socket's kernel timeouts (TCP, and RDMA's signature swaps)."""
    group.c_link(1 - group.rank()).timeout_s = seconds
    tr.set_kernel_timeout(group.link_to(1 - group.rank()).data, seconds)


# 4 .. 32768 bytes are decode gates (32768: two RDMA chunks); 32772 is the smallest bulk.
@pytest.mark.parametrize("nbytes", [4, 4096, 16384, 16388, 24576, 32768, 32772])
def test_exchange_exact_bytes(groups, nbytes):
    lg, wg = groups
    rng = np.random.default_rng(nbytes)
    for _ in range(40):
        a = rng.integers(0, 255, nbytes, dtype=np.uint8)
        b = rng.integers(0, 255, nbytes, dtype=np.uint8)
        ra, rb = swap(lg, wg, a, b)
        assert np.array_equal(ra, b) and np.array_equal(rb, a)


def test_exchanges_many_in_a_row_with_size_changes(groups):
    lg, wg = groups
    sizes = [16384, 16384, 64, 32768, 16384, 4]

    def run(group, base):
        got = []
        for rep in range(30):
            for n in sizes:
                got.append(int(exchange(group, np.full(n, (base + rep + n) % 251, dtype=np.uint8))[0]))
        return got

    lo, wo = both_ok(lambda: run(lg, 0), lambda: run(wg, 100))
    assert lo == [(100 + rep + n) % 251 for rep in range(30) for n in sizes]
    assert wo == [(0 + rep + n) % 251 for rep in range(30) for n in sizes]
    assert lg.link_to(1).seq == wg.link_to(0).seq == 30 * len(sizes)  # one shared sequence, one number each


def test_exchange_desync_is_loud_on_both_sides(groups):
    """A rank one exchange behind: the signature header (over RDMA swapped ahead of the
    first exchange) names both sequence numbers, on both ranks."""
    lg, wg = groups
    a = np.zeros(16384, np.uint8)
    lg.link_to(1).seq, wg.link_to(0).seq = 4, 5  # the leader is one exchange behind
    (lv, le), (wv, we) = run_both(lambda: exchange(lg, a), lambda: exchange(wg, a))
    assert isinstance(le, DesyncError) and "collective 5" in str(le) and "at 6" in str(le), le
    assert isinstance(we, DesyncError), we


def test_exchange_size_mismatch_fails_fast_naming_both(groups):
    lg, wg = groups
    t0 = time.monotonic()
    (lv, le), (wv, we) = run_both(lambda: exchange(lg, np.zeros(16384, np.uint8)),
                                  lambda: exchange(wg, np.zeros(32768, np.uint8)), timeout=30)
    assert isinstance(le, DesyncError) and "(16384,)" in str(le) and "(32768,)" in str(le), le
    assert isinstance(we, DesyncError), we
    assert time.monotonic() - t0 < 8.0


def test_a_failed_exchange_leaves_the_link_dead(groups):
    """After a failure the streams are in an unknown place: every later exchange fails at
    once naming the first failure, on both ranks, never a wrong payload."""
    lg, wg = groups
    a = np.zeros(4096, np.uint8)
    lg.link_to(1).seq = 7
    run_both(lambda: exchange(lg, a), lambda: exchange(wg, a))
    for g in (lg, wg):
        with pytest.raises(TransportError, match="an earlier collective failed"):
            exchange(g, a)


def test_delayed_peer_is_fine(groups):
    lg, wg = groups
    a = np.arange(4096, dtype=np.float32)
    b = -a
    ra, rb = both_ok(lambda: exchange(lg, a), lambda: (time.sleep(0.7), exchange(wg, b))[1])
    assert np.array_equal(ra, b) and np.array_equal(rb, a)


def test_exchange_timeout_names_seq(groups):
    lg, wg = groups
    if lg.transport == "rdma":
        # Agree on the signature first, so the timeout is the queue pair's own (tp_gate).
        swap(lg, wg, np.zeros(16384, np.uint8), np.zeros(16384, np.uint8))
    set_timeout(lg, 0.5)
    a = np.zeros(16384, np.uint8)
    t0 = time.monotonic()
    lg.link_to(1).seq = 2
    with pytest.raises(TransportTimeoutError, match="seq 3"):
        exchange(lg, a)
    assert time.monotonic() - t0 < 3.0


def test_peer_close_is_detected_fast(groups):
    lg, wg = groups
    a = np.zeros(16384, np.uint8)
    t0 = time.monotonic()
    (lv, le), _ = run_both(lambda: exchange(lg, a), lambda: (time.sleep(0.3), wg.close()))
    assert isinstance(le, PeerClosedError), le
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("nbytes", [2 * MiB - 4, 2 * MiB, 2 * MiB + 4, 7 * MiB, 32772])
def test_bulk_exchanges_at_round_boundaries(groups, nbytes):
    """Above TP_GATE_BYTES the exchange is a bulk one: RDMA rounds of 64 x 16 KiB
    (2 MiB), TCP both directions at once."""
    lg, wg = groups
    rng = np.random.default_rng(nbytes)
    a = rng.integers(0, 255, nbytes, dtype=np.uint8)
    b = rng.integers(0, 255, nbytes, dtype=np.uint8)
    ra, rb = swap(lg, wg, a, b, timeout=60)
    assert np.array_equal(ra, b) and np.array_equal(rb, a)
    if lg.transport == "rdma" and nbytes > 63 * 16384:
        # ucsim refuses the 64th outstanding receive with ENOMEM, as Apple's driver does: the
        # exchange learned the cap and stayed within it, nothing lost or sent twice.
        assert lg.link_to(1).rdma.stats().recv_cap == 63


def test_gates_then_bulk_then_gates(groups):
    """The decode window drained for a bulk exchange and re-armed after it."""
    lg, wg = groups

    def run(group, base):
        got = []
        seq = 0
        for _phase in range(3):
            for _ in range(20):
                seq += 1
                got.append(float(exchange(group, np.full(4096, base + seq, np.float32))[0]))
            seq += 1
            got.append(float(exchange(group, np.full(300_000, base + seq, np.float32))[-1]))
        return got

    lo, wo = both_ok(lambda: run(lg, 0), lambda: run(wg, 1000))
    assert lo == [1000 + s for s in range(1, len(lo) + 1)]
    assert wo == [s for s in range(1, len(wo) + 1)]
    if lg.transport == "rdma":
        assert lg.link_to(1).rdma.stats().window > 0  # the gates ran in the window, re-armed after each bulk


def test_bulk_desync_names_both(groups):
    lg, wg = groups
    (lv, le), (wv, we) = run_both(lambda: exchange(lg, np.zeros(3 * MiB, np.uint8)),
                                  lambda: exchange(wg, np.zeros(3 * MiB + 4, np.uint8)))
    assert isinstance(le, DesyncError) and str(3 * MiB + 4) in str(le) and str(3 * MiB) in str(le)
    assert isinstance(we, DesyncError)


def test_an_exchange_is_built_for_one_shape_and_dtype(groups):
    from mlx_ds4tp.link.exchange import Exchange

    lg, _ = groups
    ex = Exchange(lg.c_link(1), np.zeros(16, np.float32))
    with pytest.raises(ValueError, match=r"recv is float32 \(8,\).*\(16,\)"):
        ex(np.zeros(16, np.float32), np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="int16 is not offered"):
        Exchange(lg.c_link(1), np.zeros(16, np.int16))


# ============================================================================
# A peer killed mid-exchange (two real processes)
# ============================================================================

RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time, numpy as np, mlx_ds4tp as tp
    from mlx_ds4tp.link.exchange import Exchange
    role, port, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kw = dict(transport=transport, timeout=10.0)
    if transport == "rdma":
        kw["rdma_device"] = "ucsim"
    if role == "leader":
        g = tp.init(role="leader", listen=("127.0.0.1", port), **kw)
    else:
        g = tp.init(role="worker", coordinator=("127.0.0.1", port), **kw)
    send = np.ones(4096, np.float32); recv = np.empty_like(send)
    exchange = Exchange(g.c_link(1 - g.rank()), send)
    print("READY", flush=True)
    try:
        while True:
            exchange(send, recv)
    except Exception as exc:
        print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    """
)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("victim", ["worker", "leader"])
def test_peer_killed_mid_exchange(procs, transport, victim):
    port = free_port()
    lead = procs.spawn(["-c", RANK_SCRIPT, "leader", str(port), transport])
    work = procs.spawn(["-c", RANK_SCRIPT, "worker", str(port), transport])
    for p in (lead, work):
        if p.stdout.readline().strip() != "READY":  # it died early: show why
            p.kill()
            out, err = p.communicate(timeout=10)
            pytest.fail(f"a rank exited ({p.returncode}) before READY:\n{out}\n{err}")
    time.sleep(0.3)
    dead, survivor = (work, lead) if victim == "worker" else (lead, work)
    dead.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    out, err = survivor.communicate(timeout=10)
    elapsed = time.monotonic() - t0
    assert survivor.returncode == 3, (out, err)
    assert "FAILED PeerClosedError" in out, (out, err)
    assert elapsed < 2.0, elapsed


# ============================================================================
# Transport choice without an RDMA device (the real ibverbs provider here)
# ============================================================================


def test_rdma_without_a_device_fails_clearly_on_both_ranks():
    """No verbs device on this machine: transport="rdma" must fail on both
    ranks naming the reason, never hang or fall back silently."""
    import mlx_ds4tp as tp

    ok, reason = tr.rdma_probe(None, "")
    assert not ok and no_rdma_reason() in reason
    port = free_port()
    (lv, le), (wv, we) = run_both(
        lambda: tp.init(role="leader", listen=("127.0.0.1", port), transport="rdma", timeout=5.0),
        lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), transport="rdma", timeout=5.0),
    )
    for exc in (le, we):
        assert isinstance(exc, TransportError), exc
        assert "transport=rdma but RDMA is unavailable" in str(exc)
        assert no_rdma_reason() in str(exc)


def test_auto_without_a_device_falls_back_to_tcp_with_one_log_line(capfd):
    import mlx_ds4tp as tp

    port = free_port()
    lg, wg = both_ok(
        lambda: tp.init(role="leader", listen=("127.0.0.1", port), transport="auto", timeout=5.0),
        lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), transport="auto", timeout=5.0),
    )
    with lg, wg:
        assert lg.transport == wg.transport == "tcp"
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "auto: RDMA unavailable" in ln]
    assert len(lines) == 2, err  # one line per rank
    assert all("transport=tcp" in ln and no_rdma_reason() in ln for ln in lines), lines


def test_stranger_between_hello_and_data_connection_is_dropped(capfd):
    """A client that connects in the moment between the worker's hello and its
    gate data connection is dropped; the worker's own data connection wins."""
    port = free_port()
    real_dial = tr.dial

    def dial_with_a_stranger_first(host, p, deadline, what):
        if what == "gate data":
            for junk in (b"\x00" * tr.DATA_HELLO.size, b"GET / HTTP/1.0\r\n\r\n"):
                stranger = socket.create_connection((host, p))
                stranger.sendall(junk)
                stranger.close()
        return real_dial(host, p, deadline, what)

    lc = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=10.0)
    wc = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=10.0)
    lp, wp = both_ok(lambda: tr.connect(lc), lambda: tr.connect(wc, dial=dial_with_a_stranger_first))
    lg, wg = groups_of(lp, wp)
    a, b = np.ones(16, np.float32), np.full(16, 2.0, np.float32)
    ra, rb = swap(lg, wg, a, b)
    lg.close()
    wg.close()
    assert np.array_equal(ra, b) and np.array_equal(rb, a)
    assert capfd.readouterr().err.count("dropped a gate data connection from 127.0.0.1") == 2


@pytest.mark.parametrize("groups", TRANSPORTS, indirect=True)
def test_peer_that_says_goodbye_then_closes_is_detected_fast(groups):
    """An unread goodbye frame (ERROR) in front of the control socket's EOF
    must not hide the close: the exchange fails at once, not at the timeout."""
    lg, wg = groups
    set_timeout(lg, 20.0)
    wg.link_to(0).control.send_error("worker: stopping")
    wg.close()
    a = np.zeros(16384, np.uint8)
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError):
        exchange(lg, a)
    assert time.monotonic() - t0 < 2.0


# ----------------------------------------------------------------------------
# TCP exchange: poll, then sleep
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("spin_us", [0, 1, 5000, 200_000])
def test_tcp_exchanges_are_exact_whatever_the_polling(spin_us):
    lg, wg = make_groups("tcp", timeout=5.0, tcp_spin_us=spin_us)
    try:
        assert lg.link_to(1).spin_ns == wg.c_link(0).spin_ns == spin_us * 1000
        rng = np.random.default_rng(spin_us)
        for n in (1, 1000, 4096, 8192):
            a = rng.standard_normal(n).astype(np.float32)
            b = rng.standard_normal(n).astype(np.float32)
            ra, rb = swap(lg, wg, a, b)
            assert np.array_equal(ra, b) and np.array_equal(rb, a)
        # The raw floor waits the same way.
        a, b = np.ones(4096, np.float32), np.full(4096, 3.0, np.float32)
        ra, rb = np.empty_like(a), np.empty_like(b)
        both_ok(lambda: tr.raw_floor(lg.link_to(1), a, ra), lambda: tr.raw_floor(wg.link_to(0), b, rb))
        assert np.array_equal(ra, b) and np.array_equal(rb, a)
    finally:
        lg.close()
        wg.close()


@pytest.mark.parametrize("spin_us, polls", [(0, False), (1_000_000, True)])
def test_an_exchange_waiting_for_a_late_peer_polls_only_when_asked(spin_us, polls):
    """spin 0 sleeps in the kernel (no CPU while waiting); a spin budget keeps the waiting
    thread on its core, polling, until the late peer's message lands."""
    lg, wg = make_groups("tcp", timeout=20.0, tcp_spin_us=spin_us)
    try:
        a, b = np.ones(4096, np.float32), np.full(4096, 2.0, np.float32)
        leader, worker = Exchange(lg.c_link(1), a), Exchange(wg.c_link(0), b)
        ra, rb = np.empty_like(a), np.empty_like(b)

        def early():
            t0 = time.thread_time()
            leader(a, ra)
            return time.thread_time() - t0

        lib = load_verbs()[1]
        lost_before = lib.tp_yields_lost()
        cpu, _ = both_ok(early, lambda: (time.sleep(1.0), worker(b, rb)))
        lost = lib.tp_yields_lost() - lost_before
        assert np.array_equal(ra, b) and np.array_equal(rb, a)
        # Thresholds that hold on a loaded machine: a thread that sleeps in the kernel uses
        # microseconds for its wake-up and copy; a polling one keeps its core for the 1 s wait
        # unless another task takes the core (a yield given away ends the poll, and the count
        # of such yields says so).
        if polls:
            assert cpu > 0.03 or lost > 0, (cpu, lost)
        else:
            assert cpu < 0.01 and lost == 0, (cpu, lost)
    finally:
        lg.close()
        wg.close()


def test_polling_is_capped_so_a_silent_peer_is_still_reported_in_time():
    lg, wg = make_groups("tcp", timeout=0.8, tcp_spin_us=1_000_000)
    try:
        assert lg.link_to(1).spin_ns == lg.c_link(1).spin_ns == 200_000_000  # a quarter of the timeout
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError, match="seq"):
            exchange(lg, np.ones(16, np.float32))  # the worker never comes to this exchange
        assert time.monotonic() - t0 < 0.8 * 1.25 + 0.5
    finally:
        lg.close()
        wg.close()


@pytest.mark.parametrize("raw, why", [("fast", "not a whole number of microseconds"),
                                      ("-1", "out of range"), ("2000000", "out of range")])
def test_bad_tcp_spin_env_is_refused_before_connecting(monkeypatch, raw, why):
    monkeypatch.setenv("DS4_TP_TCP_SPIN_US", raw)
    with pytest.raises(ValueError, match=rf"DS4_TP_TCP_SPIN_US='{raw}' is {why}"):
        tr.LinkSettings.of("leader", listen=("127.0.0.1", 1))


@pytest.mark.parametrize("bad", [-1, 1_000_001, 2.5, True, "100"])
def test_bad_tcp_spin_argument_is_refused(bad):
    with pytest.raises(ValueError, match=r"tcp_spin_us=.*give 0 \(never poll\) to 1000000"):
        tr.LinkSettings.of("leader", listen=("127.0.0.1", 1), tcp_spin_us=bad)


def test_tcp_spin_env_and_default(monkeypatch):
    monkeypatch.setenv("DS4_TP_TCP_SPIN_US", "250")
    assert tr.LinkSettings.of("leader", listen=("127.0.0.1", 1)).tcp_spin_us == 250
    monkeypatch.delenv("DS4_TP_TCP_SPIN_US")
    assert tr.tcp_spin_us({}, cpu_count=1) == tr.default_tcp_spin_us(1) == 0
    assert tr.tcp_spin_us({}, cpu_count=8) == tr.default_tcp_spin_us(8) == 5000
    assert tr.tcp_spin_us({}, cpu_count=2) == tr.default_tcp_spin_us(2) == 200
    assert tr.LinkSettings.of("leader", listen=("127.0.0.1", 1)).tcp_spin_us == tr.tcp_spin_us({})
