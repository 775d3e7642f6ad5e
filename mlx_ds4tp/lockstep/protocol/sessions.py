"""The lockstep protocol: many sessions on both ranks, decoded together, the worker driven
step by step by the leader. `ds4tp serve` runs many sessions on it, `ds4tp run` one
(lockstep.generate.pair_generate).

Each rank holds a SessionTable (lockstep.protocol.table). The table changes only through commands,
and the leader applies every command it sends to its own table in the same order, so the two
tables stay identical and every forward pairs its gates with the peer's. The commands (control
frames; each one's layout, packing, unpacking and application is its class in lockstep.protocol.commands):

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
  KV_ROOM         the worker answers how many KV cache tokens its machine holds (lockstep.caches.memory)
  HASH            the worker answers its own hash of the last step's logits or of a session's
                  sampled tokens
  STOP            the worker returns
  REFORM          (serve over N > 2) a worker died and the leader forms the mesh again: the
                  worker raises MeshReformingError and joins the new mesh (serve.rejoin)

Rows of EVAL_BATCH: the sessions already in the batch, in row order, then the sessions that
join at this step. The worker checks that the rows it is told match its own batch, so a
divergence is a loud error at the first step it happens, never a silent wrong answer.
A worker that fails sends the leader an ERROR frame with the reason before its sockets
close; the leader's failing command reports it (LeaderSessions.send).
"""

from __future__ import annotations

import dataclasses
import select
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import mlx.core as mx

from ... import gate_ops
from ...errors import FrameError, LockstepDivergenceError, TransportError, TransportTimeoutError
from ...link.control import ControlChannel
from ...link.wire import FrameType
from ..caches.disk_cache import DiskCache
from ..caches.disk_files import tokens_digest
from ..errors import MeshReformingError
from ..sampling.grammar import Grammars
from .commands import COMMANDS, Command, DiskLoad, EvalBatch, Hash, Invalidate, KvRoom, check_in_step
from .table import SessionTable, release_memory

F = FrameType


def drain_failed_work() -> None:
    """Wait out the steps a failed pair left queued (a pipelined step is sent before the last
    one is read): on the closed group their gates fail at once, and the error they raise is
    theirs, here, not the next pair's first evaluation's."""
    try:
        mx.synchronize()
    except Exception:  # noqa: BLE001 - the old pair's failure, already reported
        pass


def worker_channels(group: gate_ops.Group) -> List[ControlChannel]:
    """The leader's control channel to each worker, in rank order (ranks 1 .. N-1)."""
    return [group.link_to(peer).control for peer in range(1, group.size())]


def leader_channel(group: gate_ops.Group) -> ControlChannel:
    """A worker's control channel to the leader (rank 0)."""
    return group.link_to(0).control


def _peer_error(control: ControlChannel, wait: float = 0.5) -> Optional[str]:
    """The peer's ERROR text if one arrives within `wait` seconds (its own explanation of a
    failure that reached us as 'peer closed'), else None. An answer it sent before it failed
    (a HASH this side had not read yet) is passed over."""
    deadline = time.monotonic() + wait
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([control.sock], [], [], left)[0]:
                return None
            try:
                _, payload = control.recv(F.ERROR, timeout=left)
            except FrameError:
                continue  # a frame of another type, read past (the deadline bounds the search)
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
    """The leader's side: every command goes out through `send` (to each worker, one in a pair,
    N-1 in a mesh, then applied here, in that order, so the workers' forwards start as early as
    the leader's) and every query through `ask` (asked of every worker, their answers then
    combined: disk_load, worker_kv_room, check_hash); a new command needs nothing here."""

    def __init__(self, group: gate_ops.Group, model, grammars: Optional[Grammars] = None,
                 disk: Optional[DiskCache] = None):
        self.group = group
        self.controls = worker_channels(group)
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
        from ..compute import trims_at_any_length

        return trims_at_any_length(self.table.caches.make_cache())

    def row_sampler(self, session: int):
        """The sampler SAMPLER gave a session on this rank (lockstep.sampling.row_sampling.RowSampler)."""
        return self.table.batch.samplers[session]

    def row_grammar(self, grammar: str):
        """The matcher of a grammar on this rank (SessionTable.row_grammar)."""
        return self.table.row_grammar(grammar)

    def send(self, command: Type[Command], *fields) -> Optional[mx.array]:
        """Any command (lockstep.protocol.commands) on every rank, packed from `fields` as its
        class says: sent to each worker, then applied here with the one SessionTable.apply, so
        the workers' forwards start as early as the leader's. The logits of a step command
        (EVAL_BATCH [rows, vocab], VERIFY_BATCH [rows, width, vocab]), else None. When the
        gates fail, the worker's own explanation (an ERROR frame) is preferred over our 'peer
        closed'. A query is asked (ask), not sent."""
        if command.answers:
            raise ValueError(f"{command.frame.name} is a query the worker ranks answer: ask it (LeaderSessions.ask)")
        payload = command.pack(*fields)
        self._broadcast(command.frame, payload)
        return self._explained(lambda: self.table.apply(command.frame, payload))

    def ask(self, query: Type[Command], *fields, here: Optional[Callable[[], Any]] = None,
            patient: bool = False) -> Tuple[Any, List[tuple]]:
        """A query (HASH, DISK_LOAD, KV_ROOM: answers=True) to every worker: (what `here`, the
        leader's own part, returned while the workers answered, or None; each worker's answer
        as the query unpacks it, in rank order). patient: wait for each answer without a
        deadline while its connection stays open (a worker still loading its weights)."""
        if not query.answers:
            raise ValueError(f"{query.frame.name} is not a query: send it (LeaderSessions.send)")
        self._broadcast(query.frame, query.pack(*fields))
        mine = self._explained(here) if here is not None else None
        answers = []
        for control in self.controls:
            while patient and not select.select([control.sock], [], [], 1.0)[0]:
                pass
            _, payload = self._explained(lambda c=control: c.recv(query.frame))
            answers.append(query.unpack(payload))
        return mine, answers

    def _broadcast(self, ftype, payload: bytes = b"") -> None:
        """One frame to every worker. A worker that stopped may have closed its end with our
        commands unread, which resets the connection: our send then fails, while its ERROR
        (sent before it closed) is still there to read, so the failure is explained too."""
        def send_all() -> None:
            for control in self.controls:
                control.send(ftype, payload)
        self._explained(send_all)

    def read(self, tokens: mx.array) -> List[int]:
        """The values of tokens this rank sampled, once their step has run (a pipelined step's
        gates fail here, in MLX's evaluation): explained as send explains a failure."""
        return self._explained(tokens.tolist)

    def _explained(self, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except LockstepDivergenceError:
            raise
        except RuntimeError as exc:  # TransportError, or a gate's failure out of MLX's evaluation
            cable = _cable_fault(self.group)
            if cable:  # this rank's own cable is out: that is the cause, named
                raise TransportError(f"{cable} ({exc})") from None
            for rank, control in enumerate(self.controls, 1):
                reason = _peer_error(control)
                if reason:
                    raise TransportError(f"{exc}; rank {rank} reported: {reason}") from None
            raise

    def sampled_step(self, rows: Sequence[Tuple[int, int]]) -> SampledStep:
        """One decode step (EVAL_BATCH) over (session, input token or EVAL_PENDING) rows whose
        sessions all have samplers (SAMPLER): queued, not waited for; what this rank drew for
        each row."""
        self.send(EvalBatch, self.step_count + 1, rows)
        batch, sids = self.table.batch, [sid for sid, _ in rows]
        return SampledStep(batch.drawn,
                           {i: batch.row_errors.pop(sid) for i, sid in enumerate(sids) if sid in batch.row_errors},
                           [batch.samplers[sid].last_logprobs for sid in sids])

    def disk_load(self, cache_id: int, tokens: Sequence[int]) -> bool:
        """DISK_LOAD: every rank reads its half of the cache of `tokens` as stored cache
        `cache_id`, the workers first (they answer), the leader meanwhile. True when all did;
        otherwise none keeps it (a worker told to drop its half) and all recompute."""
        digest = tokens_digest(tokens)
        mine, answers = self.ask(DiskLoad, cache_id, len(tokens), 0, digest,
                                 here=lambda: self.table.caches.load(cache_id, digest, len(tokens)))
        loaded = []
        for rank, (peer_id, _, theirs, _) in enumerate(answers, 1):
            if peer_id != cache_id:
                raise LockstepDivergenceError(f"rank {rank} answered DISK_LOAD of cache "
                                              f"{peer_id}; the leader asked for {cache_id}")
            loaded.append(bool(theirs))
        if mine and all(loaded):
            return True
        if mine:
            self.table.caches.stored.pop(cache_id)
        # The one command the leader does not apply to itself: a worker drops the part it
        # loaded when another rank's part failed, which the leader's table never held.
        for control, theirs in zip(self.controls, loaded):
            if theirs:
                self._explained(lambda c=control: c.send(Invalidate.frame, Invalidate.pack(cache_id)))
        return False

    def worker_kv_room(self, kv_bits: int, kv_group_size: int) -> Optional[int]:
        """KV_ROOM: the KV cache tokens the workers' machines hold beside their parts of the
        weights, with caches of `kv_bits` (0: float): the smallest worker's; None when one
        could not read its memory."""
        _, answers = self.ask(KvRoom, kv_bits, kv_group_size, 0, 0)
        rooms = [tokens if measured else None for _, _, measured, tokens in answers]
        return None if None in rooms else min(rooms)

    def check_hash(self, session: int = 0) -> None:
        """Compare a hash with the worker's: of the last step's logits (session 0: --debug-hash),
        or of the tokens each rank sampled for `session` (a generation's end); LockstepDivergenceError
        when they differ (the worker stops with it too)."""
        self._swap_hash(session, patient=False)

    def wait_ready(self) -> None:
        """Block until the worker runs its command loop: it joins first and loads its weights
        after, which may take minutes, so the wait has no deadline while its connection stays
        open (one HASH round trip); TransportError when it closes or reports a failure."""
        self._swap_hash(0, patient=True)

    def _swap_hash(self, session: int, patient: bool) -> None:
        step, (mine, what) = self.step_count, self.table.batch.hash_of(session)
        _, answers = self.ask(Hash, session, step, mine, patient=patient)
        for rank, (_, peer_step, theirs) in enumerate(answers, 1):
            check_in_step(step, mine, peer_step, theirs, f"rank {rank}", what)

    def peer_gone(self) -> Optional[str]:
        """Between commands: why a worker is gone (it sent ERROR or closed), or None."""
        try:
            readable, _, _ = select.select([c.sock for c in self.controls], [], [], 0)
        except (OSError, ValueError) as exc:
            return f"the control socket failed: {exc}"
        for rank, control in enumerate(self.controls, 1):
            if control.sock in readable:
                return _peer_error(control) or f"rank {rank} closed the connection"
        return None

    def stop(self) -> bool:
        """Tell the workers to return (best effort: one may be gone); whether STOP was sent to all."""
        sent = True
        for control in self.controls:
            try:
                control.send(F.STOP)
            except (TransportError, OSError):
                sent = False
        return sent

    def abort(self, reason: str) -> None:
        """The leader gives up on the pair: tell the worker why (best effort) and close the
        connection, so the worker stops with that reason instead of waiting for commands."""
        for control in self.controls:
            control.send_error(f"the leader stopped serving: {reason}")
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
    control = leader_channel(group)
    table = SessionTable(model, grammars, disk)
    table.group = group
    try:
        while True:
            ftype, payload = _next_command(control, table.busy)
            if ftype == F.STOP:
                return table
            if ftype == F.REFORM:
                # The leader lives and forms its group again: not a failure.
                raise MeshReformingError(payload.decode("utf-8", "replace"))
            if ftype == F.RESIZE:  # the same, at another size (serve/resize.py)
                raise MeshReformingError("the group changes size", resize=payload)
            command = COMMANDS.get(ftype)
            if command is not None and command.answers:  # a query: HASH, DISK_LOAD, KV_ROOM
                fields = command.unpack(payload, table.vocab)
                reply = command.answer(table, *fields)
                control.send(ftype, reply)
                command.check(reply, *fields)
                continue
            table.apply(ftype, payload)
    except MeshReformingError:
        raise
    except Exception as exc:
        cable = _cable_fault(group)
        if tell_leader:
            control.send_error(cable or f"{type(exc).__name__}: {exc}")
        if cable:  # this rank's own cable is out: that is the cause, named
            raise TransportError(f"{cable} ({exc})") from exc
        raise


def leader_word(group: gate_ops.Group, wait: float) -> Optional[str]:
    """A worker whose step failed: the leader's ERROR (its abort's reason) if it comes within
    `wait` seconds, else None. Frames of other types before it are read past: only for a
    worker that stops (`ds4tp run`), never one that may follow a REFORM."""
    return _peer_error(leader_channel(group), wait)


def _cable_fault(group) -> Optional[str]:
    """This rank's cable that is out (the group's cable_fault: link/cable_watch.py), or None."""
    ask = getattr(group, "cable_fault", None)
    return ask() if ask is not None else None


def _next_command(control: ControlChannel, busy: bool) -> tuple:
    """Idle between requests without a deadline, noticing a dead leader at once (EOF makes
    the socket readable); during a generation the leader's next command is one sampling step
    away, so wait at most the timeout (DS4_TP_TIMEOUT_SEC): never a hang. It is watched for
    a moment before the wait sleeps (ControlChannel.poll_readable)."""
    if busy:
        control.poll_readable()
        try:
            return control.recv()
        except TransportTimeoutError as exc:
            raise TransportTimeoutError(
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
