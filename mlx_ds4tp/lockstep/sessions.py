"""The lockstep protocol: many sessions on both ranks, decoded together, the worker driven
step by step by the leader. `ds4tp serve` runs many sessions on it, `ds4tp run` one
(lockstep.generate.pair_generate).

Each rank holds a SessionTable (lockstep.table). The table changes only through commands,
and the leader applies every command it sends to its own table in the same order, so the two
tables stay identical and every forward pairs its gates with the peer's. The commands (control
frames; each one's layout, packing, unpacking and application is its class in lockstep.commands):

  SESSION_CREATE  a session's cache: a fresh one (its KV quantization), or a stored one moved or copied
  REWIND          trim a reused cache to the tokens it keeps
  PREFILL_BATCH   one prefill chunk of each row, one padded forward
  SAMPLER         both ranks sample the session's rows alike from now on (an EVAL_BATCH row's
                  EVAL_PENDING input: this rank's own sample)
  EVAL_BATCH      one decode forward, all rows
  VERIFY_BATCH    EVAL_BATCH with drafts, padded
  COMMIT_BATCH    the positions each verified row keeps: the rejected drafts leave
  SESSION_DESTROY leave the batch and free, or store the cache under an id
  INVALIDATE      drop a stored cache
  DISK_SAVE       write this rank's half of a stored cache to its --prompt-cache-dir
  DISK_LOAD       read this rank's half back; the worker answers whether it could
  KV_ROOM         the worker answers how many KV cache tokens its machine holds (lockstep.memory)
  HASH            the worker answers its own hash of the last step's logits or of a session's
                  sampled tokens
  STOP            the worker returns

Rows of EVAL_BATCH: the sessions already in the batch, in row order, then the sessions that
join at this step. The worker checks that the rows it is told match its own batch, so a
divergence is a loud error at the first step it happens, never a silent wrong answer.
A worker that fails sends the leader an ERROR frame with the reason before its sockets
close; the leader's failing command reports it (LeaderSessions._command).
"""

from __future__ import annotations

import dataclasses
import select
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .. import gate_ops, transport as tr
from ..errors import LockstepDivergence, TransportError
from .commands import (
    COMMANDS,
    CommitBatch,
    Create,
    Destroy,
    DiskLoad,
    DiskSave,
    EvalBatch,
    Hash,
    Invalidate,
    KvRoom,
    PrefillBatch,
    Rewind,
    Sampler,
    VerifyBatch,
    check_in_step,
)
from .disk_cache import DiskCache, tokens_digest
from .grammar import Grammars
from .prompt_cache import FRESH
from .table import SessionTable, release_memory

F = tr.FrameType


def drain_failed_work() -> None:
    """Wait out the steps a failed pair left queued (a pipelined step is sent before the last
    one is read): on the closed group their gates fail at once, and the error they raise is
    theirs, here, not the next pair's first evaluation's."""
    try:
        mx.synchronize()
    except Exception:  # noqa: BLE001 - the old pair's failure, already reported
        pass


def _peer_error(control: tr.ControlChannel) -> Optional[str]:
    """The worker's ERROR text if one arrives within half a second (its own explanation of a
    failure that reached us as 'peer closed'), else None."""
    try:
        readable, _, _ = select.select([control.sock], [], [], 0.5)
        if not readable:
            return None
        _, payload = control.recv(F.ERROR, timeout=0.5)
        return payload.decode("utf-8", "replace")
    except (TransportError, OSError, ValueError):
        return None


# ============================================================================
# The leader
# ============================================================================


@dataclasses.dataclass
class SampledStep:
    """What one sampled decode step drew on the leader, row by row: the tokens (lazy, read
    while the next step runs), why a row's sampler failed (its token is then 0), and the
    log-probabilities each row's token was drawn from (None unless its sampler keeps them)."""

    tokens: mx.array  # [rows] int32
    errors: Dict[int, str]
    logprobs: List[Optional[mx.array]]


class LeaderSessions:
    """The leader's side: every command is sent to the worker, then applied here, in that
    order, so the worker's forward starts as early as the leader's."""

    def __init__(self, group: gate_ops.Group, model, grammars: Optional[Grammars] = None,
                 disk: Optional[DiskCache] = None):
        self.group = group
        self.control = group.pair.control
        self.table = SessionTable(model, grammars, disk)

    # -- what the leader's own table says (the worker's is the same) ------------------
    @property
    def model(self):
        return self.table.model

    @property
    def vocab(self) -> int:
        return self.table.vocab

    @property
    def grammars(self) -> Optional[Grammars]:
        return self.table.grammars

    @property
    def disk(self) -> Optional[DiskCache]:
        """This rank's --prompt-cache-dir, or None."""
        return self.table.caches.disk

    @property
    def step_count(self) -> int:
        """Decode steps run (EVAL_BATCH and VERIFY_BATCH)."""
        return self.table.batch.step_count

    def counts(self) -> Tuple[int, int]:
        """(sessions, stored prompt caches) in the table."""
        table = self.table
        return len(table.caches.sessions) + len(table.batch.rows), len(table.caches.stored)

    def stored_bytes(self, cache_id: int) -> int:
        """Bytes a stored cache's arrays take on this rank."""
        return self.table.caches.stored_bytes(cache_id)

    def caches_trim(self) -> bool:
        """Whether this model's session caches can be cut back to any length (a stored prefix
        then serves any prompt that shares part of it)."""
        from .compute import trims_at_any_length

        return trims_at_any_length(self.table.caches.make_cache())

    def row_sampler(self, session: int):
        """The sampler SAMPLER gave a session on this rank (lockstep.row_sampling.RowSampler)."""
        return self.table.batch.samplers[session]

    def row_grammar(self, grammar: str):
        """The matcher of a grammar on this rank (SessionTable.row_grammar)."""
        return self.table.row_grammar(grammar)

    def _command(self, ftype, payload: bytes) -> Optional[mx.array]:
        """Send, then apply; when the gates fail, prefer the worker's own explanation (an
        ERROR frame) over our 'peer closed'."""
        self.control.send(ftype, payload)
        return self._explained(lambda: self.table.apply(ftype, payload))

    def _send(self, command, *fields) -> Optional[mx.array]:
        """A command (lockstep.commands) on both ranks."""
        return self._command(command.frame, command.pack(*fields))

    def read(self, tokens: mx.array) -> List[int]:
        """The values of tokens this rank sampled, once their step has run (a pipelined step's
        gates fail here, in MLX's evaluation): explained as _command explains a failure."""
        return self._explained(tokens.tolist)

    def _explained(self, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except LockstepDivergence:
            raise
        except RuntimeError as exc:  # TransportError, or a gate's failure out of MLX's evaluation
            reason = _peer_error(self.control)
            if reason:
                raise TransportError(f"{exc}; the worker reported: {reason}") from None
            raise

    def create(self, session: int, cache_id: int = 0, mode: int = FRESH, kv: int = 0) -> None:
        """SESSION_CREATE on both ranks; kv: a fresh cache's quantization (session_caches.kv_code)."""
        self._send(Create, session, cache_id, mode, kv)

    def sampler(self, session: int, options, prompt: Sequence[int], seed: int) -> None:
        """SAMPLER on both ranks: the session's rows are sampled alike on both from now on, and
        its EVAL_BATCH rows may take this rank's own sample (lockstep.row_sampling)."""
        self._send(Sampler, session, options, prompt, seed)

    def rewind(self, session: int, keep: int) -> None:
        """REWIND on both ranks."""
        self._send(Rewind, session, keep, 0)

    def prefill_batch(self, rows: Sequence[Tuple[int, Sequence[int]]]) -> None:
        """PREFILL_BATCH on both ranks: one prefill chunk of each (session, tokens) row."""
        self._send(PrefillBatch, rows)

    def step(self, rows: Sequence[Tuple[int, int]]) -> mx.array:
        """Logits [rows, vocab] of one decode step over (session, input token) rows."""
        return self._send(EvalBatch, self.table.batch.step_count + 1, rows)

    def sampled_step(self, rows: Sequence[Tuple[int, int]]) -> SampledStep:
        """One decode step over (session, input token or EVAL_PENDING) rows whose sessions all
        have samplers (SAMPLER): queued, not waited for; what this rank drew for each row."""
        self.step(rows)
        batch, sids = self.table.batch, [sid for sid, _ in rows]
        return SampledStep(batch.drawn,
                           {i: batch.row_errors.pop(sid) for i, sid in enumerate(sids) if sid in batch.row_errors},
                           [batch.samplers[sid].last_logprobs for sid in sids])

    def verify_batch(self, rows: Sequence[Tuple[int, Sequence[int]]]) -> mx.array:
        """Logits [rows, width, vocab] of one decode step whose rows are (session, its input token
        and drafts); COMMIT_BATCH (commit_batch) must follow."""
        return self._send(VerifyBatch, self.table.batch.step_count + 1, rows)

    def commit_batch(self, keep: Sequence[int]) -> None:
        """COMMIT_BATCH on both ranks: the positions each row of the last verify keeps."""
        self._send(CommitBatch, self.table.batch.step_count, keep)

    def destroy(self, session: int, store_as: int = 0) -> None:
        """SESSION_DESTROY on both ranks."""
        self._send(Destroy, session, store_as)

    def invalidate(self, cache_id: int) -> None:
        """INVALIDATE (drop a stored cache) on both ranks."""
        self._send(Invalidate, cache_id)

    def disk_save(self, cache_id: int, tokens: Sequence[int], drop: bool) -> None:
        """DISK_SAVE on both ranks: each writes its half of stored cache `cache_id` (a rank that
        cannot just logs it: the other's file alone is never used, DISK_LOAD needs both)."""
        self._send(DiskSave, cache_id, tokens, drop)

    def disk_load(self, cache_id: int, tokens: Sequence[int]) -> bool:
        """DISK_LOAD: both ranks read their half of the cache of `tokens` as stored cache
        `cache_id`, the worker first (it answers), the leader meanwhile. True when both did;
        otherwise neither keeps it (the worker told to drop its half) and both recompute."""
        digest = tokens_digest(tokens)
        self.control.send(F.DISK_LOAD, DiskLoad.pack(cache_id, len(tokens), 0, digest))
        mine = self._explained(lambda: self.table.caches.load(cache_id, digest, len(tokens)))
        _, payload = self._explained(lambda: self.control.recv(F.DISK_LOAD))
        peer_id, _, theirs, _ = DiskLoad.unpack(payload)
        if peer_id != cache_id:
            raise LockstepDivergence(f"the worker answered DISK_LOAD of cache {peer_id}; the leader "
                                     f"asked for {cache_id}")
        if mine and not theirs:
            self.table.caches.stored.pop(cache_id)
        elif theirs and not mine:
            # The one command the leader does not apply to itself: the worker drops the half it
            # loaded when the leader's own half failed, which the leader's table never held.
            self.control.send(F.INVALIDATE, Invalidate.pack(cache_id))
        return bool(mine and theirs)

    def worker_kv_room(self, kv_bits: int, kv_group_size: int) -> Optional[int]:
        """KV_ROOM: the KV cache tokens the worker's machine holds beside its part of the
        weights, with caches of `kv_bits` (0: float); None when it could not read its memory."""
        self.control.send(F.KV_ROOM, KvRoom.pack(kv_bits, kv_group_size, 0, 0))
        _, payload = self._explained(lambda: self.control.recv(F.KV_ROOM))
        _, _, measured, tokens = KvRoom.unpack(payload)
        return tokens if measured else None

    def check_hash(self, session: int = 0) -> None:
        """Compare a hash with the worker's: of the last step's logits (session 0: --debug-hash),
        or of the tokens each rank sampled for `session` (a generation's end); LockstepDivergence
        when they differ (the worker stops with it too)."""
        self._swap_hash(session, None)

    def wait_ready(self, poll_sec: float = 1.0) -> None:
        """Block until the worker runs its command loop: it joins first and loads its weights
        after, which may take minutes, so the wait has no deadline while its connection stays
        open (one HASH round trip); TransportError when it closes or reports a failure."""
        self._swap_hash(0, poll_sec)

    def _swap_hash(self, session: int, poll_sec: Optional[float]) -> None:
        step, (mine, what) = self.table.batch.step_count, self.table.batch.hash_of(session)
        self.control.send(F.HASH, Hash.pack(session, step, mine))
        while poll_sec is not None and not select.select([self.control.sock], [], [], poll_sec)[0]:
            pass
        _, payload = self.control.recv(F.HASH)
        _, peer_step, theirs = Hash.unpack(payload)
        check_in_step(step, mine, peer_step, theirs, "worker", what)

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

    def stop(self) -> bool:
        """Tell the worker to return (best effort: it may be gone); whether STOP was sent."""
        try:
            self.control.send(F.STOP)
        except (TransportError, OSError):
            return False
        return True

    def abort(self, reason: str) -> None:
        """The leader gives up on the pair: tell the worker why (best effort) and close the
        connection, so the worker stops with that reason instead of waiting for commands."""
        self.control.send_error(f"the leader stopped serving: {reason}")
        self.group.close()


# ============================================================================
# The worker
# ============================================================================


def serve_worker(group: gate_ops.Group, model, grammars: Optional[Grammars] = None, *,
                 tell_leader: bool = True, disk: Optional[DiskCache] = None) -> SessionTable:
    """The worker's one command loop: execute the leader's commands until STOP; returns the
    table (its batch.step_count: decode steps run; ended: sessions served). grammars: what
    constrained sessions are masked with (the leader's SAMPLER carries their grammar's text;
    None refuses them). Raises on any failure, after telling the leader why (an ERROR frame,
    so its error names the cause, not just 'peer closed') unless tell_leader is False. disk:
    this rank's --prompt-cache-dir."""
    control = group.pair.control
    table = SessionTable(model, grammars, disk)
    try:
        while True:
            ftype, payload = _next_command(control, table.busy)
            if ftype == F.STOP:
                return table
            command = COMMANDS.get(ftype)
            if command is not None and command.answers:  # a query: HASH, DISK_LOAD, KV_ROOM
                fields = command.unpack(payload, table.vocab)
                reply = command.answer(table, *fields)
                control.send(ftype, reply)
                command.check(reply, *fields)
                continue
            table.apply(ftype, payload)
    except Exception as exc:
        if tell_leader:
            control.send_error(f"{type(exc).__name__}: {exc}")
        raise


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
    released = False
    while True:
        readable, _, _ = select.select([control.sock], [], [], 1.0)
        if readable:
            return control.recv()
        if not released:  # a second without a command: the pair is idle
            release_memory()
            released = True
