"""A worker's side of a part's transfer (started without --model): the leader's offer checked
against the fingerprint its hello stated and the share agreed, the parts cache asked what it
lacks (checkpoint/parts_cache.py: every kept file's digest read again), those files received
into it a few chunks at a time and checked against the leader's digests, again until none is
missing. What arrived of a file cut short stays for the next start to resume."""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..base.log import log
from ..checkpoint.parts_cache import OfferedFile, PartEntry, PartsSettings, PartWriter
from ..errors import FrameError, PeerClosedError, TransportError
from ..link.fingerprint import summary_label
from ..link.wire import FINGERPRINT_SUMMARY, FrameType
from .overlap import Overlap
from .part_bulk import CHUNK_LENGTH, CONTROL_PATH, RDMA_PATH, BulkPath
from .part_send import CHUNK_BYTES, MAX_ROUNDS, PART_WAIT_S
from .share import SplitShare
from .transfer_progress import TransferProgress

WRITE_DEPTH = 4  # frames received and not yet written: the chunks a worker holds beyond its writes


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
        buffers = _Buffers(WRITE_DEPTH + 2)  # the queue's, the stage's and the one being filled
        try:
            wanted = [(name, 0) for name, offset in wanted
                      if not _receive_file(control, entry.writer(name, offset, sizes[name]), buffers, progress,
                                           bulk)]
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


class _Buffers:
    """The receiver's frame buffers: a few of CHUNK_BYTES, each filled by the socket, then
    written and hashed on the write stage and handed back, so a file arrives with one copy in
    memory (the socket's into a buffer) and no allocation a frame."""

    def __init__(self, count: int):
        self.free: "queue.Queue[bytearray]" = queue.Queue()
        for _ in range(count):
            self.free.put(bytearray(CHUNK_BYTES))
        self.taken = bytearray()
        self.stage: Optional[Overlap] = None

    def take(self, nbytes: int) -> memoryview:
        # A frame over a buffer (not a PART_DATA, refused next) gets its own.
        self.taken = self._free() if nbytes <= CHUNK_BYTES else bytearray(nbytes)
        return memoryview(self.taken)

    def _free(self) -> bytearray:
        while True:
            try:
                return self.free.get(timeout=1.0)
            except queue.Empty:
                # A write stage that failed hands no buffer back: its error, not a wait.
                if self.stage is not None and self.stage.error is not None:
                    raise self.stage.error from None

    def give_back(self, buffer: bytearray) -> None:
        if len(buffer) == CHUNK_BYTES:
            self.free.put(buffer)


def _receive_file(control: Any, writer: PartWriter, buffers: _Buffers,
                  progress: Optional[TransferProgress], bulk: Optional[BulkPath]) -> bool:
    """One file's PART_DATA frames into writer, until its PART_END; whether it arrived whole.
    This thread receives; the overlap writes and hashes what arrived before (a few chunks)."""
    whole = []

    def write(item: Tuple[memoryview, bytearray, str]) -> None:
        payload, buffer, digest = item
        if digest:
            whole.append(writer.finish(digest))
            return
        writer.write(payload)
        buffers.give_back(buffer)

    try:
        with Overlap(write, depth=WRITE_DEPTH, name="ds4tp-part-write") as disk:
            buffers.stage = disk
            try:
                return _frames_into(control, writer, disk, buffers, progress, whole, bulk)
            except (PeerClosedError, TransportError):
                disk.finish()  # what arrived is written: the next start resumes after it
                raise
    except BaseException:
        writer.abandon()
        raise


def _frames_into(control: Any, writer: PartWriter, disk: Overlap, buffers: _Buffers,
                 progress: Optional[TransferProgress], whole: List[bool], bulk: Optional[BulkPath]) -> bool:
    """The frames of one file: each PART_DATA handed to the write stage in the buffer it arrived
    in (over the bulk path: the chunk it announces, received into that buffer), then PART_END's
    digest; whether the file arrived whole."""
    while True:
        ftype, payload = control.recv_into(buffers.take)
        if ftype == FrameType.PART_DATA and bulk is not None:
            payload = _bulk_chunk(payload, buffers.taken, bulk)
        if ftype == FrameType.PART_DATA:
            disk.put((payload, buffers.taken, ""))
            if progress is not None:
                progress.add(len(payload))
            continue
        if ftype != FrameType.PART_END:
            raise FrameError(f"expected PART_DATA or PART_END while receiving {writer.name}, "
                             f"got {ftype.name}")
        name, digest = _end(bytes(payload))
        buffers.give_back(buffers.taken)
        if name != writer.name:
            raise FrameError(f"the leader ended {name} while this rank received {writer.name}")
        disk.put((b"", b"", digest))
        disk.finish()
        return whole[0]


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


def _end(payload: bytes) -> Tuple[str, str]:
    try:
        doc = json.loads(payload)
        return str(doc["name"]), str(doc["digest"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FrameError(f"malformed PART_END from the leader: {exc}") from None


__all__ = ["decline_part", "receive_part", "stated_fingerprint"]
