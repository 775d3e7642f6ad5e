"""One link of a group, the step form_mesh (link/mesh.py) takes for each pair of ranks: the
lower rank takes the connections at its door, the higher dials; hello, authentication and the
transport choice on the control connection; then the gate data connection; then, when both
agreed on RDMA, the queue pair's bring-up (rdma_bringup.py). The result is a complete Pair,
which owns both connections and, over RDMA, the proven device the exchanges run on. No group
forms here: outside link/ groups form through form_mesh (gate_ops.init)."""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from typing import Callable, Optional, Protocol, Tuple

from ..base.log import log
from ..errors import (
    AuthenticationError,
    FrameError,
    HelloMismatchError,
    PeerClosedError,
    TransportError,
)
from .advice import advise_once, short_reason
from .config import LinkSettings
from .connection import Pair, fingerprint_mismatch
from .control import (
    ControlChannel,
    accept,
    dial,
    listen_socket,
    recv_exact_into,
    send_all,
    set_kernel_timeout,
    tune_socket,
)
from .handshake_done import HandshakeDone
from .hello import Hello, authenticate, check_hello, choose_transport, data_proof, receives_part
from .rdma import RdmaDevice
from .rdma_bringup import bring_up_rdma
from .wire import (
    DATA_HELLO,
    DATA_MAGIC,
    LEADER,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ROLE_NAMES,
    FrameType,
)

Dial = Callable[[str, int, float, str], socket.socket]
BringUp = Callable[[HandshakeDone], Optional[RdmaDevice]]


class Door(Protocol):
    """Where a leader side takes its connections when it does not listen itself: a mesh
    rank's one listener (link/door.py), shared by its links and sorting what comes in."""

    port: int

    def accept(self, deadline: float, what: str,
               watch: Optional[ControlChannel] = None) -> Tuple[socket.socket, str]:
        """The next connection for this link's `what` ("control" or "gate data")."""

NO_PROBE_REASON = "no RDMA provider given"  # connect() without rdma_probe: no device to advise on


def connect(config: LinkSettings, rdma_probe: Optional[Callable[[], Tuple[bool, str]]] = None,
            *, dial: Dial = dial, bring_up: BringUp = bring_up_rdma,
            door: Optional[Door] = None) -> Pair:
    """Bring the pair up, complete: hello, authentication, the transport choice,
    the gate data connection and, when both sides agreed on RDMA, the queue
    pair's bring-up (barriers, warm-up, re-creation). The Pair returned holds
    a proven queue pair (transport "rdma"), or none ("tcp": asked for, or the
    fallback of transport=auto, chosen by both ranks together).

    rdma_probe() -> (ok, reason) says whether this side has RDMA.
    dial(host, port, deadline, what) opens the worker's connections and
    bring_up(joined) -> RdmaDevice or None proves the queue pair: seams for the
    tests, which stop or fault a rank at a chosen point. door: the leader side takes its
    connections there instead of listening at config's address (a mesh's links)."""
    if config.transport == "tcp":
        rdma_ok, reason = False, "transport=tcp requested"
    elif rdma_probe is None:
        rdma_ok, reason = False, NO_PROBE_REASON
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
        fingerprint=b"" if config.identity.fingerprint is None else config.identity.fingerprint.summary(),
        figures=config.figures,
    )
    if config.rank == LEADER:
        joined = _connect_leader(config, mine, deadline, door)
    else:
        joined = _connect_worker(config, mine, deadline, dial)
    rdma = None
    try:
        if joined.transport == "rdma":
            rdma = bring_up(joined)
        return Pair(joined, rdma)
    except BaseException:
        if rdma is not None:
            rdma.close()
        joined.close()
        raise


def _hear(control: ControlChannel, mine: Hello, timeout: float) -> Hello:
    """Either side's hello: its own out, the peer's back."""
    control.send(FrameType.HELLO, mine.pack())
    ftype, payload = control.recv(timeout=timeout)
    if ftype != FrameType.HELLO:
        raise FrameError(f"expected a HELLO frame, got {ftype.name} ({len(payload)} bytes)")
    return Hello.unpack(payload)


def _agree(control: ControlChannel, config: LinkSettings, mine: Hello, theirs: Hello) -> str:
    """Check identities and choose the transport. The callers tell the peer why it failed,
    so both ranks print the same cause."""
    check_hello(mine, theirs)
    if mine.fingerprint != theirs.fingerprint and not (receives_part(mine) or receives_part(theirs)):
        raise fingerprint_mismatch(control, config.rank, config.identity.fingerprint, theirs.fingerprint)
    return choose_transport(mine, theirs)


def _connect_leader(config: LinkSettings, mine: Hello, deadline: float, door: Optional[Door]) -> HandshakeDone:
    host, port = config.address.listen
    listener = listen_socket(host, port) if door is None else None

    def take(what: str, watch: Optional[ControlChannel] = None) -> Tuple[socket.socket, str]:
        if door is not None:
            return door.accept(deadline, what, watch)
        return accept(listener, deadline, what, watch=watch)

    hello_timeout = min(config.hello_timeout, config.timeout)
    try:
        log(f"waiting for worker on {host}:{door.port if door else listener.getsockname()[1]} ...")
        while True:
            sock, peer = take("control")
            tune_socket(sock)
            control = ControlChannel(sock, config.timeout, spin_s=config.tcp_spin_us / 1e6)
            try:
                theirs = _hear(control, mine, hello_timeout)
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
            transport = _agree(control, config, mine, theirs)
            data = _accept_data(take, deadline, control, data_proof(config.secret, mine, theirs),
                                mine.session_id, hello_timeout)
        except TransportError as exc:
            control.send_error(str(exc))
            sock.close()
            raise
    finally:
        if listener is not None:
            listener.close()
    return _joined(f"worker connected from {peer}", HandshakeDone(config, control, data, mine, theirs, transport))


def _accept_data(take: Callable[..., Tuple[socket.socket, str]], deadline: float,
                 control: ControlChannel, proof: bytes, session_id: int,
                 hello_timeout: float) -> socket.socket:
    """The worker's gate data connection: the first that presents this session
    (and, with a secret, the proof). A stranger that races in between the
    hello and the worker's second dial is logged and dropped, like at the
    control door."""
    while True:
        data, peer = take("gate data", control)
        tune_socket(data)
        hello = bytearray(DATA_HELLO.size)
        try:
            recv_exact_into(data, memoryview(hello), "data connection hello",
                            min(deadline, time.monotonic() + hello_timeout))
            magic, version, session, their_proof = DATA_HELLO.unpack(hello)
            if (magic != DATA_MAGIC or version != PROTOCOL_VERSION or session != session_id
                    or not hmac.compare_digest(their_proof, proof)):
                raise FrameError(f"magic 0x{magic:08x}, session {session:#x}: not this session")
        except TransportError as exc:
            log(f"dropped a gate data connection from {peer}: {exc}")
            data.close()
            continue
        return data


def _connect_worker(config: LinkSettings, mine: Hello, deadline: float, dial: Dial) -> HandshakeDone:
    host, port = config.address.coordinator
    sock = dial(host, port, deadline, "control")
    tune_socket(sock)
    control = ControlChannel(sock, config.timeout, spin_s=config.tcp_spin_us / 1e6)
    try:
        theirs = _hear(control, mine, config.timeout)
        authenticate(control, mine, theirs, config.secret)
        transport = _agree(control, config, mine, theirs)
        data = dial(host, port, deadline, "gate data")
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
    return _joined(f"connected to leader {host}:{port}", HandshakeDone(config, control, data, mine, theirs, transport))


def _choice_note(config: LinkSettings, mine: Hello, theirs: Hello, transport: str) -> str:
    """Why auto chose TCP, in the same log line (both ranks say it): each side's cause,
    short; this side's advice, for this platform, follows once per process."""
    if config.transport != "auto" or transport != "tcp":
        return ""
    causes = [(h, short_reason(h.rdma_reason)) for h in (mine, theirs) if not h.rdma_ok]
    if len(causes) == 2 and causes[0][1] == causes[1][1]:
        return f" (auto: RDMA unavailable on both ranks: {causes[0][1]})"
    why = [f"{'this side' if h is mine else 'the ' + ROLE_NAMES[h.role]}: {cause}" for h, cause in causes]
    if not why:
        why = ["the peer asked for tcp"]
    return " (auto: RDMA unavailable on " + "; ".join(why) + ")"


def _joined(who: str, joined: HandshakeDone) -> HandshakeDone:
    """Either side's end of the handshake: the transport choice in one log line, then what this
    side's user can do about its missing RDMA, and the gate data socket's kernel deadline."""
    config, mine, transport = joined.config, joined.mine, joined.transport
    log(f"{who}, transport={transport}{_choice_note(config, mine, joined.theirs, transport)}")
    if (config.transport == "auto" and transport == "tcp" and not mine.rdma_ok
            and mine.rdma_reason != NO_PROBE_REASON):
        advise_once(mine.rdma_reason)
    set_kernel_timeout(joined.data, config.timeout)
    return joined
