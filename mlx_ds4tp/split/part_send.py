"""The leader's side of a part's transfer: to a worker started without --model, on that worker's
control connection once the share is agreed (TCP: the control channel's frames), the files of
its part offered (PART_OFFER), the ones it wants sent from the offset it asks (PART_DATA), each
closed by its digest (PART_END), until it wants none.

The part files' bytes are cut as load_split would cut them for that rank (split_model's
cut_arrays, reading each array's part from the model's files), one array at a time: each is
sent and dropped before the next is read, so the leader never holds the worker's part. A file
resumed from an offset is still read from its start (its digest covers the whole file); only
the bytes past the offset are sent. What does not change from one transfer of the part to the
next (its plan, the cut's traced layout, each file's digest) is kept (split/part_memo.py): a
second worker, a resume or a re-join is not traced or hashed again, and is offered the digests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from ..base.log import log
from ..checkpoint.parts import SafetensorsParts
from ..checkpoint.parts_cache import new_digest
from ..errors import FrameError
from ..link.control import ControlChannel
from ..link.wire import FrameType
from .apply import cut_arrays, traced_layout
from .derive import set_array
from .overlap import Overlap
from .part_bulk import CHUNK_LENGTH, CONTROL_PATH, RDMA_PATH, BulkPath, bulk_path
from .part_memo import keep_on_disk, part_memo
from .part_plan import PART_CONFIG, PartPlan, bytes_digest, plain_files
from .plans import saved_layout
from .share import SplitShare
from .transfer_progress import TransferProgress

CHUNK_BYTES = 4 << 20  # one PART_DATA frame (its bound in link/wire.py)
STAGE_DEPTH = 4  # chunks queued before each stage of the leader's side
# A worker checks its cached files' digests before it answers an offer, and a worker waits for
# the leader to finish the ranks before it: minutes on a large model.
PART_WAIT_S = 24 * 3600.0
MAX_ROUNDS = 3
# A test hook, never set in use: the leader stops sending for good once this many bytes of a
# part went (it logs so and waits to be killed), so a process-level test can kill a leader
# mid-transfer at a known point instead of racing a timer (tests/test_part_delivery.py).
TEST_PAUSE_ENV = "DS4_TP_TEST_PART_PAUSE_AFTER_BYTES"


def pause_for_tests() -> Optional[int]:
    """The bytes after which TEST_PAUSE_ENV stops the transfer; None when it is not set."""
    raw = os.environ.get(TEST_PAUSE_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{TEST_PAUSE_ENV}={raw!r} is not a byte count; unset it (it is a test hook)")
    return value


def part_bytes(array: mx.array) -> memoryview:
    """An evaluated array's bytes, row-major, as safetensors holds them."""
    array = mx.contiguous(array)
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    mx.eval(array)
    return memoryview(array).cast("B")


class PartSender:
    """One worker's part (rank `rank` of `size`, `share`) of the model at model_path."""

    def __init__(self, model_path: Path, rank: int, size: int, share: SplitShare, fingerprint: str):
        self.model_path, self.rank, self.size, self.share = Path(model_path), rank, size, share
        self.fingerprint = fingerprint
        self.memo = part_memo(self.model_path, rank, size, share)
        self.plan: PartPlan = self.memo.plan
        self.plain = {p.name: p.read_bytes() for p in plain_files(self.model_path)}
        self.plain[PART_CONFIG] = self.plan.part_config
        self.plain_digests = {name: bytes_digest(data) for name, data in self.plain.items()}

    def offer(self, path: str = CONTROL_PATH) -> dict:
        """The files, each with its size and digest: a part file's digest where a transfer before
        read it whole (the memo's), else "" (it comes with its PART_END)."""
        files = [[name, len(data), self.plain_digests[name]] for name, data in self.plain.items()]
        files += [[f.name, f.size, self.memo.digests.get(f.name, "")] for f in self.plan.files]
        return {"fingerprint": self.fingerprint, "rank": self.rank, "size": self.size,
                "share": str(self.share), "files": files, "path": path}

    def send(self, control: ControlChannel, bulk: Optional[BulkPath] = None) -> int:
        """Offer the part, send what the worker wants until it wants nothing; the bytes sent.
        bulk: the RDMA link's exchanges carry the bytes (split/part_bulk.py), else PART_DATA."""
        offer = self.offer(CONTROL_PATH if bulk is None else RDMA_PATH)
        control.send(FrameType.PART_OFFER, json.dumps(offer).encode("utf-8"))
        sent = 0
        for _ in range(MAX_ROUNDS + 1):
            wanted = self._hear_want(control)
            if not wanted:
                return sent
            total = sum(self._size(name) - offset for name, offset in wanted)
            progress = TransferProgress(f"sending rank {self.rank}'s part", total, to_rank=self.rank)
            try:
                sent += self._send_wanted(control, wanted, progress, bulk)
            finally:
                progress.close()
                keep_on_disk(self.memo)  # what this round traced and hashed, cut or not
            progress.done()
        raise FrameError(f"rank {self.rank} still wants files after {MAX_ROUNDS} rounds")

    def _send_wanted(self, control: ControlChannel, wanted: List[Tuple[str, int]],
                     progress: TransferProgress, bulk: Optional[BulkPath]) -> int:
        """The wanted files sent (from their offsets); the bytes sent."""
        frames = _Frames(control, progress, bulk)
        # Three stages, each on its own thread: this one reads and cuts the arrays, the next
        # hashes them (a file whose digest the memo holds passes through), the last sends them
        # (a few chunks queued between each).
        with Overlap(frames.take, depth=STAGE_DEPTH, name="ds4tp-part-send") as wire, \
                Overlap(_Hashing(wire, self.memo.digests).take, depth=STAGE_DEPTH, name="ds4tp-part-hash") as hashing:
            for name, offset in wanted:
                if name in self.plain:
                    self._queue_file(hashing, name, iter((memoryview(self.plain[name]),)), offset,
                                     self.plain_digests[name])
            parts = [(name, offset) for name, offset in wanted if name not in self.plain]
            if parts:
                self._queue_parts(hashing, dict(parts))
            hashing.finish()
            wire.finish()
        return frames.sent

    def _size(self, name: str) -> int:
        if name in self.plain:
            return len(self.plain[name])
        return next(f.size for f in self.plan.files if f.name == name)

    def _hear_want(self, control: ControlChannel) -> List[Tuple[str, int]]:
        _, payload = control.recv(FrameType.PART_WANT, timeout=PART_WAIT_S)
        try:
            wanted = [(str(name), int(offset)) for name, offset in json.loads(payload)["files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise FrameError(f"malformed PART_WANT from rank {self.rank}: {exc}") from None
        known = set(self.plain) | {f.name for f in self.plan.files}
        for name, offset in wanted:
            if name not in known or not 0 <= offset <= self._size(name):
                raise FrameError(f"rank {self.rank} wants {name} from byte {offset}, which the offer has not")
        return wanted

    def _queue_file(self, hashing: Overlap, name: str, arrays: Iterator[memoryview], offset: int,
                    known: Optional[str]) -> None:
        """Every array's bytes to the hash stage a chunk at a time (all into the digest, the bytes
        past `offset` sent), then the file's end (PART_END with the digest). known: the file's
        digest from before (the memo's, a plain file's): nothing is hashed."""
        digest, pos = (known if known else new_digest()), 0
        for data in arrays:
            for at in range(0, len(data), CHUNK_BYTES):
                chunk = data[at: at + CHUNK_BYTES]
                hashing.put((digest, chunk, min(max(offset - pos, 0), len(chunk))))
                pos += len(chunk)
        hashing.put((digest, name, 0))

    def _queue_parts(self, hashing: Overlap, wanted: Dict[str, int]) -> None:
        """The wanted part files, in the plan's order, their arrays cut one at a time."""
        from mlx_lm.utils import load_model

        model, _ = load_model(self.model_path, lazy=True)
        reader = SafetensorsParts(self.model_path, self.rank, self.size, **saved_layout(type(model).__module__))
        memo = self.memo
        if memo.layout is None:
            memo.layout = traced_layout(model, memo.group, split=self.share)
        arrays = cut_arrays(model, memo.group, split=self.share, read_part=reader, layout=memo.layout)
        last = max(i for i, f in enumerate(self.plan.files) if f.name in wanted)
        for file in self.plan.files[: last + 1]:
            chunks = self._file_chunks(model, file, arrays)
            if file.name in wanted:
                self._queue_file(hashing, file.name, chunks, wanted[file.name], memo.digests.get(file.name))
            else:
                for _ in chunks:  # its arrays still come in order before the next file's
                    pass
        arrays.close()

    def _file_chunks(self, model: Any, file, arrays: Iterator[Tuple[str, mx.array]]) -> Iterator[memoryview]:
        yield memoryview(file.header)
        for tensor in file.tensors:
            key, array = next(arrays)
            if key != tensor.key or tuple(array.shape) != tensor.shape or array.nbytes != tensor.nbytes:
                raise ValueError(f"rank {self.rank}'s part: {key} {tuple(array.shape)} came where the plan "
                                 f"has {tensor.key} {tensor.shape}; the cut and its plan disagree")
            yield part_bytes(array)
            del array
            set_array(model, key, mx.zeros((0,), mx.uint8))  # sent: dropped, not held to the end


class _Hashing:
    """The hash stage: each (digest, bytes, skip) into its file's digest, the bytes past `skip`
    handed to the wire stage; (digest, name, 0), the file's end, handed on with the digest, which
    `digests` (the memo's) keeps for the next transfer. A digest known before (its text) takes no
    bytes."""

    def __init__(self, wire: Overlap, digests: Dict[str, str]):
        self.wire, self.digests = wire, digests

    def take(self, item: Tuple[Any, Any, int]) -> None:
        digest, data, skip = item
        if isinstance(data, str):
            if isinstance(digest, str):
                text = digest
            else:
                text = self.digests[data] = digest.hexdigest()
            self.wire.put((data, text))
            return
        if not isinstance(digest, str):
            digest.update(data)
        if skip < len(data):
            self.wire.put((data[skip:], ""))


class _Frames:
    """The wire stage: each chunk sent as PART_DATA frames of CHUNK_BYTES (a large array's slices
    as they are, small arrays gathered into one frame: a frame per norm vector would be a
    syscall each); (name, digest) sends that file's PART_END."""

    def __init__(self, control: ControlChannel, progress: TransferProgress, bulk: Optional[BulkPath]):
        self.control, self.progress, self.bulk = control, progress, bulk
        self.pending = bytearray()
        self.sent = 0
        self.pause_after = pause_for_tests()

    def take(self, item: Tuple[Any, str]) -> None:
        data, digest = item
        if isinstance(data, str):
            self.flush()
            end = {"name": data, "digest": digest}
            self.control.send(FrameType.PART_END, json.dumps(end).encode("utf-8"))
            return
        self.add(data)

    def add(self, data: memoryview) -> None:
        while len(data):
            if not self.pending and len(data) >= CHUNK_BYTES:
                self._send(data[:CHUNK_BYTES])
            else:
                room = CHUNK_BYTES - len(self.pending)
                self.pending += data[:room]
                if len(self.pending) == CHUNK_BYTES:
                    self.flush()
                data = data[room:]
                continue
            data = data[CHUNK_BYTES:]

    def flush(self) -> None:
        if self.pending:
            self._send(memoryview(self.pending))
            self.pending = bytearray()

    def _send(self, piece: memoryview) -> None:
        if self.bulk is None:
            self.control.send(FrameType.PART_DATA, piece)
        else:
            self.control.send(FrameType.PART_DATA, CHUNK_LENGTH.pack(len(piece)))
            self.bulk.send(piece)
        self.sent += len(piece)
        self.progress.add(len(piece))
        if self.pause_after is not None and self.sent >= self.pause_after:
            log(f"{TEST_PAUSE_ENV}: test hook: this transfer stops after {self.sent} bytes; "
                "waiting to be killed")
            while True:
                time.sleep(3600)


def send_parts(group: Any, model_path: Path, share: SplitShare, fingerprint: str, receivers: List[int]) -> None:
    """The leader's side for each worker of `receivers` (started without --model), in rank order,
    over the RDMA bulk path where that worker's link is RDMA."""
    for rank in receivers:
        sender = PartSender(model_path, rank, group.size(), share, fingerprint)
        bulk = bulk_path(group, rank, CHUNK_BYTES)
        log(f"rank {rank} has no model: offering its part ({len(sender.plan.files)} part files, "
            f"{sender.plan.weight_bytes / 1e6:.1f} MB of weights, over "
            f"{'the RDMA bulk path' if bulk else 'TCP'})")
        sent = sender.send(group.link_to(rank).control, bulk)
        log(f"rank {rank}'s part: {sent / 1e6:.1f} MB sent" + ("" if sent else " (its cache held all of it)"))


__all__ = ["PartSender", "part_bytes", "send_parts"]
