"""One rank's decode batch: the sessions decoding together, their cache, their samplers and
what they last drew, changed only by the lockstep commands (lockstep.protocol.table applies them).

The batch cache is mlx-lm's BatchKVCache: rows left-padded, merged when sessions join,
filtered when they leave, exactly as mlx-lm's BatchGenerator does. A batch of one row is the
session's own cache, unmerged: the single-sequence path of mlx_lm.generate, bit for bit, for
any cache family (a one-session `ds4tp run` decodes there); it is merged when a second
session joins.

Each rank also folds the tokens it samples for each row into a 32-bit hash per row, inside
the step's graph (no wait for the host): the leader compares them with the worker's when a
generation ends (LeaderSessions.check_hash), so a pair whose ranks drew different tokens
fails loudly instead of generating from caches that no longer match.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ...errors import FrameError
from .. import batch_verify
from ..compute import logits_hash
from ..sampling.row_sampling import RowSampler, sample_batch
from .commands import EVAL_PENDING, check_tokens, pad_rows

# Decode steps between releases of MLX's buffer cache, for `ds4tp run` and `ds4tp serve`
# alike (mlx-lm's BatchGenerator: 512, its generate_step 256; a serving batch changes shape
# with every join and leave, and freed buffers of each shape pile up, so more often: a
# 32-client soak then ends below its steady memory).
CLEAR_EVERY = 64
# The per-row fold of sampled tokens (hash = hash * M + token, wrapping in uint32): FNV's prime.
TOKEN_HASH_MULT = 16777619


class DecodeBatch:
    """The decode batch of one rank; see the module docstring."""

    def __init__(self, model, vocab: int):
        self.model = model
        self.vocab = vocab
        self.rows: List[int] = []
        self.batch_cache: Optional[list] = None
        self.merged = False  # batch_cache is a BatchKVCache per layer (else one session's own)
        self.verifying: Optional[List[int]] = None  # the last VERIFY_BATCH's row lengths, until its commit
        self.step_count = 0
        self.last_logits: Optional[mx.array] = None
        # Pipelined decode (lockstep.sampling.row_sampling): each session's sampler, the tokens this rank
        # sampled at the last sampled step ([rows], lazy: an EVAL_PENDING row's input) and that
        # step's sessions in row order, and, by session, why its sampler failed there.
        self.samplers: Dict[int, RowSampler] = {}
        self.drawn: Optional[mx.array] = None
        self.drawn_rows: List[int] = []
        self.row_errors: Dict[int, str] = {}
        self._drawn_hash: Optional[mx.array] = None  # [rows] uint32: see the module docstring

    def check_step(self, frame: str, step: int) -> None:
        """A step command must number the step after this rank's last."""
        if step != self.step_count + 1:
            raise FrameError(f"{frame} step {step} arrived after step {self.step_count}: "
                                "the ranks are out of step")

    def join(self, frame: str, sessions: List[int], take: Callable[[int], list]) -> None:
        """A step's rows: the batch's own, in its order, then the sessions that join it now,
        their caches taken (SessionCaches.take); FrameError when the rows are not that."""
        if len(set(sessions)) != len(sessions):
            raise FrameError(f"{frame} names a session twice: {sessions}")
        if sessions[: len(self.rows)] != self.rows:
            raise FrameError(f"{frame} rows {sessions} do not begin with this rank's batch "
                                f"{self.rows}: the ranks are out of step")
        joining = sessions[len(self.rows):]
        if not joining:
            return
        caches = [take(s) for s in joining]
        if self.batch_cache is None and len(caches) == 1:
            self.batch_cache, self.merged = caches[0], False
        else:
            if self.batch_cache is not None and not self.merged:
                caches.insert(0, self.batch_cache)  # the lone row's own cache joins the merge
                self.batch_cache = None
            merged = [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]
            if self.batch_cache is None:
                self.batch_cache = merged
            else:
                for mine, new in zip(self.batch_cache, merged):
                    mine.extend(new)
            self.merged = True
        self.rows.extend(joining)

    def step(self, tokens: np.ndarray) -> mx.array:
        """One decode forward over the batch's rows. Where every row's session has a sampler
        (SAMPLER), this rank samples them all inside the step's graph and queues it without
        waiting (pipelined: the leader reads the tokens while the next step runs); otherwise
        the logits are evaluated here."""
        sessions = self.rows
        inputs = self._step_inputs(tokens)
        self.step_count += 1
        logits = self.model(inputs[:, None], cache=self.batch_cache)
        logits = logits[:, -1, :]
        self.last_logits = logits
        samplers = [self.samplers.get(s) for s in sessions]
        if all(samplers):
            constrained = [s for s in samplers if s.grammar is not None]
            if constrained:
                # A constrained row's mask needs its last token on the host (RowSampler.draw):
                # the forward is queued first, so that wait overlaps it.
                mx.async_eval(logits)
                for sampler in constrained:
                    sampler.catch_up()
            errors: Dict[int, str] = {}
            drawn = sample_batch(logits, samplers, errors)
            self.drawn, self.drawn_rows = drawn, list(sessions)
            self.row_errors.update({sessions[i]: why for i, why in errors.items()})
            self._drawn_hash = self._hash_rows(len(sessions)) * TOKEN_HASH_MULT + drawn.astype(mx.uint32)
            # The hash is evaluated with the tokens, so its graph never outgrows one step's.
            mx.async_eval(drawn, self._drawn_hash)
        else:
            # The step's one evaluation: every gate of the forward runs inside it.
            mx.eval(logits)
        if self.step_count % CLEAR_EVERY == 0:
            mx.clear_cache()
        return logits

    def _step_inputs(self, tokens: np.ndarray) -> mx.array:
        """The step's input tokens: each row's own, or (EVAL_PENDING) this rank's last sample."""
        pending = tokens == EVAL_PENDING
        check_tokens(tokens[~pending], self.vocab)
        if not pending.any():
            return mx.array(tokens, dtype=mx.int32)
        if pending.all() and self.rows == self.drawn_rows:
            return self.drawn  # the steady pipelined batch: the last step's tokens as they are
        at = {session: i for i, session in enumerate(self.drawn_rows)}
        source = np.zeros(len(self.rows), dtype=np.int32)
        for row, (session, mine) in enumerate(zip(self.rows, pending.tolist())):
            if mine and session not in at:
                raise FrameError(f"EVAL_BATCH asks for session {session}'s own sampled token (id "
                                    f"{int(tokens[row])}), but this rank has none pending: an id outside "
                                    "the model's vocabulary otherwise; the ranks are out of step")
            source[row] = at.get(session, 0)
        # One gather and one select: each pending row takes its own sample of the last step.
        return mx.where(mx.array(pending), self.drawn[mx.array(source)], mx.array(tokens, dtype=mx.int32))

    def verify(self, rows: List[np.ndarray]) -> mx.array:
        """One decode forward whose rows carry an input token and drafts (batch_verify):
        logits [rows, width, vocab]; the caches hold every position until commit."""
        for row in rows:
            check_tokens(row, self.vocab)
        self.step_count += 1
        logits = self.model(mx.array(pad_rows(rows)), cache=self.batch_cache)
        mx.eval(logits)  # the gates of every layer run once for all rows and positions
        self.last_logits = logits
        self.verifying = [len(r) for r in rows]
        return logits

    def commit(self, step: int, keep: List[int]) -> None:
        """Keep the positions of each row of the last verify its session accepted (COMMIT_BATCH)."""
        if step != self.step_count:
            raise FrameError(f"COMMIT_BATCH for step {step} after step {self.step_count}")
        batch_verify.check_commit(keep, self.verifying or [])
        width = max(self.verifying)
        self.verifying = None
        batch_verify.commit_rows(self.batch_cache, self.merged, width, keep)

    def leave(self, session: int, keep_cache: bool) -> Optional[list]:
        """A session leaves the batch: its cache (extracted when keep_cache, else None)."""
        idx = self.rows.index(session)
        del self.rows[idx]
        held = 0 if self._drawn_hash is None else self._drawn_hash.shape[0]
        if idx < held:
            kept = [i for i in range(held) if i != idx]
            self._drawn_hash = self._drawn_hash[mx.array(kept)] if kept else None
        if not self.rows:  # the last row's sample goes with it
            self.drawn, self.drawn_rows = None, []
        if not self.merged:
            cache, self.batch_cache = self.batch_cache, None
            return cache
        cache = [c.extract(idx) for c in self.batch_cache] if keep_cache else None
        if self.rows:
            keep = [i for i in range(len(self.rows) + 1) if i != idx]
            for c in self.batch_cache:
                c.filter(keep)
        else:
            self.batch_cache, self.merged = None, False
        return cache

    def forget(self, session: int) -> None:
        """Drop what a destroyed session's rows sampled with (its sampler may predate its rows)."""
        for kept in (self.samplers, self.row_errors):
            kept.pop(session, None)
        # Its last sample is no one's pending token now (a later session may take its id).
        self.drawn_rows = [s if s != session else None for s in self.drawn_rows]

    def _hash_rows(self, rows: int) -> mx.array:
        """The rows' token hashes, a fresh 0 for each row that joined since the last fold."""
        have = 0 if self._drawn_hash is None else self._drawn_hash.shape[0]
        fresh = mx.zeros((rows - have,), dtype=mx.uint32)
        return fresh if self._drawn_hash is None else mx.concatenate([self._drawn_hash, fresh])

    def hash_of(self, session: int) -> Tuple[int, str]:
        """(hash, what it covers) for a HASH frame's first field: 0, the last step's logits;
        a session in the batch, the tokens this rank sampled for it (0 before any)."""
        if session == 0:
            return (logits_hash(self.last_logits) if self.last_logits is not None else 0), "logits"
        if session not in self.rows:
            raise FrameError(f"HASH asks for the sampled tokens of session {session}, which is "
                                f"not in the decode batch {self.rows}")
        row = self.rows.index(session)
        if self._drawn_hash is None or row >= self._drawn_hash.shape[0]:
            return 0, "tokens decoded"
        return int(self._drawn_hash[row].item()), "tokens decoded"
