"""The wire format between the two ranks: every frame type's number, the transport's struct
layouts, magics and size bounds, in this one module (a protocol change is reviewed here; a
lockstep command's layout and bound are its class's, lockstep/protocol/commands/).

Every machine a rank runs on (Apple Silicon, x86 Linux here) is little-endian, so every layout
is, and the magic in each header doubles as the byte-order check.
Three streams carry bytes: the control connection (framed messages), the gate
data connection (TCP gates and small swaps), and, with RDMA, the queue pair.

Control frames: FRAME_HEADER (magic MAGIC, type, byte count), then the payload.
The bound is checked before anything is allocated. The transport's own frames and their bounds:

| frame            | payload                                                        | bound       |
|------------------|----------------------------------------------------------------|-------------|
| STOP             | empty                                                          | 64          |
| RDMA_INFO        | RDMA_INFO (qpn, psn, mtu, lid, link layer, gid)                | 64          |
| RDMA_READY       | empty                                                          | 16          |
| RDMA_WARM        | WARM_ROUND (setup attempt, round, received, phase)             | 64          |
| RDMA_POSTED      | POSTED (1)                                                     | 64          |
| HELLO            | HELLO_FIXED + UTF-8 reason (<= MAX_REASON_BYTES) + FINGERPRINT_SUMMARY or nothing | 1024 |
| SPLIT            | SPLIT_PAYLOAD (rank 0's part, rank 1's part): the leader's share, before any weight | 64          |
| ERROR            | UTF-8 message                                                  | 4096        |
| RDMA_STATUS      | STATUS (ok, message length) + UTF-8 message                    | 4096        |
| AUTH             | HMAC-SHA256 proof (32 bytes)                                   | 256         |
| FINGERPRINT      | FINGERPRINT_SUMMARY                                            | 64          |
| FINGERPRINT_DETAIL | zlib of JSON {v, config, tensors} (<= MAX_FINGERPRINT_DETAIL_EXPANDED expanded) | 16777216 |
| JOIN             | JOIN_PAYLOAD (version, size or 0 for the leader's, rank asked or -1, listen port, nonce, proof; then its cable addresses, link/cables.py): a worker asks rank 0's door for a place in a group of N ranks, 2 included (link/mesh.py) | 1024 |
| ROSTER           | ROSTER_HEADER (size, this rank) + size x ROSTER_ENTRY (port, UTF-8 host, cable addresses): every rank's link address and cables | 8192 |
| MESH_ID          | MESH_ID_PAYLOAD (the mesh's random id, the sender's rank): after the ROSTER, first on every mesh link's control connection, and once more each way on the JOIN connection when every link is up | 64 |
| REFORM           | UTF-8 text, the leader's reason: a serving leader whose group (any N) broke forms it again; each worker still alive joins the new mesh with its rank (serve/rejoin.py) | 4096 |
| RESIZE           | RESIZE_HEAD (the new group's size, the receiver's rank in it, the share's part count) + that many u16 parts (none: even): a serving leader forms a group of another size (a lost worker left out, or back) and each member joins it with that rank and share (serve/resize.py); also the door's answer to a JOIN for a group that did not form | 64 |
| PART_OFFER       | UTF-8 JSON: the files of a worker's part the leader offers (names, sizes, digests) and the path of their bytes (tcp or rdma), to a worker started without --model (split/part_send.py) | 16777216 |
| PART_WANT        | UTF-8 JSON: the files (and the offset in each) that worker still needs; an empty list ends the transfer | 1048576 |
| PART_DATA        | the next bytes of the file being sent (over RDMA: the length of the chunk the link's next exchange carries) | 4194304     |
| PART_END         | UTF-8 JSON: the file sent whole, its name and digest           | 4096        |

The lockstep commands (SESSION_CREATE, REWIND, PREFILL_BATCH, SAMPLER, EVAL_BATCH,
VERIFY_BATCH, COMMIT_BATCH, SESSION_DESTROY, INVALIDATE, DISK_SAVE, DISK_LOAD, KV_ROOM, HASH; STOP,
which carries nothing, is the transport's above) are one protocol, mlx_ds4tp.lockstep.protocol:
`ds4tp serve` runs many sessions on it, `ds4tp run` one. Their numbers are here (FrameType);
everything else about one, its bound included, is its class in mlx_ds4tp.lockstep.protocol.commands,
which registers that bound here (register_frame_bound) as it is defined, so the transport still
checks every frame's bound before reading it while this module knows nothing above it. A frame
whose type has no bound in this process (a lockstep command in a process that never loaded the
lockstep) is refused at its header. Numbers
of retired frames (1 SYNC, 2 EVAL, 10 LOGITS, 17 COMMAND_ACK, 33 VERIFY, 37 DECODE, 46 MESH_SIZE) are never
reused: a peer of an older install that sent one gets "unknown frame type" at the header.

Gate data connection: DATA_HELLO (DATA_MAGIC, version, session id, proof) once
from the worker; then, per exchange of the collectives (csrc/exchange.c, which
the MLX backend calls, and the bench, doctor and tests through
link/exchange.py), the exchange header (magic, collective, dtype code, seq, bytes,
ndim, the first dims: laid out and numbered in csrc/exchange_codes.h, its one source)
ahead of the payload over TCP (a decode gate write-then-read, a bulk exchange both
directions at once: tp_tcp_duplex); over RDMA the header alone when the signature changes and before each bulk exchange,
the payload on the queue pair.

Queue pair: the warm-up message is RDMA_MAX_MSG bytes starting with WARM_TAG
(WARM_MAGIC, rank, setup attempt); its work request id is WARM_MAGIC too.
"""

from __future__ import annotations

import enum
import struct

from ..errors import FrameError

# 2: the hello carries a model fingerprint. 3: `ds4tp run` speaks the serving sessions'
# commands (one lockstep protocol), so a rank of an older install is refused at the hello.
# 4: prompts waiting together are prefilled in one PREFILL_BATCH forward.
# 5: speculative rows verified in the decode batch (VERIFY_BATCH, COMMIT_BATCH); SESSION_CREATE
# names a fresh cache's KV quantization.
# 6: both ranks sample for themselves, so decode is pipelined: `ds4tp run` in one DECODE,
# `ds4tp serve`'s batch through SAMPLER and EVAL_BATCH rows that take this rank's own sample.
# 7: `ds4tp run` speaks exactly serve's commands (PREFILL_BATCH, SAMPLER + EVAL_BATCH,
# VERIFY_BATCH + COMMIT_BATCH); SYNC, VERIFY and DECODE, and the never-sent EVAL, LOGITS and
# COMMAND_ACK, are gone, so a rank of version 6 would send frames this one refuses.
# 8: the hello carries what each rank measured at start (the memory it may use, its speed on
# a matrix-vector product), and the leader sends the split share (SPLIT) after it: two different
# Macs split unevenly, and a rank of version 7 would load an even half the leader never meant.
# 9: stored prompt caches go to disk and come back (DISK_SAVE, DISK_LOAD), each rank its own
# half; a rank of version 8 would refuse the frames mid-serve.
# 10: a warm-up round exchanges RDMA_WARM twice (phase: send posted, then received); a rank of
# version 9 would read the first as its round's status and desync.
# 12 (11 was a reverted trial's SPLIT): the leader asks the worker how many KV cache tokens its
# machine holds (KV_ROOM), so two different Macs' serving budget is the smaller; a rank of
# version 10 would refuse the frame at the start of serving.
# 13: a worker started without a size (no --ranks) learns the leader's: its pair HELLO at a
# gathering mesh's door is answered with MESH_SIZE, and it JOINs a mesh of that size. The door
# answers only a HELLO of its own version, so a worker of version 12 is told the versions
# instead of meeting a frame type it does not know; a pair's wire is otherwise unchanged.
# 14: two ranks form as any group does (door, JOIN, ROSTER, MESH_ID, one link), and a worker
# started without a size JOINs with size 0 and learns the leader's from the ROSTER: MESH_SIZE is
# gone, and a rank of version 13 (whose pair said HELLO first) is told the versions at the door.
# The leader asks a worker for its figures for the cluster page (RANK_STATS), and a worker
# started without --model joins with the identity PART_RECEIVER (hello.py) and receives its part
# of the leader's model (PART_OFFER, PART_WANT, PART_DATA, PART_END) before it loads.
# A group of 3 or more swaps with its neighbours which links its collectives run over (the
# full mesh or a ring: collectives/topology.py) in one exchange on the data links before its
# first collective.
# A re-join offers a worker started without --model its part again (PART_OFFER, then its
# PART_WANT: the files a restarted one lacks, none from one that kept its part loaded). A JOIN
# and each ROSTER entry carry the rank's cable addresses (its --interface interfaces' IPv4
# addresses and prefixes, link/cables.py), so each link finds its own cable and device.
# 15: RESIZE, a serving leader's group shrinking to the ranks left and growing back; a
# PART_OFFER names the path of the part's bytes ("tcp": PART_DATA frames; "rdma": each
# PART_DATA holds the length of the chunk the next exchange of the RDMA link carries,
# split/part_bulk.py).
# 16: RESIZE also answers a JOIN at a serving leader's door, when the group it would join
# did not form and the leader falls back to the ranks it had (link/mesh.py raises
# RegroupedError for it).
# 17: a part's digests (PART_OFFER's, PART_END's) are BLAKE3's, written "blake3:HEX"
# (checkpoint/parts_cache.py), and an offer may give a part file's digest before its bytes.
PROTOCOL_VERSION = 17

# ---- magics (ASCII in the high bytes, so a hex dump names them) --------------
MAGIC = 0x44533454  # "DS4T": control frames
DATA_MAGIC = 0x44533444  # "DS4D": first word on the gate data connection
WARM_MAGIC = 0x5741524D  # "WARM": the warm-up message's tag and work request id
WARM_WR_ID = WARM_MAGIC

LEADER, WORKER = 0, 1
ROLE_NAMES = {LEADER: "leader", WORKER: "worker"}


class FrameType(enum.IntEnum):
    """Control frame types. The numbers travel on the wire: a new type takes a
    free number, an existing one is never renumbered."""

    REWIND = 3
    INVALIDATE = 4
    STOP = 5
    HASH = 6
    RDMA_INFO = 7
    RDMA_READY = 9
    SESSION_CREATE = 13
    SESSION_DESTROY = 14
    RDMA_WARM = 19
    RDMA_POSTED = 20
    HELLO = 21
    ERROR = 22
    RDMA_STATUS = 23
    AUTH = 24
    FINGERPRINT = 25
    FINGERPRINT_DETAIL = 26
    # One decode step over the rows of every active session (mlx_ds4tp.lockstep.protocol.sessions).
    EVAL_BATCH = 32
    # One prefill chunk of several sessions in one right-padded forward (mlx-lm's batched
    # prompt processing: mlx_ds4tp.lockstep.caches.session_caches.SessionCaches.prefill_batch).
    PREFILL_BATCH = 34
    # One decode step whose rows carry an input token and their drafts, right-padded to the
    # longest (`ds4tp serve`'s speculative sessions in the batch: lockstep.batch_verify) ...
    VERIFY_BATCH = 35
    # ... then the positions of each row its session keeps; the rest leave the caches.
    COMMIT_BATCH = 36
    # A session's sampler, on both ranks: its options, random seed and the prompt's latest
    # tokens, so both sample its rows alike (lockstep.sampling.row_sampling).
    SAMPLER = 38
    # The split share both ranks load with, the leader's (resolved from both hellos' figures
    # for --split auto), sent once a join before any weight is read (split.agree).
    SPLIT = 39
    # A stored prompt cache written to this rank's --prompt-cache-dir (and dropped from memory
    # when evicted), with the tokens it covers (lockstep.caches.disk_cache) ...
    DISK_SAVE = 40
    # ... and one read back as a stored cache; the worker answers whether its half loaded.
    DISK_LOAD = 41
    # How many KV cache tokens the worker's machine holds beside its part of the weights
    # (lockstep.caches.memory): the leader's default budget is the smaller of the two ranks'.
    KV_ROOM = 42
    # A group of N ranks, 2 included (link/mesh.py, link/door.py): a worker's request for a rank at rank 0's
    # door, the leader's answer with every rank's address, and the mesh's id, which also opens
    # every link's control connection so a link from a stale mesh is refused at the door.
    JOIN = 43
    ROSTER = 44
    MESH_ID = 45
    # A serving leader whose mesh broke (a worker died) and that forms it again: each worker
    # still alive joins the new mesh at the same door with its rank and share (serve/rejoin.py).
    REFORM = 47
    # A serving leader's question for the cluster page (GET /cluster): the worker's host, chip,
    # memory and its links' gate latencies, asked only while the engine is idle.
    RANK_STATS = 48
    # A worker started without --model receives its part of the leader's model after the share
    # is agreed (split/part_send.py, split/part_receive.py): the files offered, the files wanted
    # (with the offset a cut transfer stopped at), their bytes, and each file's end and digest.
    PART_OFFER = 49
    PART_WANT = 50
    PART_DATA = 51
    PART_END = 52
    # A serving leader that forms its group at another size (a lost worker left out after
    # --shrink-after, or taken back): each member's new rank and the share (serve/resize.py).
    RESIZE = 56


# ---- size bounds --------------------------------------------------------------
# RDMA_MAX_MSG and GATE_MAX_BYTES are also the C module's TP_MAX_MSG and
# TP_GATE_MAX_CHUNKS * TP_MAX_MSG (_verbs_api.h); tests/test_wire_and_config.py
# checks they agree. They are written here rather than read from the compiled
# module because this module must import without it: `import mlx_ds4tp`,
# transport="mlx" and `ds4tp doctor` (which reports the module missing) work on
# an install whose C build failed.
# The Apple Thunderbolt driver never delivers a message above 16 KiB.
RDMA_MAX_MSG = 16384
# Largest exchange that rides as a decode gate: two RDMA messages of the
# driver's maximum. Anything larger goes through the bulk path.
GATE_MAX_BYTES = 2 * RDMA_MAX_MSG
# A 16 KiB gate fits any socket buffer, so write-then-read cannot deadlock; a
# bulk exchange writes and reads at once instead (tp_tcp_duplex).
MAX_REASON_BYTES = 512
MAX_STATUS_MESSAGE_BYTES = 3000
NONCE_BYTES = 16

# Largest payload each frame type may claim: checked before anything is
# allocated, so a header claiming 4 GiB is an error, never a malloc. The transport's own
# frames are bounded here; each lockstep command adds its own (register_frame_bound).
FRAME_MAX_BYTES = {
    FrameType.STOP: 64,
    FrameType.RDMA_INFO: 64,
    FrameType.RDMA_READY: 16,
    FrameType.RDMA_WARM: 64,
    FrameType.RDMA_POSTED: 64,
    FrameType.HELLO: 1024,
    FrameType.ERROR: 4096,
    FrameType.RDMA_STATUS: 4096,
    FrameType.AUTH: 256,
    FrameType.FINGERPRINT: 64,
    FrameType.FINGERPRINT_DETAIL: 16 * 1024 * 1024,
    FrameType.SPLIT: 64,
    FrameType.JOIN: 1024,
    FrameType.ROSTER: 8192,
    FrameType.MESH_ID: 64,
    FrameType.REFORM: 4096,
    FrameType.PART_OFFER: 16 * 1024 * 1024,
    FrameType.PART_WANT: 1024 * 1024,
    FrameType.PART_DATA: 4 * 1024 * 1024,
    FrameType.PART_END: 4096,
    FrameType.RESIZE: 64,
}
# RESIZE: the new group's size, the receiver's rank in it, how many u16 share parts follow.
RESIZE_HEAD = struct.Struct("<BBB")


def register_frame_bound(ftype: FrameType, bound: int) -> None:
    """Bound the payload of a frame type defined above the transport (a lockstep command
    declares its bound in its class, which calls this as it is defined). A type bounded twice
    differently is a programming error, caught at import."""
    ftype = FrameType(ftype)
    if not 0 < bound <= FRAME_MAX_BYTES[FrameType.FINGERPRINT_DETAIL]:
        raise ValueError(f"{ftype.name}'s bound {bound} must be 1 to {FRAME_MAX_BYTES[FrameType.FINGERPRINT_DETAIL]} bytes")
    if FRAME_MAX_BYTES.get(ftype, bound) != bound:
        raise ValueError(f"{ftype.name} is bounded twice: {FRAME_MAX_BYTES[ftype]} and {bound} bytes")
    FRAME_MAX_BYTES[ftype] = bound


def frame_bound(ftype: FrameType) -> int:
    """The largest payload a frame of `ftype` may have; FrameError when nothing in this process
    bounds it (a lockstep command where the lockstep was never loaded: the frame is refused)."""
    try:
        return FRAME_MAX_BYTES[ftype]
    except KeyError:
        raise FrameError(f"{ftype.name} frame: no bound for it in this process (its command module "
                         "is not loaded, so nothing here expects it)") from None


# ---- layouts ------------------------------------------------------------------
FRAME_HEADER = struct.Struct("<III")  # magic, type, byte count

# Hello: magic, version, role, transport wanted, rdma_ok, reason length,
# fingerprint length, session id, "I have a secret", a fresh nonce, then the
# model identity's fields (layers, hidden, vocab, quant bits, gates per
# token), the rank's figures (bytes of memory it may use, bytes a second of
# its matrix-vector product; 0: not measured); then the reason, then the
# fingerprint summary (or nothing).
MODEL_IDENTITY_FIELDS = ("layers", "hidden", "vocab", "quant_bits", "gates_per_token")
# The first words of every version's hello (magic, version, role): a group's door reads these
# to name the version of a rank that said hello where this version JOINs.
HELLO_HEAD = struct.Struct("<III")
HELLO_FIXED = struct.Struct(f"<IIIIIIIQI{NONCE_BYTES}s" + "I" * len(MODEL_IDENTITY_FIELDS) + "QQ")
# Model fingerprint (_fingerprint.py): digest of the three parts, then the
# digests of the config, of the tensor table (names, dtypes, shapes, sizes)
# and of the sampled bytes, the tensor count and the weights' total bytes.
FINGERPRINT_SUMMARY = struct.Struct("<16s8s8s8sIQ")
FINGERPRINT_DETAIL_VERSION = 1
MAX_FINGERPRINT_DETAIL_EXPANDED = 128 * 1024 * 1024
TRANSPORT_CODES = {"auto": 0, "tcp": 1, "rdma": 2}
TRANSPORT_NAMES = {v: k for k, v in TRANSPORT_CODES.items()}
# The prover's role inside the HMAC message of the AUTH proof.
AUTH_ROLE = struct.Struct("<I")
AUTH_TAG = b"ds4tp-auth-v1"
DATA_AUTH_TAG = b"ds4tp-data-v1"

DATA_HELLO = struct.Struct("<IIQ32s")  # DATA_MAGIC, version, session id, proof

RDMA_INFO = struct.Struct("<IIIHB16s")  # qpn, psn, mtu, lid, link_layer, gid
STATUS = struct.Struct("<II")  # ok, message length; then the message
POSTED = struct.Struct("<I")  # always 1: "my receives are posted"
WARM_ROUND = struct.Struct("<IIII")  # setup attempt, round, received, phase (below)
# A warm-up round has two RDMA_WARM exchanges: "this round's send is posted" (received is 0),
# then "this is what I received by the round's deadline" (link/rdma_bringup.py says why).
WARM_PHASE_SENT, WARM_PHASE_STATUS = 1, 2
WARM_TAG = struct.Struct("<IIII")  # WARM_MAGIC, rank, setup attempt, reserved

SPLIT_PAYLOAD = struct.Struct("<II")  # rank 0's part, rank 1's part of every split count (1:1 even)


def split_payload(size: int) -> struct.Struct:
    """SPLIT's layout for a group of `size` ranks: each rank's part, rank 0's first (a pair's
    is SPLIT_PAYLOAD; a mesh's leader sends it on each worker's link)."""
    return SPLIT_PAYLOAD if size == 2 else struct.Struct("<" + "I" * size)


# A mesh (link/mesh.py). JOIN: protocol version, the mesh size the worker expects, the rank
# it asks for (-1: any), the port its own door listens on, a fresh nonce, and the HMAC proof
# of the pair secret over the rest and the cable addresses that follow (zeros without a secret).
JOIN_PAYLOAD = struct.Struct(f"<IIiI{NONCE_BYTES}s32s")
JOIN_TAG = b"ds4tp-join-v1"
ROSTER_HEADER = struct.Struct("<II")  # size, the receiving rank; then size entries
ROSTER_ENTRY = struct.Struct("<HH")  # port, host length; then the UTF-8 host, the cable addresses
MESH_ID_PAYLOAD = struct.Struct("<16sI")  # the mesh's id, the sending rank
MAX_MESH_SIZE = 8
