"""The commands that run the model: PREFILL_BATCH (prompt chunks), EVAL_BATCH (one decode
step), VERIFY_BATCH (a decode step whose rows carry drafts) and COMMIT_BATCH (the positions of
each verified row its session keeps)."""

from __future__ import annotations

import struct
from typing import List, Sequence, Tuple

import numpy as np

from ....errors import FrameError
from .base import Command, F, command, shorter_than_header
from .limits import MAX_BATCH_ROWS, MAX_PREFILL_ROWS, MAX_TOKENS_PER_FRAME, MAX_VERIFY_WIDTH

# An EVAL_BATCH row's input token that says: the token this rank sampled for the session at
# the last step (lockstep.sampling.row_sampling), which the leader has not read yet.
EVAL_PENDING = -1


def pad_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    """The rows right-padded with token 0 to the longest: [len(rows), width] int32."""
    width = max(len(r) for r in rows)
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@command
class PrefillBatch(Command):
    """One prefill chunk of each (session, tokens) row, in one padded forward."""

    frame = F.PREFILL_BATCH
    bound = 16 + 16 * MAX_PREFILL_ROWS + 4 * MAX_TOKENS_PER_FRAME  # header, rows, tokens
    header = struct.Struct("<IIQ")  # rows, reserved, reserved; then the rows
    row = np.dtype([("session", "<u8"), ("count", "<u4"), ("reserved", "<u4")])  # tokens follow all rows

    @classmethod
    def pack(cls, rows: Sequence[Tuple[int, Sequence[int]]]) -> bytes:
        items = np.zeros(len(rows), dtype=cls.row)
        items["session"] = [s for s, _ in rows]
        items["count"] = [len(t) for _, t in rows]
        tokens = b"".join(np.asarray(t, dtype="<i4").tobytes() for _, t in rows)
        return cls.header.pack(len(rows), 0, 0) + items.tobytes() + tokens

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> Tuple[List[int], List[np.ndarray]]:
        """The sessions and their token chunks (views of the payload)."""
        shorter_than_header(cls.frame, payload, cls.header)
        count, _, _ = cls.header.unpack_from(payload)
        if not 0 < count <= MAX_PREFILL_ROWS:
            raise FrameError(f"PREFILL_BATCH says {count} rows (1 to {MAX_PREFILL_ROWS})")
        end = cls.header.size + count * cls.row.itemsize
        if len(payload) < end:
            raise FrameError(f"PREFILL_BATCH says {count} rows, but its {len(payload)} bytes cannot "
                                f"hold their {count} x {cls.row.itemsize}-byte entries")
        items = np.frombuffer(payload, dtype=cls.row, count=count, offset=cls.header.size)
        counts = items["count"].astype(np.int64)
        sessions = items["session"].tolist()
        if counts.min() == 0:
            row = int(np.argmin(counts))
            raise FrameError(f"PREFILL_BATCH row {row} (session {sessions[row]}) has 0 tokens "
                                "(a prompt needs at least one token per row)")
        total = int(counts.sum())
        if total > MAX_TOKENS_PER_FRAME or len(payload) - end != 4 * total:
            raise FrameError(f"PREFILL_BATCH rows say {total} tokens (at most {MAX_TOKENS_PER_FRAME}), "
                                f"but {len(payload) - end} bytes follow them ({4 * total} expected)")
        if len(set(sessions)) != count:
            raise FrameError(f"PREFILL_BATCH names a session twice: {sessions}")
        tokens = np.frombuffer(payload, dtype="<i4", offset=end)
        return sessions, np.split(tokens, np.cumsum(counts)[:-1])

    @classmethod
    def apply(cls, table, sessions: List[int], chunks: List[np.ndarray]) -> None:
        table.caches.prefill_batch(sessions, chunks)


@command
class EvalBatch(Command):
    """One decode forward over (session, input token or EVAL_PENDING) rows: the sessions of
    the batch in row order, then those that join it at this step."""

    frame = F.EVAL_BATCH
    bound = 64 * 1024  # room above its header and MAX_BATCH_ROWS rows (checked below)
    header = struct.Struct("<QII")  # decode step, rows, reserved; then the rows
    row = np.dtype([("session", "<u8"), ("token", "<i4"), ("reserved", "<u4")])

    @classmethod
    def pack(cls, step: int, rows: Sequence[Tuple[int, int]]) -> bytes:
        items = np.zeros(len(rows), dtype=cls.row)
        items["session"] = [s for s, _ in rows]
        items["token"] = [t for _, t in rows]
        return cls.header.pack(step, len(rows), 0) + items.tobytes()

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> Tuple[int, List[int], np.ndarray]:
        """(step, sessions, input tokens)."""
        if len(payload) < cls.header.size:
            raise FrameError(f"EVAL_BATCH payload of {len(payload)} bytes is malformed")
        step, count, _ = cls.header.unpack_from(payload)
        items = np.frombuffer(payload, dtype=cls.row, offset=cls.header.size) \
            if (len(payload) - cls.header.size) % cls.row.itemsize == 0 else None
        if items is None or len(items) != count or not 0 < count <= MAX_BATCH_ROWS:
            raise FrameError(f"EVAL_BATCH says {count} rows in a {len(payload)}-byte payload "
                                f"(1 to {MAX_BATCH_ROWS} rows of {cls.row.itemsize} bytes)")
        return step, items["session"].tolist(), items["token"]

    @classmethod
    def apply(cls, table, step: int, sessions: List[int], tokens: np.ndarray):
        table.batch.check_step("EVAL_BATCH", step)
        return table.step(sessions, tokens)


@command
class VerifyBatch(Command):
    """EVAL_BATCH whose rows carry an input token and drafts, right-padded to the longest
    (lockstep.batch_verify); COMMIT_BATCH follows."""

    frame = F.VERIFY_BATCH
    bound = 16 + 16 * MAX_BATCH_ROWS + 4 * MAX_BATCH_ROWS * MAX_VERIFY_WIDTH  # header, rows, tokens
    header = struct.Struct("<QII")  # decode step, rows, width; then the rows, then the tokens
    row = struct.Struct("<QII")  # session id, tokens in the row, reserved

    @classmethod
    def pack(cls, step: int, rows: Sequence[Tuple[int, Sequence[int]]]) -> bytes:
        head = cls.header.pack(step, len(rows), max(len(t) for _, t in rows))
        table = b"".join(cls.row.pack(s, len(t), 0) for s, t in rows)
        return head + table + pad_rows([np.asarray(t, dtype=np.int32) for _, t in rows]).astype("<i4").tobytes()

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> Tuple[int, List[int], List[np.ndarray]]:
        """(step, sessions, each row's tokens)."""
        if len(payload) < cls.header.size:
            raise FrameError(f"VERIFY_BATCH payload of {len(payload)} bytes is shorter than its header")
        step, count, width = cls.header.unpack_from(payload)
        if not 0 < count <= MAX_BATCH_ROWS or not 0 < width <= MAX_VERIFY_WIDTH:
            raise FrameError(f"VERIFY_BATCH says {count} rows of width {width} (1 to {MAX_BATCH_ROWS} "
                                f"rows, width 1 to {MAX_VERIFY_WIDTH})")
        table_end = cls.header.size + count * cls.row.size
        if len(payload) != table_end + 4 * count * width:
            raise FrameError(f"VERIFY_BATCH of {count} rows of width {width} is {len(payload)} bytes, "
                                f"expected {table_end + 4 * count * width}")
        sessions, lengths = [], []
        for i in range(count):
            session, n, _ = cls.row.unpack_from(payload, cls.header.size + i * cls.row.size)
            if not 0 < n <= width:
                raise FrameError(f"VERIFY_BATCH row {i} says {n} tokens in rows of width {width}")
            sessions.append(session)
            lengths.append(n)
        if max(lengths) != width:
            raise FrameError(f"VERIFY_BATCH width {width} but its longest row has {max(lengths)} tokens")
        tokens = np.frombuffer(payload, dtype="<i4", offset=table_end).reshape(count, width)
        return step, sessions, [tokens[i, :n] for i, n in enumerate(lengths)]

    @classmethod
    def apply(cls, table, step: int, sessions: List[int], rows: List[np.ndarray]):
        table.batch.check_step("VERIFY_BATCH", step)
        table.batch.join("VERIFY_BATCH", sessions, table.caches.take)
        return table.batch.verify(rows)


@command
class CommitBatch(Command):
    """The positions each row of the last VERIFY_BATCH keeps: the rejected drafts leave."""

    frame = F.COMMIT_BATCH
    bound = 16 + 4 * MAX_BATCH_ROWS  # header, one uint32 a row
    header = struct.Struct("<QII")  # decode step, rows, reserved; then uint32 per row

    @classmethod
    def pack(cls, step: int, keep: Sequence[int]) -> bytes:
        return cls.header.pack(step, len(keep), 0) + np.asarray(keep, dtype="<u4").tobytes()

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> Tuple[int, List[int]]:
        """(step, positions kept per row)."""
        if len(payload) < cls.header.size:
            raise FrameError(f"COMMIT_BATCH payload of {len(payload)} bytes is shorter than its header")
        step, count, _ = cls.header.unpack_from(payload)
        if not 0 < count <= MAX_BATCH_ROWS or len(payload) != cls.header.size + 4 * count:
            raise FrameError(f"COMMIT_BATCH says {count} rows in {len(payload)} bytes (1 to "
                                f"{MAX_BATCH_ROWS} rows of 4 bytes)")
        return step, np.frombuffer(payload, dtype="<u4", offset=cls.header.size).tolist()

    @classmethod
    def apply(cls, table, step: int, keep: List[int]) -> None:
        table.batch.commit(step, keep)


# A layout that outgrew its bound fails here, at import.
if EvalBatch.header.size + EvalBatch.row.itemsize * MAX_BATCH_ROWS > EvalBatch.bound:
    raise ImportError("EVAL_BATCH's layout outgrew its bound")
