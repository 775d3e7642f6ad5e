"""The lockstep protocol: many sessions on both ranks, decoded together, the worker driven
step by step by the leader. `ds4tp serve` runs many sessions on it, `ds4tp run` one
(lockstep.generate.pair_generate).

Each rank holds a SessionTable (lockstep.table). The table changes only through commands,
and the leader applies every command it sends to its own table in the same order, so the two
tables stay identical and every forward pairs its gates with the peer's. The commands (control
frames; their payloads are link.wire's table):

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
from ..base.log import log
from ..errors import LockstepDivergence, TransportError
from ..link.wire import DISK_LOAD_PAYLOAD as DISK_LOAD, HASH_PAYLOAD as HASH, KV_ROOM_PAYLOAD as KV_ROOM
from .batch_verify import pack_commit, pack_verify_batch
from .disk_cache import DiskCache, tokens_digest
from .frames import pack_batch, pack_disk_save, pack_prefill_batch, unpack
from .grammar import Grammars
from .prompt_cache import FRESH
from .row_sampling import pack_sampler
from .session_caches import KV_BITS, KV_GROUP_SIZES
from .table import CREATE, DESTROY, INVALIDATE, REWIND, SessionTable, release_memory

F = tr.FrameType


def check_in_step(step: int, mine: int, peer_step: int, theirs: int, peer: str, what: str) -> None:
    """Both ranks' decode step and hash (of `what`) must agree: LockstepDivergence otherwise."""
    if (peer_step, theirs) != (step, mine):
        raise LockstepDivergence(f"LOCKSTEP DIVERGENCE at seq {step}: the {what} differ: local {mine:016x}, "
                                 f"{peer} {theirs:016x} at its seq {peer_step} (seq: the decode step)")


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

    def _command(self, ftype, payload: bytes) -> Optional[mx.array]:
        """Send, then apply; when the gates fail, prefer the worker's own explanation (an
        ERROR frame) over our 'peer closed'."""
        self.control.send(ftype, payload)
        return self._explained(lambda: self.table.apply(ftype, payload))

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
        self._command(F.SESSION_CREATE, CREATE.pack(session, cache_id, mode, kv))

    def sampler(self, session: int, options, prompt: Sequence[int], seed: int) -> None:
        """SAMPLER on both ranks: the session's rows are sampled alike on both from now on, and
        its EVAL_BATCH rows may take this rank's own sample (lockstep.row_sampling)."""
        self._command(F.SAMPLER, pack_sampler(session, options, prompt, seed))

    def rewind(self, session: int, keep: int) -> None:
        """REWIND on both ranks."""
        self._command(F.REWIND, REWIND.pack(session, keep, 0))

    def prefill_batch(self, rows: Sequence[Tuple[int, Sequence[int]]]) -> None:
        """PREFILL_BATCH on both ranks: one prefill chunk of each (session, tokens) row."""
        self._command(F.PREFILL_BATCH, pack_prefill_batch(rows))

    def step(self, rows: Sequence[Tuple[int, int]]) -> mx.array:
        """Logits [rows, vocab] of one decode step over (session, input token) rows."""
        return self._command(F.EVAL_BATCH, pack_batch(self.table.batch.step_count + 1, rows))

    def sampled_step(self, rows: Sequence[Tuple[int, int]]) -> SampledStep:
        """One decode step over (session, input token or EVAL_PENDING) rows whose sessions all
        have samplers (SAMPLER): queued, not waited for; what this rank drew for each row."""
        self.step(rows)
        batch, sids = self.table.batch, [sid for sid, _ in rows]
        drawn = [batch.pending[sid] for sid in sids]
        return SampledStep(drawn[0] if len(drawn) == 1 else mx.concatenate(drawn),
                           {i: batch.row_errors.pop(sid) for i, sid in enumerate(sids) if sid in batch.row_errors},
                           [batch.samplers[sid].last_logprobs for sid in sids])

    def verify_batch(self, rows: Sequence[Tuple[int, Sequence[int]]]) -> mx.array:
        """Logits [rows, width, vocab] of one decode step whose rows are (session, its input token
        and drafts); COMMIT_BATCH (commit_batch) must follow."""
        return self._command(F.VERIFY_BATCH, pack_verify_batch(self.table.batch.step_count + 1, rows))

    def commit_batch(self, keep: Sequence[int]) -> None:
        """COMMIT_BATCH on both ranks: the positions each row of the last verify keeps."""
        self._command(F.COMMIT_BATCH, pack_commit(self.table.batch.step_count, keep))

    def destroy(self, session: int, store_as: int = 0) -> None:
        """SESSION_DESTROY on both ranks."""
        self._command(F.SESSION_DESTROY, DESTROY.pack(session, store_as))

    def invalidate(self, cache_id: int) -> None:
        """INVALIDATE (drop a stored cache) on both ranks."""
        self._command(F.INVALIDATE, INVALIDATE.pack(cache_id))

    def disk_save(self, cache_id: int, tokens: Sequence[int], drop: bool) -> None:
        """DISK_SAVE on both ranks: each writes its half of stored cache `cache_id` (a rank that
        cannot just logs it: the other's file alone is never used, DISK_LOAD needs both)."""
        self._command(F.DISK_SAVE, pack_disk_save(cache_id, tokens, drop))

    def disk_load(self, cache_id: int, tokens: Sequence[int]) -> bool:
        """DISK_LOAD: both ranks read their half of the cache of `tokens` as stored cache
        `cache_id`, the worker first (it answers), the leader meanwhile. True when both did;
        otherwise neither keeps it (the worker told to drop its half) and both recompute."""
        digest = tokens_digest(tokens)
        self.control.send(F.DISK_LOAD, DISK_LOAD.pack(cache_id, len(tokens), 0, digest))
        mine = self._explained(lambda: self.table.caches.load(cache_id, digest, len(tokens)))
        _, payload = self._explained(lambda: self.control.recv(F.DISK_LOAD))
        peer_id, _, theirs, _ = unpack(DISK_LOAD, payload, F.DISK_LOAD)
        if peer_id != cache_id:
            raise LockstepDivergence(f"the worker answered DISK_LOAD of cache {peer_id}; the leader "
                                     f"asked for {cache_id}")
        if mine and not theirs:
            self.table.caches.stored.pop(cache_id)
        elif theirs and not mine:
            # The one command the leader does not apply to itself: the worker drops the half it
            # loaded when the leader's own half failed, which the leader's table never held.
            self.control.send(F.INVALIDATE, INVALIDATE.pack(cache_id))
        return bool(mine and theirs)

    def worker_kv_room(self, kv_bits: int, kv_group_size: int) -> Optional[int]:
        """KV_ROOM: the KV cache tokens the worker's machine holds beside its part of the
        weights, with caches of `kv_bits` (0: float); None when it could not read its memory."""
        self.control.send(F.KV_ROOM, KV_ROOM.pack(kv_bits, kv_group_size, 0, 0))
        _, payload = self._explained(lambda: self.control.recv(F.KV_ROOM))
        _, _, measured, tokens = unpack(KV_ROOM, payload, F.KV_ROOM)
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
        self.control.send(F.HASH, HASH.pack(session, step, mine))
        while poll_sec is not None and not select.select([self.control.sock], [], [], poll_sec)[0]:
            pass
        _, payload = self.control.recv(F.HASH)
        _, peer_step, theirs = unpack(HASH, payload, F.HASH)
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
            if ftype == F.HASH:
                session, step, theirs = unpack(HASH, payload, ftype)
                mine, what = table.batch.hash_of(session)
                control.send(F.HASH, HASH.pack(session, table.batch.step_count, mine))
                check_in_step(table.batch.step_count, mine, step, theirs, "leader", what)
                continue
            if ftype == F.DISK_LOAD:
                cache_id, count, _, digest = unpack(DISK_LOAD, payload, ftype)
                loaded = table.caches.load(cache_id, digest, count)
                control.send(F.DISK_LOAD, DISK_LOAD.pack(cache_id, count, int(loaded), digest))
                continue
            if ftype == F.KV_ROOM:
                control.send(F.KV_ROOM, _kv_room(model, payload))
                continue
            table.apply(ftype, payload)
    except Exception as exc:
        if tell_leader:
            control.send_error(f"{type(exc).__name__}: {exc}")
        raise


def _kv_room(model, payload: bytes) -> bytes:
    """The worker's answer to KV_ROOM: its machine's KV budget for the leader's cache kind."""
    from .memory import default_kv_budget

    bits, group_size, _, _ = unpack(KV_ROOM, payload, F.KV_ROOM)
    if bits and (bits not in KV_BITS or group_size not in KV_GROUP_SIZES):
        raise tr.FrameError(f"KV_ROOM asks about a KV cache of {bits} bits in groups of {group_size} "
                            f"(bits 0 or {KV_BITS}, groups {KV_GROUP_SIZES})")
    tokens, how = default_kv_budget(model, bits, group_size)
    log(f"serve: on the worker, {how}")
    return KV_ROOM.pack(bits, group_size, int(tokens is not None), tokens or 0)


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
