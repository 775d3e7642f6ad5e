"""Bringing the pair up: the leader listens, the worker dials; hello,
authentication and the transport choice on the control connection; then the
gate data connection. The result is a Pair, which owns both connections and
the gates that run over them."""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from typing import Callable, Optional, Tuple

from .config import PairConfig
from .control import (
    ControlChannel,
    accept,
    dial,
    listen_socket,
    recv_exact_into,
    send_all,
    set_kernel_timeout,
    swap_small,
    tune_socket,
)
from .fingerprint import Fingerprint, first_difference, summary_label
from .hello import Hello, authenticate, check_hello, choose_transport, data_proof
from ..base.log import log
from .native import load_verbs, sum_partials
from .rdma import RdmaGates
from .sum_gates import SumGate, make_sum_gate
from .tcp import TcpGates
from .wire import (
    DATA_HELLO,
    DATA_MAGIC,
    FINGERPRINT_SUMMARY,
    LEADER,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ROLE_NAMES,
    FrameType,
)
from ..errors import (
    AuthenticationError,
    FrameError,
    HelloMismatchError,
    PeerClosedError,
    TransportError,
)

Dial = Callable[[str, int, float, str], socket.socket]


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
        self.rdma: Optional[RdmaGates] = None  # attached by attach_rdma once proven
        # The sequence number of the last gate or bulk exchange, and whether the pair is
        # closed, in C memory: the float gates (SumGate) bump and check them without Python.
        ffi, _ = load_verbs()
        self.state = ffi.new("tp_pair_state *")
        self.closed = False

    @property
    def seq(self) -> int:
        """The last gate or bulk exchange's sequence number."""
        return int(self.state.seq)

    @seq.setter
    def seq(self, value: int) -> None:
        self.state.seq = value

    @property
    def peer_name(self) -> str:
        """"leader" or "worker": the other rank's role."""
        return ROLE_NAMES[1 - self.rank]

    def open_rdma(self) -> RdmaGates:
        """Open this side's RDMA device for the pair (not yet attached: the
        queue pair must be built, connected and warmed up first)."""
        cfg = self.config
        return RdmaGates(
            device=cfg.rdma_device,
            gid_index=cfg.gid_index,
            rank=self.rank,
            bind_ip=self.control.sock.getsockname()[0],
            control_fd=self.control.fileno(),
            data_fd=self.data.fileno(),
            timeout=self.timeout,
            verbs_library=cfg.verbs_library,
            faults=cfg.ucsim_faults,
            no_imm=cfg.rdma_no_imm,
        )

    def attach_rdma(self, gates: Optional[RdmaGates]) -> None:
        """Gates from then on run over gates; None means the RDMA bring-up
        failed on either side and both fall back to TCP gates together."""
        if self.transport != "rdma":
            raise ValueError(f"attach_rdma on a pair whose transport is {self.transport!r}, not 'rdma'")
        if gates is None:
            self.transport = "tcp"
            return
        self.rdma = gates

    def fingerprint_labels(self) -> Tuple[str, str]:
        """(this side's, the peer's) model fingerprint as the hello carried
        them: 12 hex digits each, or "none"."""
        return summary_label(self.mine.fingerprint), summary_label(self.peer_hello.fingerprint)

    def agree_fingerprint(self, fingerprint: Fingerprint) -> None:
        """Both ranks swap fingerprints on the control channel (for a pair
        whose hello carried none, e.g. before load_split); a difference raises
        HelloMismatchError on both, naming both and the first difference."""
        mine = fingerprint.summary()
        self.control.send(FrameType.FINGERPRINT, mine)
        _, theirs = self.control.recv(FrameType.FINGERPRINT)
        if len(theirs) != FINGERPRINT_SUMMARY.size:
            raise FrameError(f"FINGERPRINT payload is {len(theirs)} bytes, expected {FINGERPRINT_SUMMARY.size}")
        if theirs != mine:
            raise fingerprint_mismatch(self.control, self.rank, fingerprint, theirs)

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

    def sum_gate(self, peer, out, dtype: int, layer: int = 0, gate: int = 0, latency_ns=None,
                 latency_count=None) -> SumGate:
        """A gate that also sums, with every argument but the partial fixed once: the peer's
        partial lands in `peer`, rank 0's partial plus rank 1's in `out` (reused buffers of
        the partial's size, dtype lib.TP_SUM_*), both in C in one call; see _sum_gates.
        latency_ns / latency_count: a ring of round trips to record into."""
        if self.closed:
            raise TransportError("this pair is closed; create a new group with mlx_ds4tp.init(...)")
        return make_sum_gate(self.state, self.tcp, self.rdma, self.rank, peer, out, dtype, layer, gate,
                             latency_ns, latency_count)

    def bulk_sum(self, send, peer, out, dtype: int, layer: int = 0) -> int:
        """bulk, then out = rank 0's partial + rank 1's in C (prefill rows)."""
        seq = self.bulk(send, peer, layer)
        sum_partials(dtype, self.rank, send, peer, out)
        return seq

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
        """Close the gates and both connections (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.state.closed = 1  # before the device is freed: a SumGate refuses from now on
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None
        for sock in (self.data, self.control.sock):
            try:
                sock.close()
            except OSError:
                pass


def connect(config: PairConfig, rdma_probe: Optional[Callable[[], Tuple[bool, str]]] = None,
            *, dial: Dial = dial) -> Pair:
    """Bring the pair up to an agreed transport. rdma_probe() -> (ok, reason)
    says whether this side has RDMA; with transport "rdma" agreed, the caller
    brings the queue pair up (warmup.bring_up_rdma) and attaches it.
    dial(host, port, deadline, what) opens the worker's connections."""
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
        fingerprint=b"" if config.identity.fingerprint is None else config.identity.fingerprint.summary(),
    )
    if config.rank == LEADER:
        return _connect_leader(config, mine, deadline)
    return _connect_worker(config, mine, deadline, dial)


def _exchange_hello(control: ControlChannel, mine: Hello, timeout: float) -> Hello:
    control.send(FrameType.HELLO, mine.pack())
    _, payload = control.recv(FrameType.HELLO, timeout=timeout)
    return Hello.unpack(payload)


def fingerprint_mismatch(control: ControlChannel, rank: int, mine: Optional[Fingerprint],
                         their_summary: bytes) -> HelloMismatchError:
    """The error both ranks raise when their fingerprints differ. When both
    have one, they first swap the details so each can name the first
    difference (both run this on the same two fingerprints)."""
    peer = ROLE_NAMES[1 - rank]
    here, there = summary_label(b"" if mine is None else mine.summary()), summary_label(their_summary)
    if mine is None:
        why = (f"this side joined without a model fingerprint and the {peer} with one; start both "
               "ranks the same way, each with its model directory")
    elif not their_summary:
        why = (f"the {peer} joined without a model fingerprint and this side with one; start both "
               "ranks the same way, each with its model directory")
    else:
        # One side at a time: a big model's details (megabytes) written by both
        # ranks at once could fill both sockets' buffers and wait forever.
        if rank == LEADER:
            control.send(FrameType.FINGERPRINT_DETAIL, mine.details())
            _, payload = control.recv(FrameType.FINGERPRINT_DETAIL)
        else:
            _, payload = control.recv(FrameType.FINGERPRINT_DETAIL)
            control.send(FrameType.FINGERPRINT_DETAIL, mine.details())
        theirs = Fingerprint.from_details(payload)
        if theirs.summary() != their_summary:
            raise FrameError(f"the {peer}'s fingerprint details do not add up to its fingerprint {there}")
        why = first_difference(mine, theirs, peer) or "the fingerprints differ"
    return HelloMismatchError(
        f"model mismatch: fingerprint {here} here and {there} on the {peer}: {why}; "
        "load the same model on both machines"
    )


def _agree(control: ControlChannel, config: PairConfig, mine: Hello, theirs: Hello) -> str:
    """Check identities and choose the transport; on failure tell the peer
    first so both ranks print the same cause."""
    try:
        check_hello(mine, theirs)
        if mine.fingerprint != theirs.fingerprint:
            raise fingerprint_mismatch(control, config.rank, config.identity.fingerprint,
                                       theirs.fingerprint)
        return choose_transport(mine, theirs)
    except TransportError as exc:
        control.send_error(str(exc))
        raise


def _connect_leader(config: PairConfig, mine: Hello, deadline: float) -> Pair:
    host, port = config.listen
    listener = listen_socket(host, port)
    hello_timeout = min(config.hello_timeout, config.timeout)
    try:
        log(f"waiting for worker on {host}:{listener.getsockname()[1]} ...")
        while True:
            sock, peer = accept(listener, deadline, "control")
            tune_socket(sock)
            control = ControlChannel(sock, config.timeout, spin_s=config.tcp_spin_us / 1e6)
            try:
                theirs = _exchange_hello(control, mine, hello_timeout)
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
            data = _accept_data(listener, deadline, control, data_proof(config.secret, mine, theirs),
                                mine.session_id, hello_timeout)
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


def _accept_data(listener: socket.socket, deadline: float, control: ControlChannel,
                 proof: bytes, session_id: int, hello_timeout: float) -> socket.socket:
    """The worker's gate data connection: the first that presents this session
    (and, with a secret, the proof). A stranger that races in between the
    hello and the worker's second dial is logged and dropped, like at the
    control door."""
    while True:
        data, peer = accept(listener, deadline, "gate data", watch=control)
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


def _connect_worker(config: PairConfig, mine: Hello, deadline: float, dial: Dial) -> Pair:
    host, port = config.coordinator
    sock = dial(host, port, deadline, "control")
    tune_socket(sock)
    control = ControlChannel(sock, config.timeout, spin_s=config.tcp_spin_us / 1e6)
    try:
        theirs = _exchange_hello(control, mine, config.timeout)
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
