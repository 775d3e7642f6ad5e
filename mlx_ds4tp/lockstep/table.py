"""One rank's lockstep state, changed only by the lockstep commands (see
mlx_ds4tp.lockstep.sessions for the protocol): the caches of the sessions not yet decoding
and the stored prompt caches (lockstep.session_caches), and the decode batch
(lockstep.decode_batch). The table dispatches each command to the part it changes, and moves
a session's cache from one to the other when it joins the batch or leaves it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
from typing import List, Optional

import mlx.core as mx
import numpy as np

from .. import transport as tr
from ..link.wire import (
    INVALIDATE_PAYLOAD as INVALIDATE,
    REWIND_PAYLOAD as REWIND,
    SESSION_CREATE_PAYLOAD as CREATE,
    SESSION_DESTROY_PAYLOAD as DESTROY,
)
from . import batch_verify
from .decode_batch import DecodeBatch
from .disk_cache import DiskCache
from .frames import check_tokens, unpack, unpack_batch, unpack_disk_save, unpack_prefill_batch
from .row_sampling import RowSampler, unpack_sampler
from .session_caches import SessionCaches

F = tr.FrameType


def release_memory() -> None:
    """Hand the memory of finished work back once a rank has idled a moment (the serving
    leader's engine, the worker's command loop) or its pair failed: arrays only garbage cycles
    hold (a traceback keeps the failed step's frames and arrays, and Python's collector runs
    only after new allocations, which an idle server never makes: a soak's leader sat idle
    with 4.2 MB of them), MLX's buffer cache, and on Linux the C heap's free pages (glibc keeps
    them resident, so resident memory would follow the busiest moment forever). Not when the
    last session ends: the collection takes 15-25 ms, which a client that sends its next
    request at once would wait for, and the HTTP threads free their requests' objects after."""
    gc.collect()
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    if sys.platform.startswith("linux"):
        try:
            return ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            pass
    return None


class SessionTable:
    """The session caches and decode batch of one rank; see the module docstring."""

    def __init__(self, model, disk: Optional[DiskCache] = None):
        self.model = model
        # Every token id from the wire is checked against it (frames.check_tokens).
        self.vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)
        self.caches = SessionCaches(model, self.vocab, disk)
        self.batch = DecodeBatch(model, self.vocab)
        self.ended = 0  # sessions destroyed: the prompts served

    @property
    def busy(self) -> bool:
        """True while a generation is under way (the leader's next command is imminent)."""
        return bool(self.caches.sessions or self.batch.rows)

    def apply(self, ftype, payload: bytes) -> Optional[mx.array]:
        """Execute one command; EVAL_BATCH returns the rows' logits [rows, vocab], VERIFY_BATCH
        [rows, width, vocab]."""
        caches, batch = self.caches, self.batch
        if batch.verifying is not None and ftype != F.COMMIT_BATCH:
            raise tr.FrameError(f"a {ftype.name} frame arrived before the COMMIT_BATCH of the last "
                                "VERIFY_BATCH: the ranks are out of step")
        if ftype == F.SESSION_CREATE:
            session, cache_id, mode, kv = unpack(CREATE, payload, ftype)
            if session in caches.sessions or session in batch.rows:
                raise tr.FrameError(f"SESSION_CREATE for session {session}, which already exists")
            caches.create(session, cache_id, mode, kv)
        elif ftype == F.REWIND:
            session, keep, _ = unpack(REWIND, payload, ftype)
            caches.rewind(session, keep)
        elif ftype == F.PREFILL_BATCH:
            caches.prefill_batch(*unpack_prefill_batch(payload))
        elif ftype == F.EVAL_BATCH:
            step, sessions, tokens = unpack_batch(payload)
            batch.check_step("EVAL_BATCH", step)
            return self.step(sessions, tokens)
        elif ftype == F.VERIFY_BATCH:
            step, sessions, rows = batch_verify.unpack_verify_batch(payload)
            batch.check_step("VERIFY_BATCH", step)
            batch.join("VERIFY_BATCH", sessions, caches.take)
            return batch.verify(rows)
        elif ftype == F.COMMIT_BATCH:
            batch.commit(*batch_verify.unpack_commit(payload))
        elif ftype == F.SESSION_DESTROY:
            self.destroy(*unpack(DESTROY, payload, ftype))
        elif ftype == F.SAMPLER:
            session, options, context, seed = unpack_sampler(payload)
            caches.session(session)
            check_tokens(np.asarray(context), self.vocab)
            batch.samplers[session] = RowSampler(options, context, seed, self.vocab)
        elif ftype == F.INVALIDATE:
            (cache_id,) = unpack(INVALIDATE, payload, ftype)
            caches.invalidate(cache_id)
        elif ftype == F.DISK_SAVE:
            cache_id, tokens, drop = unpack_disk_save(payload, self.vocab)
            caches.save(cache_id, tokens, drop)
        else:
            raise tr.FrameError(f"the worker cannot execute a {ftype.name} frame here")
        return None

    def step(self, sessions: List[int], tokens: np.ndarray) -> mx.array:
        """One decode forward over (session, token) rows (DecodeBatch.step); sessions not in
        the batch yet join it first (after the existing rows, in the order given)."""
        self.batch.join("EVAL_BATCH", sessions, self.caches.take)
        return self.batch.step(tokens)

    def destroy(self, session: int, store_as: int) -> None:
        """End a session (leaving the batch if it is in it); keep its cache as `store_as`."""
        if session in self.batch.rows:
            cache = self.batch.leave(session, keep_cache=bool(store_as))
        elif session in self.caches.sessions:
            cache = self.caches.sessions.pop(session)
        else:
            raise tr.FrameError(f"SESSION_DESTROY for session {session}, which does not exist")
        self.batch.forget(session)
        self.ended += 1
        if store_as:
            self.caches.store(store_as, cache)
