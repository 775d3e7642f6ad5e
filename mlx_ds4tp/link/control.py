"""Sockets between the two ranks: tuning, reads and writes bounded by a
deadline, listen / dial / accept, and the control channel (framed messages on
one blocking TCP stream, every header checked before a payload byte is read)."""

from __future__ import annotations

import functools
import select
import socket
import struct
import time
from typing import Callable, Optional, Sequence, Tuple

from ..base.log import log
from ..errors import FrameError, PeerClosedError, TransportError, TransportTimeoutError
from .native import load_verbs
from .wire import FRAME_HEADER, FRAME_MAX_BYTES, MAGIC, FrameType, frame_bound

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
# A frame payload up to this many bytes is sent joined to its header, in one write.
JOIN_MAX_BYTES = 64 * 1024
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
    tv = struct.pack("@ll", sec, usec)  # the OS's struct timeval, not a wire layout
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


def recv_some(sock: socket.socket, n: int, deadline: float, who: str, flags: int = 0) -> bytes:
    """Up to n bytes from sock before deadline (monotonic; flags: socket.MSG_PEEK leaves them
    there), for the sockets outside a control channel (a door's first bytes, the lobby's
    messages). TransportTimeoutError when `who` said nothing by then, PeerClosedError when its
    connection failed or closed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransportTimeoutError(f"{who} said nothing in time")
    sock.settimeout(remaining)
    try:
        got = sock.recv(n, flags)
    except socket.timeout:
        raise TransportTimeoutError(f"{who} said nothing in time") from None
    except OSError as exc:
        raise PeerClosedError(f"{who}: connection failed: {exc}") from None
    if not got:
        raise PeerClosedError(f"{who} closed the connection")
    return got


def send_all(sock: socket.socket, data, what: str, deadline: float) -> None:
    """Write all of data before deadline; PeerClosedError or TransportTimeoutError."""
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


# ============================================================================
# Control channel
# ============================================================================


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
    limit = frame_bound(ftype)
    if nbytes > limit:
        raise FrameError(
            f"{ftype.name} frame claims {nbytes} bytes, over its {limit}-byte bound"
        )
    return ftype


@functools.cache
def _yield_lost() -> Callable[[], int]:
    """csrc/util.c's tp_yield_lost: yield the core, and whether another task took it."""
    return load_verbs()[1].tp_yield_lost


class ControlChannel:
    """Framed messages on a TCP stream: 12-byte header (magic, type, bytes).

    alloc(n) makes each received payload's buffer (bytearray by default); a
    test passes its own to see that no buffer is made before the header's byte
    count has passed its bound."""

    def __init__(self, sock: socket.socket, timeout: float,
                 alloc: Callable[[int], bytearray] = bytearray, spin_s: float = 0.0):
        self.sock = sock
        self.timeout = timeout
        self.spin_s = spin_s  # poll_readable's default watch (the pair's DS4_TP_TCP_SPIN_US)
        self._alloc = alloc
        self._header = bytearray(FRAME_HEADER.size)

    def fileno(self) -> int:
        """The control socket's descriptor (the C hot paths watch it for EOF)."""
        return self.sock.fileno()

    def poll_readable(self, seconds: Optional[float] = None) -> bool:
        """Watch the socket for up to `seconds` (default spin_s) without sleeping in the
        kernel (each look yields the core); whether it became readable. A rank that expects
        the peer's next command within a sampling step calls this before recv: woken from a
        blocking read it would pay a scheduler wake-up per token (tens of microseconds, more
        on a busy host), and the other rank waits that long at the token's first gate."""
        if seconds is None:
            seconds = self.spin_s
        if seconds <= 0:
            return False
        sock = [self.sock]
        until = time.monotonic() + seconds
        while True:
            readable, _, _ = select.select(sock, (), (), 0)
            if readable:
                return True
            if time.monotonic() >= until:
                return False
            if _yield_lost()():
                # Another task took the core: a yielding watcher is not woken when the frame
                # comes and waits out that task's slice; a blocking read is.
                return False

    def send(self, ftype: FrameType, payload: bytes = b"") -> None:
        """Send one frame; a payload over the type's bound is a FrameError."""
        ftype = FrameType(ftype)
        limit = frame_bound(ftype)
        if len(payload) > limit:
            raise FrameError(
                f"refusing to send {ftype.name} of {len(payload)} bytes: the limit is {limit}"
            )
        deadline = time.monotonic() + self.timeout
        header = FRAME_HEADER.pack(MAGIC, int(ftype), len(payload))
        if len(payload) <= JOIN_MAX_BYTES:
            send_all(self.sock, header + payload, f"{ftype.name} frame", deadline)
            return
        # A large payload (a part's PART_DATA) goes as it is, after its header: joined, each
        # frame would be copied once more in memory before the kernel copies it.
        send_all(self.sock, header, f"{ftype.name} frame", deadline)
        send_all(self.sock, payload, f"{ftype.name} frame", deadline)

    def recv(
        self, expect: Optional[FrameType] = None, timeout: Optional[float] = None
    ) -> Tuple[FrameType, bytes]:
        """Read one frame; with expect, any other type is an error naming both.
        An ERROR frame from the peer is raised as TransportError with its text."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        ftype, nbytes = self._recv_header(expect, deadline)
        return ftype, bytes(self._recv_payload(ftype, nbytes, expect, deadline))

    def recv_streamed(
        self, streamed: FrameType, piece: memoryview, consume: Callable[[memoryview], None],
        timeout: Optional[float] = None,
    ) -> Tuple[FrameType, memoryview]:
        """recv, except that a frame of type `streamed` has its payload read len(piece) bytes at
        a time into piece, each handed to consume(a view of piece) before the next is read, and
        comes back empty: a part's receiver hashes and writes each piece while it is in the
        core's cache from the socket's copy, and holds one piece, never a frame. Each read waits
        `timeout` at most, the time consume takes (a disk's) not counted against the peer."""
        wait = self.timeout if timeout is None else timeout
        ftype, nbytes = self._recv_header(None, time.monotonic() + wait)
        if ftype != streamed:
            return ftype, self._recv_payload(ftype, nbytes, None, time.monotonic() + wait)
        done = 0
        while done < nbytes:
            view = piece[: min(len(piece), nbytes - done)]
            recv_exact_into(self.sock, view, f"{ftype.name} payload from byte {done} of {nbytes}",
                            time.monotonic() + wait)
            consume(view)
            done += len(view)
        return ftype, memoryview(b"")

    def _recv_header(self, expect: Optional[FrameType], deadline: float) -> Tuple[FrameType, int]:
        want = expect.name if expect is not None else "a control frame"
        recv_exact_into(self.sock, memoryview(self._header), f"{want} header", deadline)
        magic, ftype_raw, nbytes = FRAME_HEADER.unpack(self._header)
        return decode_frame_header(magic, ftype_raw, nbytes), nbytes

    def _recv_payload(self, ftype: FrameType, nbytes: int, expect: Optional[FrameType],
                      deadline: float) -> memoryview:
        payload = memoryview(self._alloc(nbytes))  # only now: the count passed its bound
        if nbytes:
            recv_exact_into(self.sock, payload, f"{ftype.name} payload", deadline)
        if ftype == FrameType.ERROR and expect != FrameType.ERROR:
            raise TransportError("peer reported: " + bytes(payload).decode("utf-8", "replace"))
        if expect is not None and ftype != expect:
            raise FrameError(f"expected a {expect.name} frame, got {ftype.name} ({nbytes} bytes)")
        return payload

    def send_error(self, message: str) -> None:
        """Best effort: tell the peer why we stop, so both sides print the cause."""
        self.send_best_effort(FrameType.ERROR, message.encode("utf-8", "replace")[: FRAME_MAX_BYTES[FrameType.ERROR]])

    def send_best_effort(self, ftype: FrameType, payload: bytes) -> None:
        """One last frame (within its bound) to a peer this side is about to drop: a second at
        most, and a peer already gone is no error."""
        try:
            self.sock.settimeout(1.0)
            self.sock.sendall(FRAME_HEADER.pack(MAGIC, int(ftype), len(payload)) + payload)
        except OSError:
            pass


# ============================================================================
# Listen, dial, accept
# ============================================================================


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port)."""
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


# A worker usually starts a moment before its leader listens, so the first dials are refused:
# that is normal, not an error, and says nothing. Only a wait this long says one calm line
# (then one every DIAL_LOG_EVERY_SEC), so a wrong address is still visible.
DIAL_QUIET_SEC = 3.0
DIAL_LOG_EVERY_SEC = 10.0


def dial(host: str, port: int, deadline: float, what: str,
         abort_on: Sequence[socket.socket] = ()) -> socket.socket:
    """Connect to host:port, retrying until deadline: normal while the leader
    is still starting or loading its model. Quiet for the first DIAL_QUIET_SEC,
    then a line every DIAL_LOG_EVERY_SEC; the timeout error names the cause.

    abort_on: sockets whose EOF or data means the bring-up is over (a mesh worker's JOIN
    connection to the leader: the leader ended or gave up), so the retries stop then, not at
    the deadline."""
    last_error = "no address worked"
    next_log = time.monotonic() + DIAL_QUIET_SEC
    while True:
        if abort_on and select.select(list(abort_on), [], [], 0)[0]:
            raise PeerClosedError(f"the mesh's leader ended or gave up its bring-up while this rank "
                                  f"dialed {host}:{port} for {what}")
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
            log(f"still waiting for the leader at {host}:{port} ({last_error}); retrying until "
                f"the timeout")
            next_log = now + DIAL_LOG_EVERY_SEC
        time.sleep(min(0.1, max(0.0, deadline - now)))


def accept(listener: socket.socket, deadline: float, what: str,
           watch: Optional[ControlChannel] = None) -> Tuple[socket.socket, str]:
    """The next connection on listener, and its peer's "host:port".

    watch: the worker's control channel, once it exists. A worker that dies
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
