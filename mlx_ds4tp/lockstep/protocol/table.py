"""One rank's lockstep state, changed only by the lockstep commands (see
mlx_ds4tp.lockstep.protocol.sessions for the protocol): the caches of the sessions not yet decoding
and the stored prompt caches (lockstep.caches.session_caches), and the decode batch
(lockstep.protocol.decode_batch). The table dispatches each command to the part it changes, and moves
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

from ...errors import FrameError
from ...link.wire import FrameType
from ..caches.disk_cache import DiskCache
from ..caches.session_caches import SessionCaches
from ..errors import GrammarError
from ..sampling.grammar import Grammars, RowGrammar
from ..sampling.row_sampling import RowSampler
from .commands import COMMANDS
from .decode_batch import DecodeBatch

F = FrameType


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


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def fix_heap_thresholds() -> None:
    """On glibc, fix the heap's two thresholds for a long-running server (the values a user set
    in MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ are kept). After large frees glibc raises
    its mmap threshold, and the trim threshold with it, up to 32 and 64 MiB; malloc_trim shrinks
    only the main arena's free top, and the engine thread allocates from an arena of its own,
    whose top is handed back only when a free leaves more than the trim threshold there: in a
    soak it grew to 240 MiB. Fixed, the mmap threshold at 32 MiB (the most glibc would raise it
    to, so arrays are reused from the heap as before) and the trim threshold at 1 MiB, the
    leader ended soaks at 1.003x its start (docs/BENCHMARKS.md, 2026-12-01); on one event loop
    with no arena bound, a 600 s soak at 32 clients ended at 1.055x without them, 1.005x with.
    mallopt takes them at any time (no re-exec), unlike the arena count."""
    if not sys.platform.startswith("linux"):
        return
    import os
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    mallopt = ctypes.CDLL(None).mallopt
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        mallopt(_M_TRIM_THRESHOLD, 1 << 20)


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

    def __init__(self, model, grammars: Optional[Grammars] = None, disk: Optional[DiskCache] = None):
        self.model = model
        self.grammars = grammars  # constrained sessions' grammars (None: this rank has no tokenizer)
        # Every token id from the wire is checked against it (frames.check_tokens).
        self.vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)
        self.caches = SessionCaches(model, self.vocab, disk)
        self.batch = DecodeBatch(model, self.vocab)
        self.ended = 0  # sessions destroyed: the prompts served
        self.group = None  # a serving worker's group: what RANK_STATS reports on (its links)

    @property
    def step_count(self) -> int:
        """Decode steps run on this rank."""
        return self.batch.step_count

    @property
    def busy(self) -> bool:
        """True while a generation is under way (the leader's next command is imminent)."""
        return bool(self.caches.sessions or self.batch.rows)

    def apply(self, ftype, payload: bytes) -> Optional[mx.array]:
        """Execute one command (lockstep.protocol.commands); EVAL_BATCH returns the rows' logits
        [rows, vocab], VERIFY_BATCH [rows, width, vocab]."""
        if self.batch.verifying is not None and ftype != F.COMMIT_BATCH:
            raise FrameError(f"a {ftype.name} frame arrived before the COMMIT_BATCH of the last "
                                "VERIFY_BATCH: the ranks are out of step")
        command = COMMANDS.get(ftype)
        if command is None or command.answers:
            raise FrameError(f"a worker rank cannot execute a {ftype.name} frame here")
        return command.apply(self, *command.unpack(payload, self.vocab))

    def set_sampler(self, session: int, options, context: List[int], seed: int) -> None:
        """SAMPLER: the session (not decoding yet) samples its rows with these on this rank."""
        self.caches.session(session)
        self.batch.samplers[session] = RowSampler(options, context, seed, self.vocab,
                                                  grammar=self.row_grammar(options.grammar))

    def row_grammar(self, grammar: str) -> Optional[RowGrammar]:
        """The matcher of a session's grammar (None: it has none); FrameError when this rank
        cannot build it."""
        if not grammar:
            return None
        if self.grammars is None:
            raise FrameError("SAMPLER carries a grammar, but this rank was started without its "
                                "tokenizer's grammars (lockstep.sampling.grammar.Grammars)")
        try:
            return self.grammars.row(grammar, self.vocab)
        except GrammarError as exc:
            raise FrameError(f"SAMPLER's grammar does not compile on this rank: {exc}") from None

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
            raise FrameError(f"SESSION_DESTROY for session {session}, which does not exist")
        self.batch.forget(session)
        self.ended += 1
        if store_as:
            self.caches.store(store_as, cache)
