"""Frame fuzzing: random and mutated frames of every type fed to the control
channel's decoder (decode_frame_header, ControlChannel.recv over a socketpair,
Hello.unpack) and to the worker's command loop (lockstep.protocol.sessions.serve_worker), and
strangers (scanners, curl, garbage, half hellos) knocking on a waiting leader.

Every case is checked against a small reference model of the wire format, not
only for "no crash": the same frames come out, the same error class is raised,
the decoder consumed exactly the bytes the reference says (a header that claims
too many bytes is refused before a single payload byte is read), and the only
buffers allocated are for payloads within their type's bound. Every case runs
under a SIGALRM deadline, so a hang fails the test instead of stalling it.

The quick versions (a few thousand cases each) run unmarked; the 100k-case runs
are marked `slow`. DS4_TP_FUZZ_SEED picks another seed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import struct
import threading
import time
from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mlx_ds4tp import transport as tr
from mlx_ds4tp.errors import (
    FrameError,
    HelloMismatchError,
    PeerClosedError,
    TransportError,
)
from mlx_ds4tp.link import wire
from mlx_ds4tp.lockstep.caches.prompt_cache import FRESH
from mlx_ds4tp.lockstep.errors import MeshReformingError
from mlx_ds4tp.lockstep.protocol.commands import (
    Create,
    Destroy,
    DiskLoad,
    EvalBatch,
    Hash,
    Invalidate,
    KvRoom,
    PrefillBatch,
    Rewind,
    Sampler,
    check_tokens,
)
from mlx_ds4tp.lockstep.protocol.sessions import serve_worker
from mlx_ds4tp.lockstep.protocol.table import SessionTable
from mlx_ds4tp.lockstep.sampling.options import SamplingOptions
from pairutil import dial_when_listening, free_port

F = tr.FrameType
HEADER = tr.FRAME_HEADER
SEED = int(os.environ.get("DS4_TP_FUZZ_SEED", "20240607"))
VOCAB = 512
CASE_LIMIT_SEC = 5.0  # any single case running this long is a hang
QUICK_CASES = 5000
SLOW_CASES = 100_000


# ============================================================================
# Valid frames of every type, and mutations of them
# ============================================================================

IDENTITY = tr.ModelIdentity(layers=2, hidden=128, vocab=VOCAB, quant_bits=0, gates_per_token=6)


def valid_hello(role: int = 1) -> tr.Hello:
    return tr.Hello(role=role, transport="tcp", rdma_ok=False, rdma_reason="transport=tcp requested",
                    session_id=0x1234, identity=IDENTITY)


def valid_payloads() -> dict:
    """A well-formed payload for each frame type, as the code that sends it builds it."""
    known = {
        F.PREFILL_BATCH: PrefillBatch.pack([(1, [5, 6, 7])]),
        F.SAMPLER: Sampler.pack(1, SamplingOptions(temperature=0.5), [5, 6, 7], 9),
        F.EVAL_BATCH: EvalBatch.pack(1, [(1, 42)]),
        F.REWIND: Rewind.pack(1, 4, 0),
        F.INVALIDATE: Invalidate.pack(1),
        F.STOP: b"",
        F.HASH: Hash.pack(0, 2, 0x1234),
        F.RDMA_INFO: wire.RDMA_INFO.pack(0x11, 0x22, 1024, 0, 1, bytes(10) + b"\xff\xff\x7f\x00\x00\x01"),
        F.RDMA_READY: b"",
        F.SESSION_CREATE: Create.pack(1, 0, FRESH, 0),
        F.SESSION_DESTROY: Destroy.pack(1, 0),
        F.RDMA_WARM: wire.WARM_ROUND.pack(0, 1, 1, wire.WARM_PHASE_STATUS),
        F.RDMA_POSTED: struct.pack("<I", 1),
        F.HELLO: valid_hello().pack(),
        F.ERROR: b"model mismatch: hidden is 64 here and 128 on the worker",
        F.RDMA_STATUS: wire.STATUS.pack(1, 2) + b"ok",
        F.AUTH: bytes(32),
    }
    # A frame type added later still gets fuzzed, with a plain payload.
    return {t: known.get(t, bytes(min(16, tr.FRAME_MAX_BYTES[t]))) for t in F}


PAYLOADS = valid_payloads()


def frame(ftype: int, payload: bytes = b"", magic: int = tr.MAGIC, nbytes: Optional[int] = None) -> bytes:
    return HEADER.pack(magic, int(ftype), len(payload) if nbytes is None else nbytes) + payload


def _u32(r: random.Random) -> int:
    return r.getrandbits(32)


def _set_header(data: bytes, magic=None, ftype=None, nbytes=None) -> bytes:
    if len(data) < HEADER.size:
        data = data + bytes(HEADER.size - len(data))
    m, t, n = HEADER.unpack_from(data)
    m = m if magic is None else magic
    t = t if ftype is None else ftype
    n = n if nbytes is None else nbytes
    return HEADER.pack(m, t, n) + data[HEADER.size:]


def _bound_of(data: bytes) -> int:
    """The bound of the type this frame's header names (or the largest bound)."""
    if len(data) >= HEADER.size:
        try:
            return tr.FRAME_MAX_BYTES[F(HEADER.unpack_from(data)[1])]
        except ValueError:
            pass
    return max(tr.FRAME_MAX_BYTES.values())


def m_flip_bits(r, d):
    if not d:
        return d
    b = bytearray(d)
    for _ in range(r.randint(1, 8)):
        i = r.randrange(len(b))
        b[i] ^= 1 << r.randrange(8)
    return bytes(b)


def m_set_bytes(r, d):
    if not d:
        return d
    b = bytearray(d)
    for _ in range(r.randint(1, 4)):
        b[r.randrange(len(b))] = r.randrange(256)
    return bytes(b)


def m_truncate(r, d):
    return d[: r.randrange(len(d))] if d else d


def m_extend(r, d):  # trailing bytes the header does not count
    return d + r.randbytes(r.randint(1, 64))


def m_grow_payload(r, d):  # a longer payload, and a header that counts it
    extra = r.randbytes(r.choice([1, 3, 4, 8, r.randint(1, 300)]))
    d = _set_header(d)
    n = HEADER.unpack_from(d)[2]
    return _set_header(d + extra, nbytes=(n + len(extra)) & 0xFFFFFFFF)


def m_shrink_payload(r, d):  # a shorter payload, and a header that counts it
    d = _set_header(d)
    payload = d[HEADER.size:]
    cut = r.randint(0, len(payload))
    return _set_header(d[: HEADER.size + cut], nbytes=cut)


def m_wrong_magic(r, d):
    swapped = struct.unpack("<I", struct.pack(">I", tr.MAGIC))[0]
    magic = r.choice([0, _u32(r), swapped, tr.MAGIC ^ (1 << r.randrange(32)), tr.load_verbs()[1].TP_EXCHANGE_MAGIC,
                      tr.DATA_MAGIC, 0xFFFFFFFF])
    return _set_header(d, magic=magic)


def m_wrong_type(r, d):
    used = {int(t) for t in F}
    unused = [n for n in range(0, 40) if n not in used]
    return _set_header(d, ftype=r.choice([r.choice(unused), _u32(r), 0xFFFFFFFF, r.choice(sorted(used))]))


def m_huge_count(r, d):
    bound = _bound_of(d)
    return _set_header(d, nbytes=r.choice([bound + 1, bound + r.randint(2, 1 << 16), 1 << 31,
                                           0xFFFFFFFF, r.randint(bound + 1, 0xFFFFFFFF)]))


def m_count_within(r, d):
    """A byte count the bound allows but the bytes that follow do not match."""
    bound = _bound_of(d)
    n = HEADER.unpack_from(_set_header(d))[2]
    choices = [0, max(0, n - 1), n + 1, min(bound, n + r.randint(1, 64)), r.randint(0, min(bound, 4096))]
    if r.random() < 0.02:
        choices.append(bound)  # the largest claim allowed: allocated, then EOF
    return _set_header(d, nbytes=min(bound, r.choice(choices)))


def m_insert_delete(r, d):
    b = bytearray(d)
    for _ in range(r.randint(1, 3)):
        if b and r.random() < 0.5:
            del b[r.randrange(len(b))]
        else:
            b.insert(r.randint(0, len(b)), r.randrange(256))
    return bytes(b)


def m_splice(r, d):
    other = random_valid_frame(r)
    return d + other if r.random() < 0.7 else other + d


def m_random(r, d):
    return r.randbytes(r.randint(0, 64))


HTTP_GET = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n"
SSH_BANNER = b"SSH-2.0-OpenSSH_9.6\r\n"
TLS_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32)  # a TLS ClientHello's start
FOREIGN = [HTTP_GET, SSH_BANNER, TLS_HELLO, b"\x00" * 64, b"\xff" * 64,
           struct.pack(">III", tr.MAGIC, int(F.HELLO), 64)]  # the last: a big-endian peer


def m_foreign(r, d):
    return r.choice(FOREIGN)


MUTATORS: List[Callable] = [
    m_flip_bits, m_set_bytes, m_truncate, m_extend, m_grow_payload, m_shrink_payload,
    m_wrong_magic, m_wrong_type, m_huge_count, m_count_within, m_insert_delete, m_splice,
    m_random, m_foreign,
]


def random_valid_frame(r) -> bytes:
    t = r.choice(list(F))
    return frame(t, PAYLOADS[t])


def mutated_frames(r) -> List[bytes]:
    """One or more frames, some valid, most mutated (1-3 mutations each)."""
    parts = []
    for _ in range(r.choice([1, 1, 1, 2, 3])):
        d = random_valid_frame(r)
        if r.random() < 0.85:
            for _ in range(r.randint(1, 3)):
                d = r.choice(MUTATORS)(r, d)
        parts.append(d)
    return parts


def mutated_stream(r) -> bytes:
    return b"".join(mutated_frames(r))


# ============================================================================
# The reference model of the control channel
# ============================================================================


def reference_header(magic: int, ftype: int, nbytes: int) -> Optional[str]:
    """None when the header is acceptable, else the text the error must contain."""
    if magic != tr.MAGIC:
        return f"bad frame magic 0x{magic:08x}"
    if ftype not in {int(t) for t in F}:
        return f"unknown frame type {ftype}"
    bound = tr.FRAME_MAX_BYTES[F(ftype)]
    if nbytes > bound:
        return f"claims {nbytes} bytes, over its {bound}-byte bound"
    return None


def reference_recv(data: bytes, expect: Optional[F]):
    """(frames, error class, text the error contains, bytes consumed, payload sizes allocated)."""
    pos, frames, allocs = 0, [], []
    while True:
        if len(data) - pos < HEADER.size:
            text = "truncated at" if len(data) > pos else "EOF"
            return frames, PeerClosedError, text, len(data), allocs
        magic, ftype, n = HEADER.unpack_from(data, pos)
        bad = reference_header(magic, ftype, n)
        if bad is not None:
            return frames, FrameError, bad, pos + HEADER.size, allocs
        allocs.append(n)
        if len(data) - pos - HEADER.size < n:
            text = ("truncated at" if len(data) > pos + HEADER.size
                    else f"EOF) while waiting for {F(ftype).name} payload")
            return frames, PeerClosedError, text, len(data), allocs
        payload = data[pos + HEADER.size : pos + HEADER.size + n]
        pos += HEADER.size + n
        if ftype == F.ERROR and expect != F.ERROR:
            return frames, TransportError, "peer reported: ", pos, allocs
        if expect is not None and ftype != expect:
            return frames, FrameError, f"expected a {expect.name} frame, got {F(ftype).name}", pos, allocs
        frames.append((F(ftype), payload))


class AllocationSpy:
    """Stands in for bytearray inside transport.py: records every size asked for."""

    def __init__(self) -> None:
        self.sizes: List[int] = []

    def __call__(self, *args):
        if args and isinstance(args[0], int):
            self.sizes.append(args[0])
        return bytearray(*args)


@pytest.fixture
def alloc_spy():
    return AllocationSpy()


class Hang(BaseException):
    """Raised by SIGALRM inside a case that ran past CASE_LIMIT_SEC."""


@contextlib.contextmanager
def case_deadline():
    """Arm a per-case SIGALRM deadline with deadline(); a hang raises Hang."""

    def on_alarm(signum, frame_):
        raise Hang(f"a fuzz case ran past {CASE_LIMIT_SEC} s")

    old = signal.signal(signal.SIGALRM, on_alarm)

    def arm(seconds: float = CASE_LIMIT_SEC) -> None:
        signal.setitimer(signal.ITIMER_REAL, seconds)

    try:
        yield arm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _drain(sock: socket.socket) -> bytes:
    """What is left in the stream (the writer has shut down, so this ends)."""
    out = []
    sock.settimeout(2.0)
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return b"".join(out)
        out.append(chunk)


def run_channel(data: bytes, expect: Optional[F], spy: AllocationSpy):
    """Feed data to ControlChannel.recv until it raises; returns what it did."""
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        ch = tr.ControlChannel(b, 2.0, alloc=spy)
        spy.sizes.clear()
        frames = []
        while True:
            try:
                frames.append(ch.recv(expect))
            except TransportError as exc:
                return frames, exc, len(data) - len(_drain(b)), list(spy.sizes)
    finally:
        a.close()
        b.close()


def check_channel_case(data: bytes, expect: Optional[F], spy: AllocationSpy) -> None:
    frames, exc, consumed, allocs = run_channel(data, expect, spy)
    want = reference_recv(data, expect)
    ctx = f"stream {data[:96].hex()}{'...' if len(data) > 96 else ''} ({len(data)} bytes), expect={expect}"
    assert frames == want[0], ctx
    assert type(exc) is want[1], f"{ctx}: raised {type(exc).__name__}: {exc}, reference {want[1].__name__}"
    assert want[2] in str(exc), f"{ctx}: error {exc!r} does not say {want[2]!r}"
    assert consumed == want[3], f"{ctx}: read {consumed} bytes, the reference {want[3]}"
    assert allocs == want[4], f"{ctx}: allocated {allocs}, the reference {want[4]}"
    for ftype, payload in frames:
        assert len(payload) <= tr.FRAME_MAX_BYTES[ftype]


def check_header_case(magic: int, ftype: int, nbytes: int) -> None:
    bad = reference_header(magic, ftype, nbytes)
    try:
        got = tr.decode_frame_header(magic, ftype, nbytes)
    except FrameError as exc:
        assert bad is not None, f"({magic:#x}, {ftype}, {nbytes}) refused: {exc}"
        assert bad in str(exc), (str(exc), bad)
        return
    assert bad is None, f"({magic:#x}, {ftype}, {nbytes}) accepted, should fail with {bad!r}"
    assert got == ftype and nbytes <= tr.FRAME_MAX_BYTES[got]


def check_hello_case(payload: bytes) -> None:
    try:
        h = tr.Hello.unpack(payload)
    except (FrameError, HelloMismatchError) as exc:
        assert str(exc), "an error without a message"
        return
    magic, version, role = struct.unpack_from("<III", payload)
    assert len(payload) >= tr.HELLO_FIXED.size
    assert (magic, version) == (tr.MAGIC, tr.PROTOCOL_VERSION) and role in (0, 1), payload.hex()
    assert h.transport in tr.TRANSPORT_CODES
    # What unpack accepts, pack writes back to an equal hello.
    if len(h.rdma_reason.encode("utf-8")) <= tr.MAX_REASON_BYTES:
        assert tr.Hello.unpack(h.pack()) == h, payload.hex()


def random_hello_payload(r) -> bytes:
    if r.random() < 0.15:
        return r.randbytes(r.randint(0, 200))
    h = valid_hello(r.randint(0, 1))
    h.rdma_reason = r.choice(["", "x" * r.randint(0, 600), "no verbs devices \u00e9\u4e2d"])
    if r.random() < 0.5:  # a rank with a model fingerprint
        h.fingerprint = r.randbytes(tr.FINGERPRINT_SUMMARY.size)
    d = h.pack()
    for _ in range(r.randint(0, 3)):
        if not d:
            break
        i = r.randrange(len(d))
        op = r.randrange(4)
        if op == 0:
            d = d[:i] + bytes([r.randrange(256)]) + d[i + 1:]
        elif op == 1:
            d = d[:i]
        elif op == 2:
            d = d + r.randbytes(r.randint(1, 16))
        else:  # a field set to an extreme value
            j = 4 * r.randrange(tr.HELLO_FIXED.size // 4)
            d = d[:j] + struct.pack("<I", r.choice([0, 1, 2, 3, 0xFFFFFFFF])) + d[j + 4:]
    return d


def random_header(r) -> Tuple[int, int, int]:
    t = r.choice(list(F))
    bound = tr.FRAME_MAX_BYTES[t]
    magic = tr.MAGIC if r.random() < 0.7 else r.choice([_u32(r), struct.unpack("<I", struct.pack(">I", tr.MAGIC))[0]])
    ftype = int(t) if r.random() < 0.8 else _u32(r) if r.random() < 0.5 else r.randrange(64)
    nbytes = r.choice([0, bound, bound + 1, r.randint(0, bound), _u32(r), 0xFFFFFFFF, 1 << 31])
    return magic, ftype, nbytes


def fuzz_transport(cases: int, seed: int, spy: AllocationSpy) -> dict:
    """Header, stream and hello cases; returns counts."""
    r = random.Random(seed)
    counts = {"headers": 0, "streams": 0, "hellos": 0, "frames": 0}
    expects = [None, None, None] + list(F)
    with case_deadline() as arm:
        for _ in range(cases):
            arm()
            check_header_case(*random_header(r))
            parts = mutated_frames(r)
            check_channel_case(b"".join(parts), r.choice(expects), spy)
            check_hello_case(random_hello_payload(r))
            counts["headers"] += 1
            counts["streams"] += 1
            counts["hellos"] += 1
            counts["frames"] += len(parts)
    return counts


# ============================================================================
# The control channel: quick, hypothesis, slow
# ============================================================================


def test_fuzz_control_channel_quick(alloc_spy):
    t0 = time.monotonic()
    counts = fuzz_transport(QUICK_CASES, SEED, alloc_spy)
    print(f"control channel fuzz: {counts} in {time.monotonic() - t0:.1f} s (seed {SEED})")


@pytest.mark.slow
def test_fuzz_control_channel_100k(alloc_spy):
    t0 = time.monotonic()
    counts = fuzz_transport(SLOW_CASES, SEED + 1, alloc_spy)
    print(f"control channel fuzz: {counts} in {time.monotonic() - t0:.1f} s (seed {SEED + 1})")
    assert counts["streams"] >= 100_000


HYPOTHESIS = settings(max_examples=600, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@HYPOTHESIS
@given(magic=st.one_of(st.just(tr.MAGIC), st.integers(0, 2**32 - 1)),
       ftype=st.one_of(st.sampled_from([int(t) for t in F]), st.integers(0, 2**32 - 1)),
       nbytes=st.one_of(st.sampled_from(sorted({b + d for b in tr.FRAME_MAX_BYTES.values() for d in (-1, 0, 1)})),
                        st.integers(0, 2**32 - 1)))
def test_hypothesis_decode_frame_header(magic, ftype, nbytes):
    check_header_case(magic, ftype, nbytes)


@HYPOTHESIS
@given(rnd=st.randoms(use_true_random=False), expect=st.one_of(st.none(), st.sampled_from(list(F))))
def test_hypothesis_control_channel_recv(alloc_spy, rnd, expect):
    with case_deadline() as arm:
        arm()
        check_channel_case(mutated_stream(rnd), expect, alloc_spy)


@HYPOTHESIS
@given(data=st.one_of(st.binary(max_size=300),
                      st.randoms(use_true_random=False).map(random_hello_payload)))
def test_hypothesis_hello_unpack(data):
    check_hello_case(data)


@pytest.mark.parametrize("ftype", list(F))
def test_every_type_claiming_over_its_bound_is_refused_before_reading(alloc_spy, ftype):
    """The header of each type claiming bound+1 and 4 GiB - 1 bytes, followed by
    real payload bytes: FrameError naming both numbers, no allocation, and not a
    payload byte consumed."""
    bound = tr.FRAME_MAX_BYTES[ftype]
    for claim in (bound + 1, 0xFFFFFFFF):
        data = frame(ftype, b"\xaa" * 100, nbytes=claim)
        frames, exc, consumed, allocs = run_channel(data, None, alloc_spy)
        assert isinstance(exc, FrameError) and f"claims {claim} bytes, over its {bound}-byte bound" in str(exc)
        assert consumed == HEADER.size and allocs == [] and frames == []


# ============================================================================
# The worker's command loop
# ============================================================================


class ModelMisuseError(AssertionError):
    """The worker handed the model something it must have refused."""


class StubModel:
    """Stands in for the split model in the bulk of the worker fuzzing: a
    forward costs microseconds, and it checks every input (the oracle: the
    worker must never pass an empty or out-of-vocabulary input to the model,
    where MLX's unchecked gather would read past the embedding)."""

    def __init__(self, vocab: int = VOCAB):
        self.args = SimpleNamespace(vocab_size=vocab)
        self.calls = 0
        # The prompt's prefix goes through the inner model (lockstep.fill_cache): checked alike.
        self.model = self

    def make_cache(self):
        return []

    def __call__(self, inputs, cache=None):
        ids = np.array(inputs)
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
            raise ModelMisuseError(f"model called with ids of shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.args.vocab_size:
            raise ModelMisuseError(f"model called with ids outside [0, {self.args.vocab_size}): {ids}")
        self.calls += 1
        return mx.zeros((1, ids.shape[1], 16)) + float(ids.sum() % 13)


class StubGroup:
    """What serve_worker needs of a Group: the control channel (a socketpair end)."""

    def __init__(self, control: tr.ControlChannel):
        self.leader = SimpleNamespace(control=control)

    def link_to(self, peer: int) -> SimpleNamespace:
        assert peer == 0, peer  # a worker's one channel is to the leader
        return self.leader

    def size(self) -> int:
        return 2  # a pair's worker: a REFORM ends its loop (MeshReformingError), as for any N


def worker_script(r) -> Tuple[bytes, str, int]:
    """A command sequence a leader would send, then damaged: (bytes, what was
    done, frames in it)."""
    s = r.randrange(1, 1 << 16)
    toks = [r.randrange(VOCAB) for _ in range(r.randint(1, 8))]
    frames = [
        frame(F.SESSION_CREATE, Create.pack(s, 0, FRESH, 0)),
        frame(F.PREFILL_BATCH, PrefillBatch.pack([(s, toks)])),
        frame(F.EVAL_BATCH, EvalBatch.pack(1, [(s, r.randrange(VOCAB))])),
        frame(F.EVAL_BATCH, EvalBatch.pack(2, [(s, r.randrange(VOCAB))])),
        frame(F.SESSION_DESTROY, Destroy.pack(s, 0)),
        frame(F.STOP),
    ]
    bad_token = r.choice([VOCAB, VOCAB + 1, -1, -(2**31), 2**31 - 1, r.randrange(VOCAB, 2**31)])
    ops = {
        "none": lambda: None,
        "mutate": lambda: _mutate_at(r, frames, r.randrange(len(frames))),
        "mutate2": lambda: [_mutate_at(r, frames, r.randrange(len(frames))) for _ in range(2)],
        "insert-valid": lambda: frames.insert(r.randrange(len(frames) + 1), random_valid_frame(r)),
        "insert-random": lambda: frames.insert(r.randrange(len(frames) + 1), mutated_stream(r)),
        "delete": lambda: frames.pop(r.randrange(len(frames))),
        "swap": lambda: _swap(r, frames),
        "eval-bad-token": lambda: frames.__setitem__(2, frame(F.EVAL_BATCH, EvalBatch.pack(1, [(s, bad_token)]))),
        "prefill-bad-token": lambda: frames.__setitem__(1, frame(F.PREFILL_BATCH, PrefillBatch.pack(
            [(s, [3, bad_token])]))),
        "prefill-empty": lambda: frames.__setitem__(1, frame(F.PREFILL_BATCH, _prefill_claiming(s, 0, []))),
        "prefill-count": lambda: frames.__setitem__(1, frame(F.PREFILL_BATCH, _prefill_claiming(
            s, r.choice([len(toks) + 1, 2**32 - 1]), toks))),
        "unknown-session": lambda: frames.__setitem__(2, frame(F.EVAL_BATCH, EvalBatch.pack(1, [(s + 1, 7)]))),
        "sampler-bad-token": lambda: frames.insert(2, frame(F.SAMPLER, Sampler.pack(
            s, SamplingOptions(), [bad_token], 0))),
        "sampler-cut": lambda: frames.insert(2, frame(F.SAMPLER, _cut_sampler(r, s))),
        "hash": lambda: frames.insert(r.randint(0, 4), frame(F.HASH, Hash.pack(0, 1, _u32(r)))),
        "cut": lambda: None,
    }
    name = r.choice(list(ops) + ["mutate"] * 4)
    ops[name]()
    data = b"".join(frames)
    if name == "cut":
        data = data[: r.randrange(len(data))]
    return data, name, len(frames)


def _prefill_claiming(session: int, count: int, tokens: list) -> bytes:
    """A PREFILL_BATCH of one row whose count says `count` tokens, carrying `tokens`."""
    return (PrefillBatch.header.pack(1, 0, 0) + np.array([(session, count, 0)], dtype=PrefillBatch.row).tobytes()
            + np.array(tokens, "<i4").tobytes())


def _cut_sampler(r, session: int) -> bytes:
    payload = Sampler.pack(session, SamplingOptions(temperature=0.5), [3, 4], 9)
    return payload[: r.randrange(len(payload))]


def _mutate_at(r, frames: list, i: int) -> None:
    d = frames[i]
    for _ in range(r.randint(1, 2)):
        d = r.choice(MUTATORS)(r, d)
    frames[i] = d


def _swap(r, frames: list) -> None:
    i, j = r.randrange(len(frames)), r.randrange(len(frames))
    frames[i], frames[j] = frames[j], frames[i]


WORKER_ERRORS = {
    "eval-bad-token": "outside the model's vocabulary",
    "prefill-bad-token": "outside the model's vocabulary",
    "prefill-empty": "a prompt needs at least one",
    "prefill-count": "PREFILL_BATCH rows say",
    "unknown-session": "does not exist",
    "sampler-bad-token": "outside the model's vocabulary",
    "sampler-cut": "SAMPLER",
}


def run_worker_case(model, data: bytes, name: str) -> str:
    """Serve one script; returns the outcome. The worker's replies must be
    well-formed HASH frames, DISK_LOAD answers (this worker has no disk cache:
    it never loaded) or KV_ROOM answers."""
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        try:
            table = serve_worker(StubGroup(tr.ControlChannel(b, 2.0)), model, tell_leader=False)
            outcome = f"served {table.ended}"
        except MeshReformingError as exc:  # a REFORM frame: the leader forms the group again
            outcome = f"reform ({exc})"
        except TransportError as exc:
            assert str(exc), "an error without a message"
            outcome = type(exc).__name__
            if name in WORKER_ERRORS:
                assert WORKER_ERRORS[name] in str(exc), (name, str(exc), data.hex())
        b.shutdown(socket.SHUT_WR)
        replies = tr.ControlChannel(a, 2.0)
        while True:
            try:
                ftype, payload = replies.recv()
            except PeerClosedError as exc:
                assert "EOF" in str(exc), f"the worker wrote a truncated reply: {exc}"
                break
            assert ftype in (F.HASH, F.DISK_LOAD, F.KV_ROOM), ftype
            if ftype == F.DISK_LOAD:
                assert len(payload) == DiskLoad.layout.size
                assert DiskLoad.unpack(payload)[2] == 0, "loaded without a directory"
            elif ftype == F.KV_ROOM:
                assert len(payload) == KvRoom.layout.size
                assert KvRoom.unpack(payload)[2] in (0, 1), "measured is a flag"
            else:
                assert len(payload) == Hash.layout.size
        if name == "none":
            assert outcome == "served 1", outcome
        return outcome
    finally:
        a.close()
        b.close()


def fuzz_worker(model, cases: int, seed: int) -> dict:
    r = random.Random(seed)
    outcomes: dict = {}
    frames = 0
    with case_deadline() as arm:
        for _ in range(cases):
            data, name, nframes = worker_script(r)
            arm()
            try:
                outcome = run_worker_case(model, data, name)
            except ModelMisuseError as exc:
                raise AssertionError(f"case {name} {data.hex()}: {exc}") from None
            except AssertionError:
                raise
            except Exception as exc:  # anything but our TransportError family is a bug
                raise AssertionError(f"case {name} {data.hex()}: {type(exc).__name__}: {exc}") from exc
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            frames += nframes
    outcomes["frames"] = frames
    return outcomes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny llama, unsplit: the worker loop does not care, and a forward needs no peer."""
    from mlx_lm.utils import load

    from mlx_ds4tp.synthetic.tiny_model import save_llama

    model, _ = load(str(save_llama(tmp_path_factory.mktemp("fuzz-model"), "tiny", seed=5)))
    return model


def test_fuzz_worker_quick():
    model = StubModel()
    t0 = time.monotonic()
    out = fuzz_worker(model, 3000, SEED + 2)
    print(f"worker fuzz (stub model): {out}, {model.calls} forwards, {time.monotonic() - t0:.1f} s")
    assert out.get("served 1", 0) > 0 and out.get("FrameError", 0) > 0 and model.calls > 0


def test_fuzz_worker_tiny_model_quick(tiny_model):
    t0 = time.monotonic()
    out = fuzz_worker(tiny_model, 300, SEED + 3)
    print(f"worker fuzz (tiny model): {out} in {time.monotonic() - t0:.1f} s")
    assert out.get("served 1", 0) > 0


@pytest.mark.slow
def test_fuzz_worker_100k():
    model = StubModel()
    t0 = time.monotonic()
    out = fuzz_worker(model, SLOW_CASES, SEED + 4)
    print(f"worker fuzz (stub model): {out}, {model.calls} forwards, {time.monotonic() - t0:.1f} s")
    assert out["frames"] >= 100_000


@pytest.mark.slow
def test_fuzz_worker_tiny_model_5k(tiny_model):
    t0 = time.monotonic()
    out = fuzz_worker(tiny_model, 5000, SEED + 5)
    print(f"worker fuzz (tiny model): {out} in {time.monotonic() - t0:.1f} s")


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False))
def test_hypothesis_worker_serve(rnd):
    data, name, _ = worker_script(rnd)
    with case_deadline() as arm:
        arm()
        run_worker_case(_HYPOTHESIS_MODEL, data, name)


_HYPOTHESIS_MODEL = StubModel()


def test_real_model_rejects_out_of_vocabulary_ids(tiny_model):
    """The reason for the worker's check: MLX gathers without bounds checks."""
    table = SessionTable(tiny_model)
    assert table.vocab == VOCAB
    for bad in (VOCAB, -1, 2**31 - 1):
        with pytest.raises(FrameError, match=f"token id {bad}, outside the model's vocabulary"):
            check_tokens(np.array([1, bad]), table.vocab)


# ============================================================================
# Strangers at the leader's door (real sockets)
# ============================================================================


def _stranger(
    port: int,
    junk: bytes,
    *,
    read_hello_first: bool,
    keep_open: bool,
    accepted_event: Optional[threading.Event] = None,
) -> Optional[float]:
    """Connect, optionally wait for the leader's hello (proof it accepted us),
    send junk, then close or keep silent until the leader hangs up. Returns how
    long the leader held a silent connection (accept to its close)."""
    s = dial_when_listening(port)
    try:
        accepted = None
        if read_hello_first:
            s.settimeout(30)
            head = s.recv(HEADER.size, socket.MSG_WAITALL)
            assert HEADER.unpack(head)[:2] == (tr.MAGIC, int(F.HELLO)), head
            accepted = time.monotonic()
            if accepted_event is not None:
                accepted_event.set()
        if junk:
            s.sendall(junk)
        if not keep_open:
            return None
        s.settimeout(60)
        while s.recv(4096):
            pass
        return time.monotonic() - accepted
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - accepted if accepted else None
    finally:
        s.close()


def test_leader_drops_strangers_and_keeps_waiting(capfd):
    """Scanner, curl, TLS, SSH, garbage, oversized and wrong-type frames, an
    ERROR frame, a truncated hello, and three that go silent (after connecting,
    mid-header, mid-hello): each is logged and dropped, silent ones after the
    short hello timeout, and the real worker then joins."""
    hello_timeout = 0.5
    port = free_port()
    cfg = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=60.0, hello_timeout=hello_timeout)
    wcfg = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=60.0)
    hello = frame(F.HELLO, valid_hello().pack())
    strangers = [
        ("scanner", b"", False, False),
        ("curl", HTTP_GET, True, False),
        ("tls", TLS_HELLO, True, False),
        ("ssh", SSH_BANNER, False, False),
        ("garbage", random.Random(1).randbytes(256), True, False),
        ("oversized", frame(F.HELLO, b"x" * 64, nbytes=0xFFFFFFFF), True, False),
        ("wrong-type", frame(F.STOP), True, False),
        ("error-frame", frame(F.ERROR, b"go away"), True, False),
        ("short-hello", frame(F.HELLO, valid_hello().pack()[:20]), True, False),
        ("half-hello-close", hello[:30], True, False),
        ("silent", b"", True, True),
        ("silent-mid-header", hello[:7], True, True),
        ("silent-mid-hello", hello[: len(hello) // 2], True, True),
    ]
    holds = {}

    def strangers_then_worker():
        for name, junk, first, keep in strangers:
            held = _stranger(port, junk, read_hello_first=first, keep_open=keep)
            if keep:
                holds[name] = held
            time.sleep(0.05)
        return tr.connect(wcfg)

    from pairutil import both_ok, groups_of, swap

    t0 = time.monotonic()
    lp, wp = both_ok(lambda: tr.connect(cfg), strangers_then_worker, timeout=60)
    elapsed = time.monotonic() - t0
    try:
        assert lp.transport == wp.transport == "tcp"
        # The pair works after all that.
        a, b = np.arange(1024, dtype=np.float32), np.ones(1024, np.float32)
        ra, rb = swap(*groups_of(lp, wp), a, b)
        assert np.array_equal(ra, b) and np.array_equal(rb, a)
    finally:
        lp.close()
        wp.close()
    err = capfd.readouterr().err
    assert err.count("that sent no valid hello") == len(strangers), err
    for name, held in holds.items():
        assert held is not None and hello_timeout - 0.1 <= held < hello_timeout + 1.0, (name, held)
    assert elapsed < 3 * hello_timeout + 10, elapsed


def test_half_hello_then_silence_holds_the_leader_only_for_the_hello_timeout(capfd):
    """A client that sends half a hello and goes silent while the real worker
    is already dialing: the worker is in within the hello timeout, not the
    (much longer) connect timeout."""
    hello_timeout = 1.0
    port = free_port()
    cfg = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=60.0, hello_timeout=hello_timeout)
    wcfg = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=60.0)
    hello = frame(F.HELLO, valid_hello().pack())
    result = {}
    squatter_in = threading.Event()

    def squatter():
        result["held"] = _stranger(
            port, hello[:40], read_hello_first=True, keep_open=True, accepted_event=squatter_in
        )

    holder = threading.Thread(target=squatter, daemon=True)
    result_box = {}
    leader = threading.Thread(target=lambda: result_box.setdefault("lp", tr.connect(cfg)), daemon=True)
    leader.start()
    holder.start()
    # Dial only once the leader has accepted the squatter and is held by it.
    assert squatter_in.wait(20), "the leader never accepted the squatter"
    time.sleep(0.05)
    t0 = time.monotonic()
    wp = tr.connect(wcfg)
    worker_wait = time.monotonic() - t0
    leader.join(10)
    holder.join(10)
    lp = result_box["lp"]
    lp.close()
    wp.close()
    assert worker_wait < hello_timeout + 1.0, worker_wait
    assert hello_timeout - 0.1 <= result["held"] < hello_timeout + 1.0, result
    assert "that sent no valid hello" in capfd.readouterr().err
    assert lp.config.hello_timeout == hello_timeout


def test_default_hello_timeout_is_short(monkeypatch):
    monkeypatch.delenv("DS4_TP_HELLO_TIMEOUT_SEC", raising=False)
    assert 0 < tr.LinkSettings.of("leader", listen=("127.0.0.1", 1)).hello_timeout <= 10.0
    monkeypatch.setenv("DS4_TP_HELLO_TIMEOUT_SEC", "0.25")
    assert tr.LinkSettings.of("leader", listen=("127.0.0.1", 1)).hello_timeout == 0.25
    monkeypatch.setenv("DS4_TP_HELLO_TIMEOUT_SEC", "never")
    with pytest.raises(ValueError, match="DS4_TP_HELLO_TIMEOUT_SEC='never' is not a number"):
        tr.LinkSettings.of("leader", listen=("127.0.0.1", 1))
