"""Many sessions on both ranks, decoded together, the worker driven step by step by the leader.

Each rank holds a SessionTable: the sessions' KV caches (their half of the heads), the stored
prompt caches, and the decode batch (mlx-lm's BatchKVCache: rows left-padded, merged when
sessions join, filtered when they leave, exactly as mlx-lm's BatchGenerator does). The table
changes only through commands, and the leader applies every command it sends to its own table
in the same order, so the two tables stay identical and every forward pairs its gates with the
peer's. Commands (control frames):

  SESSION_CREATE  session id, stored cache id, FRESH | MOVE | COPY   a session's cache
  REWIND          session id, tokens to keep                          trim a reused cache
  SYNC            session id, tokens                                  prefill a chunk (batch of 1)
  EVAL_BATCH      step, then (session id, token) per row              one decode forward, all rows
  SESSION_DESTROY session id, cache id to store it under (0: drop)    leave the batch, free
  INVALIDATE      cache id                                            drop a stored cache
  HASH            step, hash of the last step's logits                 the worker answers its own
  STOP                                                                the worker returns

Rows of EVAL_BATCH: the sessions already in the batch, in row order, then the sessions that
join at this step. The worker checks that the rows it is told match its own batch, so a
divergence is a loud error at the first step it happens, never a silent wrong answer.
"""

from __future__ import annotations

import select
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .. import gate_ops
from .. import transport as tr
from ..link.wire import HASH_PAYLOAD as HASH
from ..link.wire import SERVE_BATCH_HEADER as BATCH_HEADER
from ..link.wire import SERVE_CREATE as CREATE
from ..link.wire import SERVE_DESTROY as DESTROY
from ..link.wire import SERVE_INVALIDATE as INVALIDATE
from ..link.wire import SERVE_MAX_BATCH_ROWS as MAX_BATCH_ROWS
from ..link.wire import SERVE_REWIND as REWIND
from ..link.wire import SYNC_HEADER
from ..errors import LockstepDivergence, TransportError
from .steps import _peer_error, fill_cache, logits_hash
from .prompt_cache import COPY, FRESH, MOVE

F = tr.FrameType

# The rows of an EVAL_BATCH as one numpy record array (the layout of _wire.SERVE_BATCH_ROW).
BATCH_ROW = np.dtype([("session", "<u8"), ("token", "<i4"), ("reserved", "<u4")])


def _unpack(fmt: struct.Struct, payload: bytes, ftype) -> tuple:
    if len(payload) != fmt.size:
        raise tr.FrameError(f"{ftype.name} payload is {len(payload)} bytes, expected {fmt.size}")
    return fmt.unpack(payload)


def pack_batch(step: int, rows: Sequence[Tuple[int, int]]) -> bytes:
    """An EVAL_BATCH payload: the step number, then (session, token) per row."""
    items = np.zeros(len(rows), dtype=BATCH_ROW)
    items["session"] = [s for s, _ in rows]
    items["token"] = [t for _, t in rows]
    return BATCH_HEADER.pack(step, len(rows), 0) + items.tobytes()


class SessionTable:
    """The sessions, stored caches and decode batch of one rank; see the module docstring."""

    def __init__(self, model):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.make_cache = lambda: make_prompt_cache(model)
        self.sessions: Dict[int, list] = {}  # prefilling, not yet in the batch
        self.stored: Dict[int, list] = {}
        self.rows: List[int] = []
        self.batch_cache: Optional[list] = None
        self.step_count = 0
        self.last_logits: Optional[mx.array] = None
        # Token ids index the embedding, which MLX does not bounds-check.
        self.vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)

    @property
    def busy(self) -> bool:
        """True while a generation is under way (the leader's next command is imminent)."""
        return bool(self.sessions or self.rows)

    # -- commands ------------------------------------------------------------
    def apply(self, ftype, payload: bytes) -> Optional[mx.array]:
        """Execute one command; EVAL_BATCH returns the rows' logits [rows, vocab]."""
        if ftype == F.SESSION_CREATE:
            self.create(*_unpack(CREATE, payload, ftype)[:3])
        elif ftype == F.REWIND:
            session, keep, _ = _unpack(REWIND, payload, ftype)
            self.rewind(session, keep)
        elif ftype == F.SYNC:
            if len(payload) < SYNC_HEADER.size or (len(payload) - SYNC_HEADER.size) % 4:
                raise tr.FrameError(f"SYNC payload of {len(payload)} bytes is malformed")
            session, count, _ = SYNC_HEADER.unpack_from(payload)
            tokens = np.frombuffer(payload, dtype="<i4", offset=SYNC_HEADER.size)
            if len(tokens) != count or count == 0:
                raise tr.FrameError(f"SYNC says {count} tokens but carries {len(tokens)}")
            self.prefill(session, tokens)
        elif ftype == F.EVAL_BATCH:
            if len(payload) < BATCH_HEADER.size:
                raise tr.FrameError(f"EVAL_BATCH payload of {len(payload)} bytes is malformed")
            step, count, _ = BATCH_HEADER.unpack_from(payload)
            items = np.frombuffer(payload, dtype=BATCH_ROW, offset=BATCH_HEADER.size) \
                if (len(payload) - BATCH_HEADER.size) % BATCH_ROW.itemsize == 0 else None
            if items is None or len(items) != count or not 0 < count <= MAX_BATCH_ROWS:
                raise tr.FrameError(f"EVAL_BATCH says {count} rows in a {len(payload)}-byte payload "
                                    f"(1 to {MAX_BATCH_ROWS} rows of {BATCH_ROW.itemsize} bytes)")
            if step != self.step_count + 1:
                raise tr.FrameError(f"EVAL_BATCH step {step} arrived after step {self.step_count}: "
                                    "the ranks are out of step")
            return self.step(items["session"].tolist(), items["token"])
        elif ftype == F.SESSION_DESTROY:
            self.destroy(*_unpack(DESTROY, payload, ftype))
        elif ftype == F.INVALIDATE:
            (cache_id,) = _unpack(INVALIDATE, payload, ftype)
            if self.stored.pop(cache_id, None) is None:
                raise tr.FrameError(f"INVALIDATE names stored cache {cache_id}, which does not exist")
        else:
            raise tr.FrameError(f"a serving rank cannot execute a {ftype.name} frame")
        return None

    def create(self, session: int, cache_id: int, mode: int) -> None:
        """A new session: a fresh cache, or stored cache `cache_id` moved or copied."""
        if session in self.sessions or session in self.rows:
            raise tr.FrameError(f"SESSION_CREATE for session {session}, which already exists")
        if mode == FRESH:
            self.sessions[session] = self.make_cache()
            return
        if cache_id not in self.stored:
            raise tr.FrameError(f"SESSION_CREATE reuses stored cache {cache_id}, which does not exist")
        if mode == MOVE:
            self.sessions[session] = self.stored.pop(cache_id)
        elif mode == COPY:
            import copy

            self.sessions[session] = copy.deepcopy(self.stored[cache_id])
        else:
            raise tr.FrameError(f"SESSION_CREATE mode {mode} is not FRESH, MOVE or COPY")

    def rewind(self, session: int, keep: int) -> None:
        """Trim a (reused) session cache to its first `keep` tokens."""
        from mlx_lm.models.cache import trim_prompt_cache

        cache = self._session(session)
        size = cache[0].size()
        if keep > size:
            raise tr.FrameError(f"REWIND session {session} to {keep} tokens, but it holds {size}")
        trim_prompt_cache(cache, size - keep)

    def prefill(self, session: int, tokens: np.ndarray) -> None:
        """Append tokens to a session that is not decoding yet (batch of one): the cache only,
        no vocabulary projection and no logits gather (fill_cache)."""
        self._check_tokens(tokens)
        fill_cache(self.model, tokens.tolist(), self._session(session))

    def step(self, sessions: List[int], tokens: np.ndarray) -> mx.array:
        """One decode forward over the batch's rows; sessions that are not in the batch yet
        join it (after the existing rows, in the order given)."""
        if len(set(sessions)) != len(sessions):
            raise tr.FrameError(f"EVAL_BATCH names a session twice: {sessions}")
        if sessions[: len(self.rows)] != self.rows:
            raise tr.FrameError(f"EVAL_BATCH rows {sessions} do not begin with this rank's batch "
                                f"{self.rows}: the ranks are out of step")
        joining = sessions[len(self.rows):]
        if joining:
            caches = []
            for s in joining:
                caches.append(self._session(s))
            for s in joining:
                del self.sessions[s]
            merged = [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]
            if self.batch_cache is None:
                self.batch_cache = merged
            else:
                for mine, new in zip(self.batch_cache, merged):
                    mine.extend(new)
            self.rows.extend(joining)
        self._check_tokens(tokens)
        self.step_count += 1
        logits = self.model(mx.array(tokens, dtype=mx.int32)[:, None], cache=self.batch_cache)
        logits = logits[:, -1, :]
        mx.eval(logits)
        self.last_logits = logits
        return logits

    def logits_hash(self) -> int:
        """Hash of the last decode step's logits: equal on both ranks while they are in step."""
        return logits_hash(self.last_logits) if self.last_logits is not None else 0

    def destroy(self, session: int, store_as: int) -> None:
        """End a session (leaving the batch if it is in it); keep its cache as `store_as`."""
        if session in self.rows:
            idx = self.rows.index(session)
            cache = [c.extract(idx) for c in self.batch_cache] if store_as else None
            keep = [i for i in range(len(self.rows)) if i != idx]
            del self.rows[idx]
            if keep:
                for c in self.batch_cache:
                    c.filter(keep)
            else:
                self.batch_cache = None
        elif session in self.sessions:
            cache = self.sessions.pop(session)
        else:
            raise tr.FrameError(f"SESSION_DESTROY for session {session}, which does not exist")
        if store_as:
            if store_as in self.stored:
                raise tr.FrameError(f"SESSION_DESTROY stores under cache id {store_as}, already taken")
            self.stored[store_as] = cache

    def _session(self, session: int) -> list:
        cache = self.sessions.get(session)
        if cache is None:
            raise tr.FrameError(f"session {session} does not exist or is already decoding")
        return cache

    def _check_tokens(self, tokens: np.ndarray) -> None:
        if self.vocab and len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab)][0])
            raise tr.FrameError(f"token id {bad} is outside the model's vocabulary [0, {self.vocab}): "
                                "the leader runs another model or the frame is corrupt")


# ============================================================================
# The two ranks' faces
# ============================================================================


class LeaderSessions:
    """The leader's side: every command is sent to the worker, then applied here, in that
    order, so the worker's forward starts as early as the leader's."""

    def __init__(self, group: gate_ops.Group, model):
        self.group = group
        self.control = group.pair.control
        self.table = SessionTable(model)

    def _command(self, ftype, payload: bytes) -> Optional[mx.array]:
        self.control.send(ftype, payload)
        try:
            return self.table.apply(ftype, payload)
        except TransportError as exc:
            reason = _peer_error(self.control)
            if reason:
                raise TransportError(f"{exc}; the worker reported: {reason}") from None
            raise

    def create(self, session: int, cache_id: int = 0, mode: int = FRESH) -> None:
        """SESSION_CREATE on both ranks."""
        self._command(F.SESSION_CREATE, CREATE.pack(session, cache_id, mode, 0))

    def rewind(self, session: int, keep: int) -> None:
        """REWIND on both ranks."""
        self._command(F.REWIND, REWIND.pack(session, keep, 0))

    def prefill(self, session: int, tokens: Sequence[int]) -> None:
        """SYNC (one prefill chunk) on both ranks."""
        self._command(F.SYNC, SYNC_HEADER.pack(session, len(tokens), 0)
                      + np.asarray(tokens, dtype="<i4").tobytes())

    def step(self, rows: Sequence[Tuple[int, int]]) -> mx.array:
        """Logits [rows, vocab] of one decode step over (session, input token) rows."""
        return self._command(F.EVAL_BATCH, pack_batch(self.table.step_count + 1, rows))

    def destroy(self, session: int, store_as: int = 0) -> None:
        """SESSION_DESTROY on both ranks."""
        self._command(F.SESSION_DESTROY, DESTROY.pack(session, store_as))

    def invalidate(self, cache_id: int) -> None:
        """INVALIDATE (drop a stored cache) on both ranks."""
        self._command(F.INVALIDATE, INVALIDATE.pack(cache_id))

    def check_hash(self) -> None:
        """Compare the last step's logits with the worker's (--debug-hash); LockstepDivergence
        when they differ."""
        step, mine = self.table.step_count, self.table.logits_hash()
        self.control.send(F.HASH, HASH.pack(0, step, mine))
        _, payload = self.control.recv(F.HASH)
        _, peer_step, theirs = _unpack(HASH, payload, F.HASH)
        if (peer_step, theirs) != (step, mine):
            raise LockstepDivergence(f"LOCKSTEP DIVERGENCE at decode step {step}: local {mine:016x}, "
                                     f"worker {theirs:016x} at its step {peer_step}")

    def peer_gone(self) -> Optional[str]:
        """Between commands: why the worker is gone (it sent ERROR or closed), or None."""
        sock = self.control.sock
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError) as exc:
            return f"the control socket failed: {exc}"
        if not readable:
            return None
        return _peer_error(self.control) or "the worker closed the connection"

    def stop(self) -> None:
        """Tell the worker to return (best effort: it may be gone)."""
        try:
            self.control.send(F.STOP)
        except TransportError:
            pass

    def abort(self, reason: str) -> None:
        """The leader gives up on the pair: tell the worker why (best effort) and close the
        connection, so the worker stops with that reason instead of waiting for commands."""
        self.control.send_error(f"the leader stopped serving: {reason}")
        self.group.close()


def serve_worker(group: gate_ops.Group, model) -> int:
    """The worker's loop under `ds4tp serve`: execute the leader's commands until STOP.
    Returns the number of decode steps run; raises on any failure."""
    control = group.pair.control
    table = SessionTable(model)
    while True:
        ftype, payload = _next_command(control, table.busy)
        if ftype == F.STOP:
            return table.step_count
        if ftype == F.HASH:
            _, step, theirs = _unpack(HASH, payload, ftype)
            mine = table.logits_hash()
            control.send(F.HASH, HASH.pack(0, table.step_count, mine))
            if (step, theirs) != (table.step_count, mine):
                raise LockstepDivergence(f"LOCKSTEP DIVERGENCE at decode step {step}: local "
                                         f"{mine:016x} at step {table.step_count}, leader {theirs:016x}")
            continue
        table.apply(ftype, payload)


def _next_command(control: tr.ControlChannel, busy: bool) -> tuple:
    """Idle between requests without a deadline, noticing a dead leader at once (EOF makes
    the socket readable); during a generation the leader's next command is one sampling step
    away, so wait at most the timeout (DS4_TP_TIMEOUT_SEC): never a hang. It is watched for
    a moment before the wait sleeps (ControlChannel.poll_readable)."""
    if busy:
        control.poll_readable()
        try:
            return control.recv()
        except tr.TransportTimeoutError as exc:
            raise tr.TransportTimeoutError(
                f"the leader sent no command for {control.timeout:g} s in the middle of a "
                f"generation (DS4_TP_TIMEOUT_SEC): it is stopped or unreachable ({exc})") from None
    while True:
        readable, _, _ = select.select([control.sock], [], [], 1.0)
        if readable:
            return control.recv()
