"""The leader's side of a part's transfer: to a worker started without --model, on that worker's
control connection once the share is agreed (TCP: the control channel's frames), the files of
its part offered (PART_OFFER), the ones it wants sent from the offset it asks (PART_DATA), each
closed by its digest (PART_END), until it wants none.

The part files' bytes are exactly what load_split keeps for that rank. The plan (split/part_plan.py)
knows, for each array the cut reads from the model's files as they are saved (every cut array
of an mlx-lm checkpoint, experts saved one by one included), which bytes of which file it is:
those are read from the files straight into the chunks that are hashed and sent
(checkpoint/tensor_runs.py), none of them through an MLX array, as a plain copy of the same
bytes would. The rest (the arrays every rank keeps whole, the rows of gpt-oss's fused
experts) is cut through MLX (split_model's cut_arrays), one array at a time, each dropped once
sent, so the leader never holds the worker's part. A file resumed from an offset is still read
from its start (its digest covers the whole file); only the bytes past the offset are sent. What
does not change from one transfer of the part to the next (its plan, the cut's traced layout,
each file's digest) is kept (split/part_memo.py): a second worker, a resume or a re-join is not
planned, traced or hashed again, and is offered the digests.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from ..base.log import log
from ..checkpoint.parts import SafetensorsParts
from ..checkpoint.parts_cache import new_digest, spread_as_arriving
from ..checkpoint.tensor_runs import RunsReader
from ..errors import FrameError
from ..link.control import ControlChannel
from ..link.wire import FrameType
from .apply import cut_arrays
from .derive import set_array
from .overlap import BufferPool, Overlap
from .part_bulk import CHUNK_LENGTH, CONTROL_PATH, RDMA_PATH, BulkPath
from .part_memo import keep_on_disk, part_memo
from .part_plan import PART_CONFIG, PartFile, PartPlan, RecordedReads, bytes_digest, plain_files
from .plans import saved_layout
from .share import SplitShare
from .transfer_progress import TransferProgress

CHUNK_BYTES = 4 << 20  # one PART_DATA frame (its bound in link/wire.py)
STAGE_DEPTH = 4  # chunks queued before each stage of the leader's side
# A worker checks its cached files' digests before it answers an offer, and a worker waits for
# the leader to finish the ranks before it: minutes on a large model.
PART_WAIT_S = 24 * 3600.0
MAX_ROUNDS = 3
# The leader sends several workers their parts at once (split/part_delivery.py), each on a
# thread of its own; MLX's graph and evaluation are not made for several threads at once, so
# the few arrays cut through MLX take turns (the bytes read from the files do not wait).
MLX_TURN = threading.Lock()
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
        pool = BufferPool(CHUNK_BYTES, 2 * STAGE_DEPTH + 3)  # queued and in hand at each stage, one filling
        frames = _Frames(control, progress, bulk, pool)
        # Three stages, each on its own thread: this one reads the files' runs (and cuts through
        # MLX what they cannot give) into chunks, the next hashes them (a file whose digest the
        # memo holds passes through), the last sends them (a few chunks queued between each).
        with Overlap(frames.take, depth=STAGE_DEPTH, name="ds4tp-part-send") as wire, \
                Overlap(_Hashing(wire, self.memo.digests, pool).take, depth=STAGE_DEPTH,
                        name="ds4tp-part-hash") as hashing, \
                RunsReader(CHUNK_BYTES, pool.take) as reader:
            pool.stages = (hashing, wire)
            for name, offset in wanted:
                if name in self.plain:
                    self._queue_file(hashing, name, reader.add_bytes(memoryview(self.plain[name])), reader, offset,
                                     self.plain_digests[name])
            parts = [(name, offset) for name, offset in wanted if name not in self.plain]
            if parts:
                self._queue_parts(hashing, reader, dict(parts))
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

    def _queue_file(self, hashing: Overlap, name: str, chunks: Iterator[memoryview], reader: RunsReader,
                    offset: int, known: Optional[str]) -> None:
        """A file's chunks to the hash stage (all into the digest, the bytes past `offset`
        sent), then its end (PART_END with the digest). known: the file's digest from before
        (the memo's, a plain file's): nothing is hashed."""
        # Fed chunks as they are read, as a worker's is as they arrive (checkpoint/parts_cache.py).
        digest, pos = (known if known else new_digest(spread_as_arriving())), 0
        for chunk in itertools.chain(chunks, reader.flush()):
            hashing.put((digest, chunk, min(max(offset - pos, 0), len(chunk))))
            pos += len(chunk)
        hashing.put((digest, name, 0))

    def _queue_parts(self, hashing: Overlap, reader: RunsReader, wanted: Dict[str, int]) -> None:
        """The wanted part files, in the plan's order: each array the files hold as it is
        saved read from them (the plan's sources), the rest cut through MLX one at a time."""
        last = max(i for i, f in enumerate(self.plan.files) if f.name in wanted)
        files = self.plan.files[: last + 1]
        through_mlx = any(t.key not in self.plan.sources for f in files if f.name in wanted for t in f.tensors)
        model, arrays = None, None
        if through_mlx:
            with MLX_TURN:
                model, arrays = self._cut_through_mlx()
        try:
            for file in files:
                chunks = self._file_chunks(reader, model, file, arrays)
                if file.name in wanted:
                    self._queue_file(hashing, file.name, chunks, reader, wanted[file.name],
                                     self.memo.digests.get(file.name))
                elif arrays is not None:
                    for _ in self._array_bytes(file, model, arrays):  # still in order before the next file's
                        pass
        finally:
            if arrays is not None:
                with MLX_TURN:
                    arrays.close()

    def _cut_through_mlx(self) -> Tuple[Any, Iterator[Tuple[str, mx.array]]]:
        """(model, its arrays cut one at a time): the model built lazily and cut (cut_arrays,
        with the memo's traced layout); an array the plan sends from the files is not read."""
        from mlx_lm.utils import load_model

        model, _ = load_model(self.model_path, lazy=True)
        reader = SafetensorsParts(self.model_path, self.rank, self.size, **saved_layout(type(model).__module__))
        read_part = _ReadsBesides(reader, {key for key, _ in self.plan.sources.values()})
        return model, cut_arrays(model, self.memo.group, split=self.share, read_part=read_part,
                                 layout=self.memo.layout)

    def _file_chunks(self, reader: RunsReader, model: Any, file: PartFile,
                     arrays: Optional[Iterator[Tuple[str, mx.array]]]) -> Iterator[memoryview]:
        yield from reader.add_bytes(memoryview(file.header))
        cut = self._array_bytes(file, model, arrays) if arrays is not None else None
        for tensor in file.tensors:
            data = next(cut) if cut is not None else None
            source = self.plan.sources.get(tensor.key)
            if source is not None:
                for runs in source[1]:
                    yield from reader.add(runs)
            else:
                if data is None:
                    raise ValueError(f"rank {self.rank}'s part: {tensor.key} has neither byte runs nor an "
                                     "array through MLX; the plan and the send disagree")
                yield from reader.add_bytes(data)
            del data

    def _array_bytes(self, file: PartFile, model: Any,
                     arrays: Iterator[Tuple[str, mx.array]]) -> Iterator[Optional[memoryview]]:
        """The bytes of `file`'s tensors cut through MLX (None for one sent from its byte runs:
        a placeholder), each array checked against the plan and dropped from the model once
        handed on (the leader never holds the worker's part)."""
        for tensor in file.tensors:
            with MLX_TURN:
                key, array = next(arrays)
                if key != tensor.key or tuple(array.shape) != tensor.shape or array.nbytes != tensor.nbytes:
                    raise ValueError(f"rank {self.rank}'s part: {key} {tuple(array.shape)} came where the plan "
                                     f"has {tensor.key} {tensor.shape}; the cut and its plan disagree")
                data = None if tensor.key in self.plan.sources else part_bytes(array)
            yield data
            del data
            with MLX_TURN:
                del array
                set_array(model, key, mx.zeros((0,), mx.uint8))


class _ReadsBesides:
    """read_part for the cut through MLX: a key the plan sends from the files answered with a
    placeholder (nothing read: its bytes come from its runs), every other read for real."""

    def __init__(self, reader: SafetensorsParts, skipped: set):
        self.reader, self.skipped = reader, skipped
        self.placeholders = RecordedReads(reader)

    def __call__(self, key: str, whole: mx.array, axis: int, runs=None):  # noqa: ANN001 - ReadPart's
        return (self.placeholders if key in self.skipped else self.reader)(key, whole, axis, runs=runs)


class _Hashing:
    """The hash stage: each (digest, chunk, skip) into its file's digest, the bytes past `skip`
    handed to the wire stage (a chunk with none handed back to the pool); (digest, name, 0),
    the file's end, handed on with the digest, which `digests` (the memo's) keeps for the next
    transfer. A digest known before (its text) takes no bytes."""

    def __init__(self, wire: Overlap, digests: Dict[str, str], pool: BufferPool):
        self.wire, self.digests, self.pool = wire, digests, pool

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
            self.wire.put((data[skip:], data))
        else:
            self.pool.give_back(data)


class _Frames:
    """The wire stage: each chunk (CHUNK_BYTES, a file's last one shorter) sent as one PART_DATA
    frame and its buffer handed back; (name, digest) sends that file's PART_END."""

    def __init__(self, control: ControlChannel, progress: TransferProgress, bulk: Optional[BulkPath],
                 pool: BufferPool):
        self.control, self.progress, self.bulk, self.pool = control, progress, bulk, pool
        self.sent = 0
        self.pause_after = pause_for_tests()

    def take(self, item: Tuple[Any, Any]) -> None:
        data, chunk = item
        if isinstance(data, str):
            end = {"name": data, "digest": chunk}
            self.control.send(FrameType.PART_END, json.dumps(end).encode("utf-8"))
            return
        self._send(data)
        self.pool.give_back(chunk)

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


__all__ = ["CHUNK_BYTES", "MLX_TURN", "PartSender", "part_bytes"]
