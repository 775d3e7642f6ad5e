"""Control channel, hello, TCP gates and RDMA gates between the two ranks.

Both ranks are identical machines by definition, so the wire format is host
little-endian; the magic in every header doubles as the byte-order check. The
control channel is one blocking TCP stream of framed messages; gate payloads
ride a second TCP connection (or the RDMA queue pair) so control frames never
interleave with them. This module never sees MLX: gates move bytes between
buffers the caller owns.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os
import secrets
import select
import socket
import struct
import sys
import time
from typing import Callable, Optional, Tuple

from .errors import (
    AuthenticationError,
    DesyncError,
    FrameError,
    HelloMismatchError,
    PeerClosedError,
    RdmaUnavailableError,
    TransportError,
    TransportTimeoutError,
)

# ============================================================================
# Constants and wire formats
# ============================================================================

MAGIC = 0x44533454  # "DS4T"
BATCH_MAGIC = 0x44533442  # "DS4B"
DATA_MAGIC = 0x44533444  # "DS4D": first word on the gate data connection
PROTOCOL_VERSION = 1
DEFAULT_TIMEOUT_SEC = 300.0

# A 16 KiB gate fits any socket buffer, so write-then-read cannot deadlock;
# big prefill gates move in 2 MiB rounds, each round full duplex.
BIG_ROUND_BYTES = 2 * 1024 * 1024
# Largest exchange that rides as a decode gate: two RDMA messages of the
# driver's 16 KiB maximum. Anything larger goes through the bulk path.
RDMA_MAX_MSG = 16384
GATE_MAX_BYTES = 2 * RDMA_MAX_MSG
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
LEADER, WORKER = 0, 1
ROLE_NAMES = {LEADER: "leader", WORKER: "worker"}


class FrameType(enum.IntEnum):
    """Control frame types, numbered as in the C reference's newest upstream."""

    SYNC = 1
    EVAL = 2
    REWIND = 3
    INVALIDATE = 4
    STOP = 5
    HASH = 6
    RDMA_INFO = 7
    RDMA_READY = 9
    LOGITS = 10
    SESSION_CREATE = 13
    SESSION_DESTROY = 14
    COMMAND_ACK = 17
    RDMA_WARM = 19
    RDMA_POSTED = 20
    HELLO = 21
    ERROR = 22
    RDMA_STATUS = 23
    AUTH = 24
    # Serving (mlx_ds4tp.sessions): one decode step over the rows of every active session.
    EVAL_BATCH = 32


# Largest payload each frame type may claim: checked before anything is
# allocated, so a header claiming 4 GiB is an error, never a malloc.
MAX_TOKENS_PER_FRAME = 1 << 20
FRAME_MAX_BYTES = {
    FrameType.SYNC: 16 + 4 * MAX_TOKENS_PER_FRAME,
    FrameType.EVAL: 64,
    FrameType.REWIND: 64,
    FrameType.INVALIDATE: 64,
    FrameType.STOP: 64,
    FrameType.HASH: 64,
    FrameType.RDMA_INFO: 64,
    FrameType.RDMA_READY: 16,
    FrameType.LOGITS: 64 * 1024 * 1024,
    FrameType.SESSION_CREATE: 4096,
    FrameType.SESSION_DESTROY: 64,
    FrameType.COMMAND_ACK: 4096,
    FrameType.RDMA_WARM: 64,
    FrameType.RDMA_POSTED: 64,
    FrameType.HELLO: 1024,
    FrameType.ERROR: 4096,
    FrameType.RDMA_STATUS: 4096,
    FrameType.AUTH: 256,
    FrameType.EVAL_BATCH: 64 * 1024,
}

FRAME_HEADER = struct.Struct("<III")  # magic, type, byte count
GATE_HEADER = struct.Struct("<IHHQ")  # magic, layer, gate, seq
BIG_HEADER = struct.Struct("<IHHQQ")  # magic, layer, tag, seq, bytes
BIG_TAG = 0xB16
DATA_HELLO = struct.Struct("<IIQ32s")  # DATA_MAGIC, version, session id, proof


def log(message: str) -> None:
    """Diagnostics go to stderr with the project prefix; results go to stdout.
    One write per line: print() writes the text and the newline separately,
    so two threads' lines (two ranks in one process) could run together."""
    sys.stderr.write(f"ds4-tp: {message}\n")
    sys.stderr.flush()


def default_timeout() -> float:
    """DS4_TP_TIMEOUT_SEC, default 300 s: connect and command waits."""
    raw = os.environ.get("DS4_TP_TIMEOUT_SEC")
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_SEC
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"DS4_TP_TIMEOUT_SEC={raw!r} is not a number; set it to seconds, e.g. 300"
        ) from None
    if not value > 0:
        raise ValueError(f"DS4_TP_TIMEOUT_SEC={raw!r} must be > 0 seconds")
    return value


# How long a TCP gate polls for the peer's message before it sleeps in the kernel. Waits at a
# gate are mostly the other rank finishing its half of the layer, well under a millisecond; a
# rank that polls through them skips the wake-up. A machine with one core would starve the
# other rank by polling, so there it sleeps at once.
MAX_TCP_SPIN_US = 1_000_000


def default_tcp_spin_us() -> int:
    return 5000 if (os.cpu_count() or 1) >= 2 else 0


def tcp_spin_us() -> int:
    """DS4_TP_TCP_SPIN_US, default 5000 (0 on a one-core machine): microseconds a TCP gate
    polls before it blocks."""
    raw = os.environ.get("DS4_TP_TCP_SPIN_US")
    if raw is None or raw == "":
        return default_tcp_spin_us()
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"DS4_TP_TCP_SPIN_US={raw!r} is not a whole number of microseconds; set it to e.g. "
            f"5000, or 0 to never poll"
        ) from None
    if not 0 <= value <= MAX_TCP_SPIN_US:
        raise ValueError(
            f"DS4_TP_TCP_SPIN_US={raw!r} is out of range; set 0 (never poll) to "
            f"{MAX_TCP_SPIN_US} microseconds"
        )
    return value


# ============================================================================
# Model identity and hello
# ============================================================================


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What both ranks must agree on before any gate: the model's shape."""

    layers: int = 0
    hidden: int = 0
    vocab: int = 0
    quant_bits: int = 0
    gates_per_token: int = 0

    FIELDS = ("layers", "hidden", "vocab", "quant_bits", "gates_per_token")

    def __post_init__(self) -> None:
        for name in self.FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < 2**32:
                raise ValueError(
                    f"model identity {name}={value!r} must be an integer in [0, 2^32)"
                )


HELLO_FIXED = struct.Struct("<IIIIIIQI16s" + "I" * len(ModelIdentity.FIELDS))
# magic, version, role, transport wanted, rdma_ok, reason length, session id,
# "I have a secret", a fresh 16-byte nonce, identity fields; then the UTF-8
# reason this side has no RDMA (may be empty).
NONCE_BYTES = 16
TRANSPORT_CODES = {"auto": 0, "tcp": 1, "rdma": 2}
TRANSPORT_NAMES = {v: k for k, v in TRANSPORT_CODES.items()}
MAX_REASON_BYTES = 512


@dataclasses.dataclass
class Hello:
    role: int
    transport: str
    rdma_ok: bool
    rdma_reason: str
    session_id: int
    identity: ModelIdentity
    auth: bool = False
    nonce: bytes = bytes(NONCE_BYTES)
    version: int = PROTOCOL_VERSION
    magic: int = MAGIC

    def pack(self) -> bytes:
        reason = self.rdma_reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
        ident = [getattr(self.identity, f) for f in ModelIdentity.FIELDS]
        return (
            HELLO_FIXED.pack(
                self.magic,
                self.version,
                self.role,
                TRANSPORT_CODES[self.transport],
                int(self.rdma_ok),
                len(reason),
                self.session_id,
                int(self.auth),
                self.nonce,
                *ident,
            )
            + reason
        )

    @classmethod
    def unpack(cls, payload: bytes) -> "Hello":
        if len(payload) < HELLO_FIXED.size:
            raise FrameError(
                f"hello payload is {len(payload)} bytes, need at least {HELLO_FIXED.size}: "
                "the peer is not a ds4tp rank of this version"
            )
        magic, version, role, tcode, rdma_ok, rlen, session_id, auth, nonce, *ident = (
            HELLO_FIXED.unpack_from(payload)
        )
        if magic != MAGIC:
            raise HelloMismatchError(
                f"hello magic 0x{magic:08x} != 0x{MAGIC:08x}: mixed byte order or not a ds4tp peer"
            )
        if version != PROTOCOL_VERSION:
            raise HelloMismatchError(
                f"protocol version: peer speaks {version}, this side {PROTOCOL_VERSION}; "
                "install the same mlx-ds4tp version on both machines"
            )
        if role not in ROLE_NAMES:
            raise HelloMismatchError(f"hello role {role} is neither 0 (leader) nor 1 (worker)")
        if tcode not in TRANSPORT_NAMES:
            raise HelloMismatchError(f"hello transport code {tcode} unknown (0 auto, 1 tcp, 2 rdma)")
        if len(payload) != HELLO_FIXED.size + rlen:
            raise FrameError(
                f"hello carries {len(payload) - HELLO_FIXED.size} reason bytes, header says {rlen}"
            )
        reason = payload[HELLO_FIXED.size :].decode("utf-8", "replace")
        return cls(
            role=role,
            transport=TRANSPORT_NAMES[tcode],
            rdma_ok=bool(rdma_ok),
            rdma_reason=reason,
            session_id=session_id,
            identity=ModelIdentity(*ident),
            auth=bool(auth),
            nonce=nonce,
            version=version,
            magic=magic,
        )


def check_hello(mine: Hello, theirs: Hello) -> None:
    """Raise HelloMismatchError naming both values for any disagreement."""
    if theirs.role == mine.role:
        name = ROLE_NAMES[mine.role]
        raise HelloMismatchError(
            f"both sides claim role {name}; start one with --role leader and the other "
            "with --role worker"
        )
    peer = ROLE_NAMES[theirs.role]
    for name in ModelIdentity.FIELDS:
        here, there = getattr(mine.identity, name), getattr(theirs.identity, name)
        if here != there:
            raise HelloMismatchError(
                f"model mismatch: {name} is {here} here and {there} on the {peer}; "
                "load the same model on both machines"
            )


def choose_transport(mine: Hello, theirs: Hello) -> str:
    """Both ranks run this on the same two hellos, so both reach the same verdict."""
    wants = {mine.transport, theirs.transport}
    if "tcp" in wants:
        if "rdma" in wants:
            raise RdmaUnavailableError(
                "one side asked for transport=rdma and the other for transport=tcp; "
                "use the same --transport on both machines"
            )
        return "tcp"
    both_ok = mine.rdma_ok and theirs.rdma_ok
    if both_ok:
        return "rdma"
    if "rdma" in wants:
        missing = []
        for hello in (mine, theirs):
            if not hello.rdma_ok:
                missing.append(f"the {ROLE_NAMES[hello.role]} ({hello.rdma_reason or 'no device'})")
        raise RdmaUnavailableError(
            "transport=rdma but RDMA is unavailable on " + " and on ".join(missing)
            + "; fix the device or use --transport auto/tcp"
        )
    return "tcp"


AUTH_TAG = b"ds4tp-auth-v1"
DATA_AUTH_TAG = b"ds4tp-data-v1"


def secret_bytes(secret) -> Optional[bytes]:
    """secret= (str or bytes) or DS4_TP_SECRET; None when neither is set."""
    if secret is None:
        secret = os.environ.get("DS4_TP_SECRET") or None
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)) or len(secret) == 0:
        raise ValueError("secret must be a non-empty str or bytes (or unset DS4_TP_SECRET)")
    return bytes(secret)


def auth_proof(secret: bytes, prover_role: int, verifier_nonce: bytes, prover_nonce: bytes) -> bytes:
    """HMAC-SHA256 over the verifier's fresh nonce: proves the secret without
    sending it, and cannot be replayed into another connection."""
    msg = AUTH_TAG + struct.pack("<I", prover_role) + verifier_nonce + prover_nonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


def authenticate(control: "ControlChannel", mine: Hello, theirs: Hello, secret: Optional[bytes]) -> None:
    """Challenge-response in both directions, before any session state exists."""
    peer = ROLE_NAMES[theirs.role]
    if not mine.auth and not theirs.auth:
        return
    if mine.auth and not theirs.auth:
        raise AuthenticationError(
            f"authentication failed: this side has a secret but the {peer} sent none; give both "
            "machines the same --secret / DS4_TP_SECRET"
        )
    if theirs.auth and not mine.auth:
        raise AuthenticationError(
            f"authentication failed: the {peer} requires a secret and this side has none; give "
            "both machines the same --secret / DS4_TP_SECRET"
        )
    control.send(FrameType.AUTH, auth_proof(secret, mine.role, theirs.nonce, mine.nonce))
    _, proof = control.recv(FrameType.AUTH)
    expected = auth_proof(secret, theirs.role, mine.nonce, theirs.nonce)
    if not hmac.compare_digest(proof, expected):
        raise AuthenticationError(
            f"authentication failed: the {peer}'s proof does not match this side's secret; "
            "the two machines have different --secret / DS4_TP_SECRET values"
        )


def data_proof(secret: Optional[bytes], leader: Hello, worker: Hello) -> bytes:
    """Binds the gate data connection to the authenticated control session."""
    if secret is None:
        return bytes(32)
    return hmac.new(secret, DATA_AUTH_TAG + leader.nonce + worker.nonce, hashlib.sha256).digest()


# ============================================================================
# Socket helpers
# ============================================================================


# TCP keepalive: a worker idle between prompts has nothing else that would
# notice a pulled cable; probes find a silent peer within about 25 s.
KEEPALIVE_IDLE_SEC, KEEPALIVE_INTERVAL_SEC, KEEPALIVE_PROBES = 10, 5, 3


def tune_socket(sock: socket.socket) -> None:
    """NODELAY and large buffers: gates are latency-critical small messages, and
    big prefill gates pipeline better with room in both directions."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle_opt = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))
    for opt, value in ((idle_opt, KEEPALIVE_IDLE_SEC),
                       (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_SEC),
                       (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES)):
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass
    for opt, force in (
        (socket.SO_SNDBUF, getattr(socket, "SO_SNDBUFFORCE", None)),
        (socket.SO_RCVBUF, getattr(socket, "SO_RCVBUFFORCE", None)),
    ):
        try:
            # The FORCE variants pass wmem_max/rmem_max when we are root.
            sock.setsockopt(socket.SOL_SOCKET, force or opt, SOCKET_BUFFER_BYTES)
        except (OSError, TypeError):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            except OSError:
                pass


def set_kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket with SO_RCVTIMEO/SO_SNDTIMEO: the kernel enforces the
    deadline, so the gate path pays no extra poll() per call."""
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    tv = struct.pack("@ll", sec, usec)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact_into(sock: socket.socket, view: memoryview, what: str, deadline: float) -> None:
    """Fill view completely from sock before deadline (socket has a timeout)."""
    got, total = 0, len(view)
    while got < total:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportTimeoutError(f"timed out reading {what} ({got}/{total} bytes)")
        sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:], total - got)
        except socket.timeout:
            raise TransportTimeoutError(
                f"timed out reading {what} ({got}/{total} bytes)"
            ) from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise PeerClosedError(f"peer reset the connection while sending {what}: {exc}") from None
        if n == 0:
            if got:
                raise PeerClosedError(f"peer closed mid-frame: {what} truncated at {got}/{total} bytes")
            raise PeerClosedError(f"peer closed the connection (EOF) while waiting for {what}")
        got += n


def send_all(sock: socket.socket, data, what: str, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransportTimeoutError(f"timed out sending {what}")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise TransportTimeoutError(f"timed out sending {what}") from None
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerClosedError(f"peer closed the connection while we sent {what}: {exc}") from None


def swap_small(sock: socket.socket, mine: bytes, into: bytearray, what: str, timeout: float) -> None:
    """Write a small record, then read the peer's record of the same kind into
    `into` (both sides do the same), on a blocking socket whose kernel
    timeouts (SO_RCVTIMEO/SO_SNDTIMEO) bound the wait."""
    try:
        sock.sendall(mine)
        view = memoryview(into)
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise PeerClosedError(f"peer closed the gate connection during {what}")
            got += n
    except BlockingIOError:
        raise TransportTimeoutError(f"the peer did not reach {what} within {timeout:g} s") from None
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise PeerClosedError(f"peer closed the gate connection during {what}: {exc}") from None


# ============================================================================
# Control channel
# ============================================================================


class ControlChannel:
    """Framed messages on a TCP stream: 12-byte header (magic, type, bytes)."""

    def __init__(self, sock: socket.socket, timeout: float, spin_us: int = 0):
        self.sock = sock
        self.timeout = timeout
        self._header = bytearray(FRAME_HEADER.size)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, ftype: FrameType, payload: bytes = b"") -> None:
        ftype = FrameType(ftype)
        limit = FRAME_MAX_BYTES[ftype]
        if len(payload) > limit:
            raise FrameError(
                f"refusing to send {ftype.name} of {len(payload)} bytes: the limit is {limit}"
            )
        deadline = time.monotonic() + self.timeout
        send_all(
            self.sock,
            FRAME_HEADER.pack(MAGIC, int(ftype), len(payload)) + payload,
            f"{ftype.name} frame",
            deadline,
        )

    def recv(
        self, expect: Optional[FrameType] = None, timeout: Optional[float] = None
    ) -> Tuple[FrameType, bytes]:
        """Read one frame; with expect, any other type is an error naming both.
        An ERROR frame from the peer is raised as TransportError with its text."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        want = expect.name if expect is not None else "a control frame"
        view = memoryview(self._header)
        recv_exact_into(self.sock, view, f"{want} header", deadline)
        magic, ftype_raw, nbytes = FRAME_HEADER.unpack(self._header)
        ftype = decode_frame_header(magic, ftype_raw, nbytes)
        payload = bytearray(nbytes)
        if nbytes:
            recv_exact_into(self.sock, memoryview(payload), f"{ftype.name} payload", deadline)
        if ftype == FrameType.ERROR and expect != FrameType.ERROR:
            raise TransportError("peer reported: " + payload.decode("utf-8", "replace"))
        if expect is not None and ftype != expect:
            raise FrameError(f"expected a {expect.name} frame, got {ftype.name} ({nbytes} bytes)")
        return ftype, bytes(payload)

    def send_error(self, message: str) -> None:
        """Best effort: tell the peer why we stop, so both sides print the cause."""
        try:
            data = message.encode("utf-8", "replace")[: FRAME_MAX_BYTES[FrameType.ERROR]]
            self.sock.settimeout(1.0)
            self.sock.sendall(FRAME_HEADER.pack(MAGIC, int(FrameType.ERROR), len(data)) + data)
        except OSError:
            pass


def decode_frame_header(magic: int, ftype_raw: int, nbytes: int) -> FrameType:
    """Validate a frame header before any allocation; raise FrameError."""
    if magic != MAGIC:
        raise FrameError(
            f"bad frame magic 0x{magic:08x} (expected 0x{MAGIC:08x} 'DS4T'): the peer is not "
            "a ds4tp rank, uses another byte order, or the stream is out of sync"
        )
    try:
        ftype = FrameType(ftype_raw)
    except ValueError:
        raise FrameError(f"unknown frame type {ftype_raw} ({nbytes} bytes)") from None
    limit = FRAME_MAX_BYTES[ftype]
    if nbytes > limit:
        raise FrameError(
            f"{ftype.name} frame claims {nbytes} bytes, over its {limit}-byte bound"
        )
    return ftype


# ============================================================================
# Connection setup
# ============================================================================


def _listen(host: str, port: int) -> socket.socket:
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"listen port {port!r} must be an integer in 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise TransportError(f"cannot resolve listen address {host!r}: {exc}") from None
    last = None
    for family, stype, proto, _, addr in infos:
        sock = socket.socket(family, stype, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(4)
            return sock
        except OSError as exc:
            last = exc
            sock.close()
    raise TransportError(
        f"cannot listen on {host}:{port}: {last}; pick a free port or the address of a local interface"
    )


def _dial(host: str, port: int, deadline: float, what: str) -> socket.socket:
    """Retry until deadline: normal while the leader is still loading its model.
    Still say why every ~10 s so a wrong address is visible."""
    last_error = "no address worked"
    next_log = time.monotonic()
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            return sock
        except OSError as exc:
            last_error = exc.strerror or str(exc)
        now = time.monotonic()
        if now >= deadline:
            raise TransportTimeoutError(
                f"cannot connect {what} to {host}:{port}: {last_error}; is the leader running "
                "and reachable? (DS4_TP_TIMEOUT_SEC sets how long to keep trying)"
            )
        if now >= next_log:
            log(f"connecting to {host}:{port} ... ({last_error})")
            next_log = now + 10.0
        time.sleep(min(0.1, max(0.0, deadline - now)))


def _accept(listener: socket.socket, deadline: float, what: str,
            watch: Optional["ControlChannel"] = None) -> Tuple[socket.socket, str]:
    """watch: the worker's control channel, once it exists. A worker that dies
    (or gives up and sends ERROR) between its hello and its data connection is
    then an error at once, not a wait until the deadline."""
    while watch is not None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([listener, watch.sock], [], [], remaining)
        if listener in ready:
            break
        if ready:
            try:
                ftype, _ = watch.recv()  # EOF, reset and ERROR raise here
            except PeerClosedError as exc:
                raise PeerClosedError(
                    f"the worker closed its control connection after the hello, before opening "
                    f"the {what} connection ({exc})"
                ) from None
            raise FrameError(f"the worker sent {ftype.name} before opening the {what} connection")
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransportTimeoutError(f"timed out waiting for the worker's {what} connection")
    listener.settimeout(remaining)
    try:
        sock, addr = listener.accept()
    except socket.timeout:
        host, port = listener.getsockname()[:2]
        raise TransportTimeoutError(
            f"no worker connected to {host}:{port} for {what} within the timeout; start the "
            "worker with --coordinator pointing here"
        ) from None
    # The address is taken now: a client that already left has none later.
    return sock, f"{addr[0]}:{addr[1]}"


@dataclasses.dataclass
class PairConfig:
    """How this rank joins the pair."""

    role: str
    listen: Optional[Tuple[str, int]] = None
    coordinator: Optional[Tuple[str, int]] = None
    transport: str = "auto"
    rdma_device: Optional[str] = None
    gid_index: Optional[int] = None
    timeout: Optional[float] = None
    identity: ModelIdentity = dataclasses.field(default_factory=ModelIdentity)
    secret: Optional[bytes] = None
    tcp_spin_us: Optional[int] = None  # None: DS4_TP_TCP_SPIN_US or the default

    def __post_init__(self) -> None:
        self.secret = secret_bytes(self.secret)
        if self.role not in ("leader", "worker"):
            raise ValueError(f"role={self.role!r}: use 'leader' (rank 0) or 'worker' (rank 1)")
        if self.transport not in TRANSPORT_CODES:
            raise ValueError(f"transport={self.transport!r}: use 'auto', 'tcp' or 'rdma'")
        if self.role == "leader":
            if self.listen is None or self.coordinator is not None:
                raise ValueError("the leader needs listen=(host, port) and no coordinator")
            _check_address(self.listen, "listen")
        else:
            if self.coordinator is None or self.listen is not None:
                raise ValueError("the worker needs coordinator=(host, port) and no listen")
            _check_address(self.coordinator, "coordinator")
        if self.timeout is None:
            self.timeout = default_timeout()
        elif not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r} must be > 0 seconds")
        if self.gid_index is not None and (not isinstance(self.gid_index, int) or self.gid_index < 0):
            raise ValueError(f"gid_index={self.gid_index!r} must be a non-negative integer or None")
        if self.tcp_spin_us is None:
            self.tcp_spin_us = tcp_spin_us()
        elif (not isinstance(self.tcp_spin_us, int) or isinstance(self.tcp_spin_us, bool)
              or not 0 <= self.tcp_spin_us <= MAX_TCP_SPIN_US):
            raise ValueError(
                f"tcp_spin_us={self.tcp_spin_us!r}: give 0 (never poll) to {MAX_TCP_SPIN_US} "
                f"microseconds, or None for DS4_TP_TCP_SPIN_US / the default"
            )

    @property
    def rank(self) -> int:
        return LEADER if self.role == "leader" else WORKER


def _check_address(addr, name: str) -> None:
    ok = (
        isinstance(addr, (tuple, list))
        and len(addr) == 2
        and isinstance(addr[0], str)
        and isinstance(addr[1], int)
        and 0 <= addr[1] < 65536
    )
    if not ok:
        raise ValueError(f"{name}={addr!r}: give (host, port), e.g. ('10.99.0.1', 9911)")


# Hello on a fresh connection has its own short deadline: a port scanner or a
# stray client must not hold the leader for the full DS4_TP_TIMEOUT_SEC.
HELLO_TIMEOUT_SEC = 10.0


class Pair:
    """An established connection between the two ranks: control channel, gate
    data connection and the chosen gate transport."""

    def __init__(
        self,
        config: PairConfig,
        control: ControlChannel,
        data: socket.socket,
        mine: Hello,
        theirs: Hello,
        transport: str,
    ):
        self.config = config
        self.rank = config.rank
        self.control = control
        self.data = data
        self.mine = mine
        self.peer_hello = theirs
        self.transport = transport
        self.timeout = float(config.timeout)
        self.tcp = TcpGates(data, self.timeout, spin_us=config.tcp_spin_us)
        self.rdma = None  # RdmaGates when transport == "rdma"
        self.seq = 0  # the last gate or bulk exchange's sequence number
        self.closed = False

    @property
    def peer_name(self) -> str:
        return ROLE_NAMES[1 - self.rank]

    def gate(self, send, recv, layer: int = 0, gate: int = 0) -> int:
        """Exchange one gate: send our bytes, receive the peer's (same size).
        Gates and bulk exchanges share one sequence, numbered here: the RDMA
        receive window is posted by it, and the TCP header carries it."""
        self.seq += 1
        if self.rdma is not None:
            self.rdma.gate(send, recv, self.seq)
        else:
            self.tcp.gate(send, recv, self.seq, layer, gate)
        return self.seq

    def exchange_small(self, mine: bytes, what: str) -> bytes:
        """Write-then-read a small fixed-size record on the data connection
        (both sides send the same size): signatures, barriers."""
        theirs = bytearray(len(mine))
        swap_small(self.data, mine, theirs, f"the {what} exchange", self.timeout)
        return bytes(theirs)

    def bulk(self, send, recv, layer: int = 0) -> int:
        """Exchange a big buffer (prefill rows, gathered logits)."""
        self.seq += 1
        if self.rdma is not None:
            self.tcp.big_header(len(memoryview(send).cast("B")), self.seq, layer)
            self.rdma.bulk(send, recv)
        else:
            self.tcp.big(send, recv, self.seq, layer)
        return self.seq

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None
        for sock in (self.data, self.control.sock):
            try:
                sock.close()
            except OSError:
                pass


def connect(config: PairConfig, rdma_probe: Optional[Callable[[], Tuple[bool, str]]] = None) -> Pair:
    """Bring the pair up to an agreed transport (RDMA brought up to READY by
    the caller through rdma_bringup). rdma_probe() -> (ok, reason)."""
    if config.transport == "tcp":
        rdma_ok, reason = False, "transport=tcp requested"
    elif rdma_probe is None:
        rdma_ok, reason = False, "no RDMA provider given"
    else:
        rdma_ok, reason = rdma_probe()
    deadline = time.monotonic() + config.timeout
    session_id = secrets.randbits(64) if config.rank == LEADER else 0
    mine = Hello(
        role=config.rank,
        transport=config.transport,
        rdma_ok=rdma_ok,
        rdma_reason=reason if not rdma_ok else "",
        session_id=session_id,
        identity=config.identity,
        auth=config.secret is not None,
        nonce=secrets.token_bytes(NONCE_BYTES),
    )
    if config.rank == LEADER:
        return _connect_leader(config, mine, deadline)
    return _connect_worker(config, mine, deadline)


def _exchange_hello(control: ControlChannel, mine: Hello, timeout: float) -> Hello:
    control.send(FrameType.HELLO, mine.pack())
    _, payload = control.recv(FrameType.HELLO, timeout=timeout)
    return Hello.unpack(payload)


def _agree(control: ControlChannel, mine: Hello, theirs: Hello) -> str:
    """Check identities and choose the transport; on failure tell the peer
    first so both ranks print the same cause."""
    try:
        check_hello(mine, theirs)
        return choose_transport(mine, theirs)
    except TransportError as exc:
        control.send_error(str(exc))
        raise


def _connect_leader(config: PairConfig, mine: Hello, deadline: float) -> Pair:
    host, port = config.listen
    listener = _listen(host, port)
    try:
        log(f"waiting for worker on {host}:{listener.getsockname()[1]} ...")
        while True:
            sock, peer = _accept(listener, deadline, "control")
            tune_socket(sock)
            control = ControlChannel(sock, config.timeout)
            try:
                theirs = _exchange_hello(control, mine, min(HELLO_TIMEOUT_SEC, config.timeout))
                authenticate(control, mine, theirs, config.secret)
            except AuthenticationError as exc:
                # A client without our secret: refused before any session
                # state exists; keep waiting for the real worker.
                control.send_error(str(exc))
                log(f"refused a connection from {peer}: {exc}")
                sock.close()
                continue
            except HelloMismatchError as exc:
                control.send_error(str(exc))
                sock.close()
                raise
            except TransportError as exc:
                # Not a ds4tp worker (scanner, curl, garbage): drop it, keep waiting.
                log(f"dropped a connection from {peer} that sent no valid hello: {exc}")
                sock.close()
                continue
            break
        try:
            transport = _agree(control, mine, theirs)
            data = _accept_data(listener, deadline, control, data_proof(config.secret, mine, theirs),
                                mine.session_id)
        except TransportError as exc:
            control.send_error(str(exc))
            sock.close()
            raise
    finally:
        listener.close()
    log(f"worker connected from {peer}, transport={transport}"
        f"{_choice_note(config, mine, theirs, transport)}")
    set_kernel_timeout(data, config.timeout)
    return Pair(config, control, data, mine, theirs, transport)


def _accept_data(listener: socket.socket, deadline: float, control: "ControlChannel",
                 proof: bytes, session_id: int) -> socket.socket:
    """The worker's gate data connection: the first that presents this session
    (and, with a secret, the proof). A stranger that races in between the
    hello and the worker's second dial is logged and dropped, like at the
    control door."""
    while True:
        data, peer = _accept(listener, deadline, "gate data", watch=control)
        tune_socket(data)
        hello = bytearray(DATA_HELLO.size)
        try:
            recv_exact_into(data, memoryview(hello), "data connection hello",
                            min(deadline, time.monotonic() + HELLO_TIMEOUT_SEC))
            magic, version, session, their_proof = DATA_HELLO.unpack(hello)
            if (magic != DATA_MAGIC or version != PROTOCOL_VERSION or session != session_id
                    or not hmac.compare_digest(their_proof, proof)):
                raise FrameError(f"magic 0x{magic:08x}, session {session:#x}: not this session")
        except TransportError as exc:
            log(f"dropped a gate data connection from {peer}: {exc}")
            data.close()
            continue
        return data


def _connect_worker(config: PairConfig, mine: Hello, deadline: float) -> Pair:
    host, port = config.coordinator
    sock = _dial(host, port, deadline, "control")
    tune_socket(sock)
    control = ControlChannel(sock, config.timeout)
    try:
        theirs = _exchange_hello(control, mine, config.timeout)
        authenticate(control, mine, theirs, config.secret)
        transport = _agree(control, mine, theirs)
        data = _dial(host, port, deadline, "gate data")
        tune_socket(data)
        send_all(
            data,
            DATA_HELLO.pack(DATA_MAGIC, PROTOCOL_VERSION, theirs.session_id,
                            data_proof(config.secret, theirs, mine)),
            "data connection hello",
            deadline,
        )
    except TransportError as exc:
        if not isinstance(exc, PeerClosedError):
            control.send_error(str(exc))
        sock.close()
        raise
    log(f"connected to leader {host}:{port}, transport={transport}"
        f"{_choice_note(config, mine, theirs, transport)}")
    set_kernel_timeout(data, config.timeout)
    return Pair(config, control, data, mine, theirs, transport)


def _choice_note(config: PairConfig, mine: Hello, theirs: Hello, transport: str) -> str:
    """Why auto chose TCP, in the same log line (both ranks say it)."""
    if config.transport != "auto" or transport != "tcp":
        return ""
    why = [f"{'this side' if h is mine else 'the ' + ROLE_NAMES[h.role]}: {h.rdma_reason or 'no device'}"
           for h in (mine, theirs) if not h.rdma_ok]
    if not why:
        why = ["the peer asked for tcp"]
    return " (auto: RDMA unavailable on " + "; ".join(why) + ")"


# ============================================================================
# TCP gates
# ============================================================================


class TcpGates:
    """Gates over the dedicated data socket. Both sides write, then read; the
    header (magic, layer, gate, seq) travels with the payload in one sendmsg so
    TCP_NODELAY never splits them, and a mismatch is a loud desync error."""

    def __init__(self, sock: socket.socket, timeout: float, spin_us: int = 0):
        self.sock = sock
        self.timeout = timeout
        self.ffi, self.lib = _load_verbs()
        self._fd = sock.fileno()
        self._out_header = bytearray(GATE_HEADER.size)
        self._in_header = bytearray(GATE_HEADER.size)
        self._out_header_c = self.ffi.from_buffer(self._out_header)
        self._in_header_c = self.ffi.from_buffer(self._in_header)
        self._err = self.ffi.new("char[512]")
        self._big_in = bytearray(BIG_HEADER.size)
        # Polling comes before the kernel's SO_RCVTIMEO wait, so it is capped at a quarter of
        # the timeout: a silent peer is still reported within 1.25x the timeout.
        self.spin_ns = min(spin_us * 1000, int(timeout * 1e9) // 4)

    # -- decode gates --------------------------------------------------------
    def gate(self, send, recv, seq: int, layer: int = 0, gate: int = 0) -> None:
        """The round trip runs in C with the GIL released (_tcp_gate.c)."""
        ffi = self.ffi
        src = ffi.from_buffer(send)
        dst = ffi.from_buffer(recv, require_writable=True)
        if len(src) != len(dst):
            raise ValueError(f"gate send is {len(src)} bytes but recv is {len(dst)}: they must match")
        GATE_HEADER.pack_into(self._out_header, 0, MAGIC, layer & 0xFFFF, gate & 0xFFFF, seq)
        rc = self.lib.tp_tcp_gate(self._fd, self._out_header_c, self._in_header_c, GATE_HEADER.size,
                                  src, dst, len(src), seq, self.spin_ns, self._err, 512)
        if rc != 0:
            self._raise(rc, seq, layer, gate)

    def _raise(self, rc: int, seq: int, layer: int, gate: int) -> None:
        text = self.ffi.string(self._err).decode("utf-8", "replace")
        lib = self.lib
        if rc == lib.TP_EDESYNC:
            magic, player, pgate, pseq = GATE_HEADER.unpack(self._in_header)
            raise DesyncError(
                f"gate desync: the peer sent layer {player} gate {pgate} seq {pseq} "
                f"(magic 0x{magic:08x}), this side is at layer {layer} gate {gate} seq {seq}"
            )
        if rc == lib.TP_ETIMEOUT:
            raise TransportTimeoutError(
                f"{text} (layer {layer} gate {gate}, timeout {self.timeout:g} s, DS4_TP_TIMEOUT_SEC)"
            )
        if rc == lib.TP_EPEER:
            raise PeerClosedError(text)
        raise TransportError(text)

    # -- big gates -----------------------------------------------------------
    def big_header(self, nbytes: int, seq: int, layer: int = 0) -> None:
        """Both sides agree on (layer, seq, bytes) before a big exchange."""
        header = BIG_HEADER.pack(BATCH_MAGIC, layer & 0xFFFF, BIG_TAG, seq, nbytes)
        swap_small(self.sock, header, self._big_in, f"big gate seq {seq}", self.timeout)
        magic, player, tag, pseq, pbytes = BIG_HEADER.unpack(self._big_in)
        if (magic, player, tag, pseq, pbytes) != (BATCH_MAGIC, layer & 0xFFFF, BIG_TAG, seq, nbytes):
            raise DesyncError(
                f"big gate desync: the peer is at layer {player} seq {pseq} with {pbytes} bytes "
                f"(magic 0x{magic:08x}, tag 0x{tag:x}), this side at layer {layer} seq {seq} with "
                f"{nbytes} bytes"
            )

    def big(self, send, recv, seq: int, layer: int = 0) -> None:
        """Prefill-sized exchange in 2 MiB rounds, each round full duplex, so
        neither side can fill its send buffer while the peer also only writes,
        whatever the socket buffer sizes are."""
        out = memoryview(send).cast("B")
        inp = memoryview(recv).cast("B")
        if len(out) != len(inp):
            raise ValueError(f"big gate send is {len(out)} bytes but recv is {len(inp)}: they must match")
        self.big_header(len(out), seq, layer)
        for start in range(0, len(out), BIG_ROUND_BYTES):
            end = min(start + BIG_ROUND_BYTES, len(out))
            self._duplex(out[start:end], inp[start:end], seq)

    def _duplex(self, out: memoryview, inp: memoryview, seq: int) -> None:
        sock = self.sock
        fd = sock.fileno()
        poller = select.poll()
        sent = got = 0
        deadline = time.monotonic() + self.timeout
        flags = socket.MSG_DONTWAIT
        while sent < len(out) or got < len(inp):
            progressed = False
            try:
                if sent < len(out):
                    n = sock.send(out[sent:], flags)
                    sent += n
                    progressed = progressed or n > 0
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise PeerClosedError(f"peer closed the gate connection during big gate seq {seq}: {exc}") from None
            try:
                if got < len(inp):
                    n = sock.recv_into(inp[got:], 0, flags)
                    if n == 0:
                        raise PeerClosedError(
                            f"peer closed the gate connection during big gate seq {seq} "
                            f"({got}/{len(inp)} bytes of this round received)"
                        )
                    got += n
                    progressed = True
            except BlockingIOError:
                pass
            except ConnectionResetError as exc:
                raise PeerClosedError(f"peer reset the gate connection during big gate seq {seq}: {exc}") from None
            if progressed:
                deadline = time.monotonic() + self.timeout
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeoutError(
                    f"big gate seq {seq}: no progress for {self.timeout:g} s "
                    f"(sent {sent}/{len(out)}, received {got}/{len(inp)} bytes of this round)"
                )
            events = select.POLLIN if got < len(inp) else 0
            if sent < len(out):
                events |= select.POLLOUT
            poller.register(fd, events)
            poller.poll(min(remaining, 1.0) * 1000)
            poller.unregister(fd)


def raw_exchange(gates: "TcpGates", send, recv) -> None:
    """The floor: a bare write-then-read of the same bytes (no header, no
    checks), in C like the gate and waiting the same way (poll, then block), so
    the comparison is like for like."""
    ffi = gates.ffi
    src = ffi.from_buffer(send)
    dst = ffi.from_buffer(recv, require_writable=True)
    rc = gates.lib.tp_tcp_raw(gates._fd, src, dst, len(src), gates.spin_ns, gates._err, 512)
    if rc != 0:
        gates._raise(rc, 0, 0, 0)


# ============================================================================
# RDMA gates (the _verbs C module: ibverbs or the emulated UC device)
# ============================================================================

# tp_info on the wire: qpn, psn, mtu, lid, link_layer, gid.
RDMA_INFO = struct.Struct("<IIIHB16s")
UCSIM = "ucsim"
# Work request ids of the warm-up's single message each way.
WARM_WR_ID = 0x5741524D  # "WARM"
# QP/CQ depths a build asks for; the Apple driver may grant less.
CQ_DEPTH, SEND_WR, RECV_WR = 512, 1024, 1024


def _load_verbs():
    """Import the compiled module, or explain how to get it."""
    try:
        from . import _verbs  # type: ignore[attr-defined]
    except ImportError as exc:
        raise RdmaUnavailableError(
            f"the C module mlx_ds4tp._verbs is not built ({exc}); reinstall with "
            "`pip install -e .` (needs a C compiler and cffi)"
        ) from None
    return _verbs.ffi, _verbs.lib


def rdma_probe(device: Optional[str]) -> Tuple[bool, str]:
    """(usable, reason): does this side have the RDMA device it would use?"""
    try:
        ffi, lib = _load_verbs()
    except RdmaUnavailableError as exc:
        return False, str(exc)
    err = ffi.new("char[512]")
    ok = lib.tp_probe(device.encode() if device else ffi.NULL, err, 512)
    return bool(ok), ffi.string(err).decode("utf-8", "replace")


class RdmaError(TransportError):
    """An RDMA call failed; carries the C module's return code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class RdmaGates:
    """One registered slab, one UC queue pair, the decode window and bulk
    rounds (the hot loops run in C with the GIL released)."""

    def __init__(self, pair: Pair):
        self.ffi, self.lib = _load_verbs()
        self.pair = pair
        self.timeout = pair.timeout
        self._errlen = 512
        self._err = self.ffi.new("char[]", self._errlen)
        self.device = pair.config.rdma_device or ""
        bind_ip = pair.control.sock.getsockname()[0]
        if self.device == UCSIM and ":" in bind_ip:
            raise RdmaUnavailableError(
                f"ucsim needs an IPv4 control address, this side uses {bind_ip}; "
                "connect the pair over IPv4 (e.g. 127.0.0.1)"
            )
        # The slab is registered once: the Apple stack allows about 100
        # memory regions in all. The hot paths own its head; the tail holds
        # the warm-up's one send and one receive buffer.
        self.hot_bytes = int(self.lib.tp_slab_bytes())
        self.slab_bytes = self.hot_bytes + 2 * RDMA_MAX_MSG
        import mmap

        # Anonymous mmap: page aligned, zeroed, never moved by Python.
        self._slab_map = mmap.mmap(-1, self.slab_bytes)
        self.slab = self.ffi.from_buffer(self._slab_map)
        faults = os.environ.get("DS4_TP_UCSIM_FAULTS", "")
        gid = -1 if pair.config.gid_index is None else int(pair.config.gid_index)
        self.dev = self.lib.tp_open(
            self.device.encode() if self.device else self.ffi.NULL,
            gid,
            bind_ip.encode(),
            pair.rank,
            faults.encode(),
            self.slab,
            self.slab_bytes,
            self._err,
            self._errlen,
        )
        if self.dev == self.ffi.NULL:
            raise RdmaUnavailableError(self._error_text())
        self.lib.tp_set_fds(self.dev, pair.control.fileno(), pair.data.fileno())
        self.warm_send = self.slab + self.hot_bytes
        self.warm_recv = self.slab + self.hot_bytes + RDMA_MAX_MSG
        self.setup_attempt = 0
        self._registered: list = []  # (handle, buffer) kept alive while registered
        self.warmup_ms: Optional[float] = None  # set by warmup.py once both directions are proven

    # -- setup -----------------------------------------------------------------
    def _error_text(self) -> str:
        return self.ffi.string(self._err).decode("utf-8", "replace")

    def _check(self, rc: int) -> int:
        if rc < 0:
            text = self._error_text()
            if rc == self.lib.TP_ETIMEOUT:
                raise TransportTimeoutError(text)
            if rc == self.lib.TP_EPEER:
                raise PeerClosedError(text)
            if rc == self.lib.TP_ELOST:
                # UC dropped a message and the in-order window shifted: the
                # ranks' gate streams are out of step; the text names the seq.
                raise DesyncError(text)
            raise RdmaError(text, rc)
        return rc

    def build(self, setup_attempt: int) -> Tuple[int, int, int]:
        """(Re)build CQ and QP; returns the granted (cq, send, recv) depths.
        If the device refuses the full depths, halve them until it accepts."""
        self.setup_attempt = setup_attempt
        cq, send, recv = CQ_DEPTH, SEND_WR, RECV_WR
        while True:
            rc = self.lib.tp_build_qp(
                self.dev, self.lib.TP_QPT_UC, setup_attempt, cq, send, recv, self._err, self._errlen
            )
            if rc == self.lib.TP_ENOMEM and recv > 64:
                log(f"queue pair depths cq {cq} send {send} recv {recv} refused; trying half")
                cq, send, recv = max(64, cq // 2), send // 2, recv // 2
                continue
            self._check(rc)
            break
        out = self.ffi.new("int[3]")
        self.lib.tp_depths(self.dev, out, out + 1, out + 2)
        granted = (out[0], out[1], out[2])
        if granted != (CQ_DEPTH, SEND_WR, RECV_WR):
            log(f"queue pair granted cq {granted[0]} send {granted[1]} recv {granted[2]} "
                f"(asked {CQ_DEPTH}/{SEND_WR}/{RECV_WR})")
        self.depths = granted
        return granted

    def local_info(self) -> bytes:
        info = self.ffi.new("tp_info *")
        self._check(self.lib.tp_local_info(self.dev, info))
        return RDMA_INFO.pack(
            info.qpn, info.psn, info.mtu, info.lid, info.link_layer, bytes(self.ffi.buffer(info.gid, 16))
        )

    def connect_peer(self, payload: bytes) -> None:
        if len(payload) != RDMA_INFO.size:
            raise FrameError(f"RDMA_INFO payload is {len(payload)} bytes, expected {RDMA_INFO.size}")
        qpn, psn, mtu, lid, link_layer, gid = RDMA_INFO.unpack(payload)
        info = self.ffi.new("tp_info *")
        info.qpn, info.psn, info.mtu, info.lid, info.link_layer = qpn, psn, mtu, lid, link_layer
        self.ffi.memmove(info.gid, gid, 16)
        self._check(self.lib.tp_connect(self.dev, info, self._err, self._errlen))

    def stats(self):
        out = self.ffi.new("tp_stats *")
        self.lib.tp_get_stats(self.dev, out)
        return out

    # -- raw work requests (warm-up) -------------------------------------------
    def post_recv(self, addr, nbytes: int, wr_id: int) -> None:
        self._check(self.lib.tp_post_recv(self.dev, addr, nbytes, wr_id, self._err, self._errlen))

    def post_send(self, addr, nbytes: int, wr_id: int) -> None:
        self._check(
            self.lib.tp_post_send(
                self.dev, addr, nbytes, wr_id, self.lib.TP_OP_SEND, 1, self._err, self._errlen
            )
        )

    def poll(self, max_wc: int, timeout: float):
        wc = self.ffi.new("tp_wc[]", max_wc)
        n = self._check(self.lib.tp_poll(self.dev, wc, max_wc, timeout, self._err, self._errlen))
        return [wc[i] for i in range(n)]

    def register(self, buffer) -> int:
        """Register a caller's buffer so gates sent from it skip the slab copy.
        Measured by `ds4tp bench` (rdma-*-registered) against the copy; the
        copy of 16 KiB into the slab is as fast and needs no registration per
        new MLX buffer, so the gate path keeps the copy (see README)."""
        ptr = self.ffi.from_buffer(buffer)
        handle = self._check(self.lib.tp_reg(self.dev, ptr, len(ptr), self._err, self._errlen))
        self._registered.append((handle, ptr))
        return handle

    # -- hot paths -------------------------------------------------------------
    def gate(self, send, recv, seq: int) -> None:
        src = self.ffi.from_buffer(send)
        dst = self.ffi.from_buffer(recv, require_writable=True)
        rc = self.lib.tp_gate(self.dev, src, dst, len(src), seq, self.timeout, self._err, self._errlen)
        if rc < 0:
            self._check(rc)

    def bulk(self, send, recv) -> None:
        src = self.ffi.from_buffer(send)
        dst = self.ffi.from_buffer(recv, require_writable=True)
        if len(src) != len(dst):
            raise ValueError(f"bulk send is {len(src)} bytes but recv is {len(dst)}: they must match")
        self._check(self.lib.tp_bulk(self.dev, src, dst, len(src), self.timeout, self._err, self._errlen))

    def close(self) -> None:
        if self.dev is not None and self.dev != self.ffi.NULL:
            self.lib.tp_close(self.dev)
        self.dev = None
        self.slab = None
        try:
            self._slab_map.close()
        except (BufferError, ValueError):
            pass
