"""The hello both ranks exchange first, the checks on it, the transport
choice, and the shared-secret proofs (challenge-response on the control
connection, then a proof that binds the gate data connection to it)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Optional

from ..errors import AuthenticationError, FrameError, HelloMismatchError, RdmaUnavailableError
from .control import ControlChannel
from .fingerprint import Fingerprint
from .wire import (
    AUTH_ROLE,
    AUTH_TAG,
    DATA_AUTH_TAG,
    FINGERPRINT_SUMMARY,
    HELLO_FIXED,
    MAGIC,
    MAX_REASON_BYTES,
    MODEL_IDENTITY_FIELDS,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ROLE_NAMES,
    TRANSPORT_CODES,
    TRANSPORT_NAMES,
    FrameType,
    split_payload,
)


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What both ranks must agree on before any gate: the model's shape and,
    when given (model_fingerprint(path)), its fingerprint; the hello carries
    the fingerprint's summary and a difference stops both ranks."""

    layers: int = 0
    hidden: int = 0
    vocab: int = 0
    quant_bits: int = 0
    gates_per_token: int = 0
    fingerprint: Optional[Fingerprint] = None

    FIELDS = MODEL_IDENTITY_FIELDS

    def __post_init__(self) -> None:
        for name in self.FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < 2**32:
                raise ValueError(
                    f"model identity {name}={value!r} must be an integer in [0, 2^32)"
                )
        if self.fingerprint is not None and not isinstance(self.fingerprint, Fingerprint):
            raise ValueError(
                f"model identity fingerprint={self.fingerprint!r}: give model_fingerprint(path) or None"
            )


# A worker started without --model: it knows nothing of the model before it joins, and receives
# its part from the leader once the share is agreed (split/part_receive.py), checked against the
# fingerprint the leader's hello states. Marked by a gates-per-token no model has, so a rank
# that simply gave no identity (ModelIdentity()) is still held to its peer's.
PART_RECEIVER_MARK = 2**32 - 1
PART_RECEIVER = ModelIdentity(gates_per_token=PART_RECEIVER_MARK)


def receives_part(hello: "Hello") -> bool:
    """Whether this hello is a worker's that holds no model and receives its part."""
    return hello.identity == PART_RECEIVER and not hello.fingerprint


@dataclasses.dataclass(frozen=True)
class RankFigures:
    """What a rank measured at start, for the leader's `--split auto`: the bytes of memory it
    may use and its speed on the work that bounds decode (bytes a second of a matrix-vector
    product over a buffer larger than the caches); 0 is "not measured"."""

    memory_bytes: int = 0
    speed: int = 0

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "speed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
                raise ValueError(f"rank figures {name}={value!r} must be a whole number in [0, 2^64)")

    @property
    def measured(self) -> bool:
        return self.memory_bytes > 0 and self.speed > 0


@dataclasses.dataclass
class Hello:
    """One rank's hello: who it is, what it wants, what it has."""

    role: int
    transport: str
    rdma_ok: bool
    rdma_reason: str
    session_id: int
    identity: ModelIdentity
    auth: bool = False
    nonce: bytes = bytes(NONCE_BYTES)
    fingerprint: bytes = b""  # FINGERPRINT_SUMMARY, or empty for a rank without one
    figures: RankFigures = RankFigures()
    version: int = PROTOCOL_VERSION
    magic: int = MAGIC

    def pack(self) -> bytes:
        """The HELLO frame's payload."""
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
                len(self.fingerprint),
                self.session_id,
                int(self.auth),
                self.nonce,
                *ident,
                self.figures.memory_bytes,
                self.figures.speed,
            )
            + reason
            + self.fingerprint
        )

    @classmethod
    def unpack(cls, payload: bytes) -> "Hello":
        """Parse and check a HELLO payload; FrameError or HelloMismatchError."""
        if len(payload) < HELLO_FIXED.size:
            raise FrameError(
                f"hello payload is {len(payload)} bytes, need at least {HELLO_FIXED.size}: "
                "the peer is not a ds4tp rank of this version"
            )
        magic, version, role, tcode, rdma_ok, rlen, flen, session_id, auth, nonce, *rest = (
            HELLO_FIXED.unpack_from(payload)
        )
        *ident, memory_bytes, speed = rest
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
        if flen not in (0, FINGERPRINT_SUMMARY.size):
            raise FrameError(
                f"hello carries a fingerprint of {flen} bytes; a fingerprint is "
                f"{FINGERPRINT_SUMMARY.size} bytes or none"
            )
        if len(payload) != HELLO_FIXED.size + rlen + flen:
            raise FrameError(
                f"hello carries {len(payload) - HELLO_FIXED.size} bytes after its fixed part, header "
                f"says {rlen} reason + {flen} fingerprint"
            )
        reason_end = HELLO_FIXED.size + rlen
        reason = payload[HELLO_FIXED.size : reason_end].decode("utf-8", "replace")
        return cls(
            role=role,
            transport=TRANSPORT_NAMES[tcode],
            rdma_ok=bool(rdma_ok),
            rdma_reason=reason,
            session_id=session_id,
            identity=ModelIdentity(*ident),
            auth=bool(auth),
            nonce=nonce,
            fingerprint=bytes(payload[reason_end:]),
            figures=RankFigures(memory_bytes, speed),
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
    if receives_part(mine) or receives_part(theirs):
        return  # its model is the leader's: checked against the leader's fingerprint as it arrives
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
    if mine.rdma_ok and theirs.rdma_ok:
        return "rdma"
    if "rdma" in wants:
        missing = [f"the {ROLE_NAMES[h.role]} ({h.rdma_reason or 'no device'})" for h in (mine, theirs)
                   if not h.rdma_ok]
        raise RdmaUnavailableError(
            "transport=rdma but RDMA is unavailable on " + " and on ".join(missing)
            + "; fix the device or use --transport auto/tcp"
        )
    return "tcp"


def auth_proof(secret: bytes, prover_role: int, verifier_nonce: bytes, prover_nonce: bytes) -> bytes:
    """HMAC-SHA256 over the verifier's fresh nonce: proves the secret without
    sending it, and cannot be replayed into another connection."""
    msg = AUTH_TAG + AUTH_ROLE.pack(prover_role) + verifier_nonce + prover_nonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


def authenticate(control: ControlChannel, mine: Hello, theirs: Hello, secret: Optional[bytes]) -> None:
    """Challenge-response in both directions, before any session state exists."""
    peer = ROLE_NAMES[theirs.role]
    if not mine.auth and not theirs.auth:
        return
    if mine.auth != theirs.auth:
        why = (f"this side has a secret but the {peer} sent none" if mine.auth
               else f"the {peer} requires a secret and this side has none")
        raise AuthenticationError(f"authentication failed: {why}; give both machines the same "
                                  "--secret / DS4_TP_SECRET (or the code of `ds4tp pair`)")
    control.send(FrameType.AUTH, auth_proof(secret, mine.role, theirs.nonce, mine.nonce))
    _, proof = control.recv(FrameType.AUTH)
    expected = auth_proof(secret, theirs.role, mine.nonce, theirs.nonce)
    if not hmac.compare_digest(proof, expected):
        raise AuthenticationError(
            f"authentication failed: the {peer}'s proof does not match this side's secret; "
            "the two machines have different --secret / DS4_TP_SECRET values (or `ds4tp pair` codes)"
        )


def data_proof(secret: Optional[bytes], leader: Hello, worker: Hello) -> bytes:
    """Binds the gate data connection to the authenticated control session."""
    if secret is None:
        return bytes(32)
    return hmac.new(secret, DATA_AUTH_TAG + leader.nonce + worker.nonce, hashlib.sha256).digest()


def tell_share(control: ControlChannel, parts: tuple) -> None:
    """The leader's share (each rank's part, rank 0's first; 1:1 even) to a worker, once a join."""
    control.send(FrameType.SPLIT, split_payload(len(parts)).pack(*parts))


def hear_share(control: ControlChannel, size: int = 2) -> tuple:
    """A worker's side of tell_share in a group of `size` ranks: each rank's part, all above
    zero. An ERROR the leader sent instead (a model that fits no share) raises TransportError
    with it."""
    _, payload = control.recv(FrameType.SPLIT)
    layout = split_payload(size)
    if len(payload) != layout.size:
        raise FrameError(f"SPLIT payload is {len(payload)} bytes, expected {layout.size} (a share of "
                         f"{size} ranks): the leader runs another --ranks; give every rank the same")
    parts = layout.unpack(payload)
    if min(parts) == 0:
        raise FrameError(f"the leader sent split {':'.join(map(str, parts))}, which leaves a rank with nothing")
    return parts
