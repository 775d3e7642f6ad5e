"""A worker's side of a part's transfer (started without --model): the leader's offer checked
against the fingerprint its hello stated and the share agreed, the parts cache asked what it
lacks (checkpoint/parts_cache.py: every kept file's digest read again), those files received
into it (over TCP a piece at a time, over the RDMA bulk path a few chunks at a time) and checked
against the leader's digests, again until none is missing. What arrived of a file cut short
stays for the next start to resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..base.log import log
from ..checkpoint.parts_cache import OfferedFile, PartEntry, PartsSettings, PartWriter
from ..errors import FrameError, PeerClosedError, TransportError
from ..link.fingerprint import summary_label
from ..link.wire import FINGERPRINT_SUMMARY, FrameType
from .overlap import BufferPool, Overlap
from .part_bulk import CHUNK_LENGTH, CONTROL_PATH, RDMA_PATH, BulkPath
from .part_send import CHUNK_BYTES, MAX_ROUNDS, PART_WAIT_S
from .share import SplitShare
from .transfer_progress import TransferProgress

WRITE_DEPTH = 4  # bulk chunks received and not yet written: the chunks a worker holds beyond its writes
# Over TCP each PART_DATA is read this much at a time, each piece hashed and written at once: it
# fits a core's L2 cache, so the digest and the write read what the socket's copy left there.
PIECE_BYTES = 1 << 20


def stated_fingerprint(summary: bytes) -> str:
    """The model digest (hex) a hello's fingerprint summary states; "" for a hello without one."""
    return FINGERPRINT_SUMMARY.unpack(summary)[0].hex() if summary else ""


def _offered(payload: bytes, fingerprint: str, rank: int, size: int,
             share: SplitShare) -> Tuple[List[OfferedFile], str]:
    """The offer's files, checked, and the path its bytes take (CONTROL_PATH or RDMA_PATH)."""
    try:
        offer = json.loads(payload)
        files = [OfferedFile(str(n), int(s), str(d)) for n, s, d in offer["files"]]
        said = (str(offer["fingerprint"]), int(offer["rank"]), int(offer["size"]), str(offer["share"]))
        path = str(offer["path"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FrameError(f"malformed PART_OFFER from the leader: {exc}") from None
    if path not in (CONTROL_PATH, RDMA_PATH):
        raise FrameError(f"the leader offers to send this rank's part over {path!r}, which this rank "
                         f"does not know ({CONTROL_PATH} or {RDMA_PATH}); run the same mlx_ds4tp")
    if said != (fingerprint, rank, size, str(share)):
        raise FrameError(f"the leader offered the part of model {said[0][:12]}, rank {said[1]} of {said[2]}, "
                         f"split {said[3]}; this rank joined model {fingerprint[:12]} as rank {rank} of "
                         f"{size}, split {share}")
    for f in files:
        f.check()
    return files, path


def receive_part(link: Any, rank: int, size: int, share: SplitShare, settings: PartsSettings,
                 bulk: Optional[BulkPath] = None) -> Path:
    """This worker's part, received (or found whole in its parts cache) from rank 0 on `link`
    (over `bulk`, that link's RDMA bulk path, when the leader's offer says so); the cache entry's
    directory, ready for load_part."""
    fingerprint = stated_fingerprint(link.peer_hello.fingerprint)
    if not fingerprint:
        raise FrameError("the leader's hello states no model fingerprint, so a worker without --model "
                         "cannot check the part it would send; start the leader with its model directory")
    control = link.control
    log(f"no --model here: waiting for the leader's offer of this rank's part of model "
        f"{summary_label(link.peer_hello.fingerprint)}")
    _, payload = control.recv(FrameType.PART_OFFER, timeout=PART_WAIT_S)
    offered, path = _offered(payload, fingerprint, rank, size, share)
    if path == RDMA_PATH and bulk is None:
        raise FrameError("the leader sends this rank's part over the RDMA bulk path, and this rank's "
                         "link to it is not RDMA; start both with the same --transport")
    bulk = bulk if path == RDMA_PATH else None
    sizes = {f.name: f.size for f in offered}
    entry = PartEntry(settings, fingerprint, rank, size, str(share).replace(":", "-"))
    wanted = entry.wanted(offered)
    if wanted:
        entry.make_room(sum(sizes[n] - o for n, o in wanted))
    for round_ in range(MAX_ROUNDS + 1):
        if wanted and round_ == MAX_ROUNDS:
            raise FrameError(f"rank {rank}'s part: {len(wanted)} file(s) still arrive damaged after "
                             f"{MAX_ROUNDS} tries ({wanted[0][0]}, ...); check the link and the disk")
        control.send(FrameType.PART_WANT, json.dumps({"files": wanted}).encode("utf-8"))
        if not wanted:
            break
        total = sum(sizes[n] - o for n, o in wanted)
        log(f"receiving this rank's part: {len(wanted)} file(s), {total / 1e6:.1f} MB, into {entry.path}"
            + (" (over the RDMA bulk path)" if bulk is not None else ""))
        progress = TransferProgress(f"receiving rank {rank}'s part", total)
        receiver = _Streamed(control) if bulk is None else _Pipelined(control, bulk)
        try:
            wanted = [(name, 0) for name, offset in wanted
                      if not receiver.file(entry.writer(name, offset, sizes[name]), progress)]
        except PeerClosedError as exc:
            # A dead leader or a pulled cable: say what is kept, so the restart's resume is expected.
            raise PeerClosedError(f"the leader closed the connection while sending this rank's part "
                                  f"({progress.bytes / 1e6:.1f} of {total / 1e6:.1f} MB arrived, kept in "
                                  f"{entry.path}: the next start resumes there): {exc}") from None
        progress.done()
    entry.touch()
    return entry.path


def decline_part(link: Any, rank: int, size: int, share: SplitShare) -> None:
    """A worker without --model that holds its part loaded already (it re-joins a group it kept
    serving): the leader's offer checked as receive_part checks it, and no file wanted."""
    _, payload = link.control.recv(FrameType.PART_OFFER, timeout=PART_WAIT_S)
    _offered(payload, stated_fingerprint(link.peer_hello.fingerprint), rank, size, share)
    link.control.send(FrameType.PART_WANT, json.dumps({"files": []}).encode("utf-8"))


class _Streamed:
    """Files over the control channel (TCP): each PART_DATA read a piece at a time into one buffer,
    each piece hashed and written on this thread as it arrives. The socket's receive buffer lets
    the leader send on meanwhile, so no thread of ours need overlap the writes: a write stage
    cost this side about 0.1 CPU-s a GB more (a hand-off and a wake-up a frame, and each frame
    read back from memory on another core), time a machine shared with the leader takes from it."""

    def __init__(self, control: Any):
        self.control = control
        self.piece = memoryview(bytearray(PIECE_BYTES))

    def file(self, writer: PartWriter, progress: Optional[TransferProgress]) -> bool:
        """One file's PART_DATA frames into writer, until its PART_END; whether it arrived whole.
        A transfer cut short keeps every piece received (the next start resumes after it)."""

        def consume(piece: memoryview) -> None:
            writer.write(piece)
            if progress is not None:
                progress.add(len(piece))

        try:
            while True:
                ftype, payload = self.control.recv_streamed(FrameType.PART_DATA, self.piece, consume)
                if ftype != FrameType.PART_DATA:
                    return _ended(writer, ftype, payload)
        except BaseException:
            writer.abandon()
            raise


class _Pipelined:
    """Files over the RDMA bulk path: each chunk an exchange, which the leader enters only when
    this side does, so the writes and digests run on a stage of their own (split/overlap.py) and
    the next chunk's exchange overlaps them. The chunks arrive in a few buffers of CHUNK_BYTES,
    written and hashed on the stage and handed back: one copy in memory, no allocation a chunk."""

    def __init__(self, control: Any, bulk: BulkPath):
        self.control, self.bulk = control, bulk
        self.buffers = BufferPool(CHUNK_BYTES, WRITE_DEPTH + 2)  # the queue's, the stage's, the one being filled

    def file(self, writer: PartWriter, progress: Optional[TransferProgress]) -> bool:
        """One file's chunks into writer, until its PART_END; whether it arrived whole. This
        thread receives; the stage writes and hashes what arrived before (a few chunks)."""
        whole = []

        def write(item: Tuple[memoryview, bytearray, str]) -> None:
            payload, buffer, digest = item
            if digest:
                whole.append(writer.finish(digest))
                return
            writer.write(payload)
            self.buffers.give_back(buffer)

        try:
            with Overlap(write, depth=WRITE_DEPTH, name="ds4tp-part-write") as disk:
                self.buffers.stages = (disk,)
                try:
                    return self._chunks_into(writer, disk, progress, whole)
                except (PeerClosedError, TransportError):
                    disk.finish()  # what arrived is written: the next start resumes after it
                    raise
        except BaseException:
            writer.abandon()
            raise

    def _chunks_into(self, writer: PartWriter, disk: Overlap, progress: Optional[TransferProgress],
                     whole: List[bool]) -> bool:
        while True:
            ftype, announcement = self.control.recv()
            if ftype != FrameType.PART_DATA:
                _, digest = _end(writer, ftype, announcement)
                disk.put((b"", b"", digest))
                disk.finish()
                return whole[0]
            buffer = self.buffers.take()
            payload = _bulk_chunk(announcement, buffer, self.bulk)
            disk.put((payload, buffer, ""))
            if progress is not None:
                progress.add(len(payload))


def _bulk_chunk(announcement: memoryview, buffer: bytearray, bulk: BulkPath) -> memoryview:
    """The chunk a PART_DATA announces on the bulk path, received into `buffer` (its own frame's)."""
    if len(announcement) != CHUNK_LENGTH.size:
        raise FrameError(f"a PART_DATA of {len(announcement)} bytes on the RDMA bulk path: it announces "
                         f"a chunk in {CHUNK_LENGTH.size}")
    (nbytes,) = CHUNK_LENGTH.unpack(announcement)
    if not 0 < nbytes <= min(bulk.chunk, len(buffer)):
        raise FrameError(f"the leader announces a chunk of {nbytes} bytes; the bulk path's are {bulk.chunk}")
    view = memoryview(buffer)
    bulk.receive_into(view)
    return view[:nbytes]


def _end(writer: PartWriter, ftype: FrameType, payload: bytes) -> Tuple[str, str]:
    """The (name, digest) of the PART_END that ends writer's file; FrameError for any other frame."""
    if ftype != FrameType.PART_END:
        raise FrameError(f"expected PART_DATA or PART_END while receiving {writer.name}, got {ftype.name}")
    try:
        doc = json.loads(bytes(payload))
        name, digest = str(doc["name"]), str(doc["digest"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FrameError(f"malformed PART_END from the leader: {exc}") from None
    if name != writer.name:
        raise FrameError(f"the leader ended {name} while this rank received {writer.name}")
    return name, digest


def _ended(writer: PartWriter, ftype: FrameType, payload: bytes) -> bool:
    """Writer's file ended by this frame (its PART_END): kept when whole and of the leader's
    digest; whether it was."""
    _, digest = _end(writer, ftype, payload)
    return writer.finish(digest)


__all__ = ["decline_part", "receive_part", "stated_fingerprint"]
