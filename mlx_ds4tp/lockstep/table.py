"""One rank's sessions: their KV caches, the stored prompt caches and the decode batch,
changed only by the lockstep commands (see mlx_ds4tp.lockstep.sessions for the protocol).

The decode batch is mlx-lm's BatchKVCache: rows left-padded, merged when sessions join,
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

import ctypes
import gc
import sys
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import transport as tr
from ..link.wire import EVAL_BATCH_HEADER as BATCH_HEADER
from ..link.wire import EVAL_PENDING
from ..link.wire import INVALIDATE_PAYLOAD as INVALIDATE
from ..link.wire import MAX_BATCH_ROWS
from ..link.wire import REWIND_PAYLOAD as REWIND
from ..link.wire import SESSION_CREATE_PAYLOAD as CREATE
from ..link.wire import SESSION_DESTROY_PAYLOAD as DESTROY
from . import batch_verify
from .frames import BATCH_ROW, unpack, unpack_prefill_batch
from .compute import PREFILL_STEP, fill_cache, logits_hash, make_cache
from .prompt_cache import COPY, FRESH, MOVE
from .row_sampling import RowSampler, sample_batch, unpack_sampler

F = tr.FrameType

# Decode steps between releases of MLX's buffer cache, for `ds4tp run` and `ds4tp serve`
# alike (mlx-lm's BatchGenerator: 512, its generate_step 256; a serving batch changes shape
# with every join and leave, and freed buffers of each shape pile up, so more often: a
# 32-client soak then ends below its steady memory).
CLEAR_EVERY = 64
# The per-row fold of sampled tokens (hash = hash * M + token, wrapping in uint32): FNV's prime.
TOKEN_HASH_MULT = 16777619
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
KV_GROUP_SIZES = (32, 64, 128)


def kv_code(bits: int, group_size: int) -> int:
    """SESSION_CREATE's KV field: 0 for a float cache, else bits | group_size << 8."""
    return 0 if not bits else bits | group_size << 8


def kv_of_code(code: int) -> Tuple[int, int]:
    """(bits, group size) of a SESSION_CREATE KV field; FrameError when it names neither."""
    if code == 0:
        return 0, 0
    bits, group_size = code & 0xFF, code >> 8
    if bits not in KV_BITS or group_size not in KV_GROUP_SIZES:
        raise tr.FrameError(f"SESSION_CREATE asks for a KV cache of {bits} bits in groups of "
                            f"{group_size} (bits {KV_BITS}, groups {KV_GROUP_SIZES})")
    return bits, group_size


def owned(cache: list) -> list:
    """The cache with every array its own copy. A row extracted from the batch may be a view of
    the whole batch's buffer (mlx-lm's extract of the longest row of a just-merged batch is
    contiguous, so no copy is made), and a stored cache would then keep every other row's
    keys and values alive for as long as it is kept."""
    made: list = []

    def copy(value):
        if isinstance(value, mx.array):
            made.append(mx.array(value))
            return made[-1]
        if isinstance(value, (list, tuple)) and any(isinstance(v, mx.array) for v in value):
            return type(value)(copy(v) for v in value)
        return value

    fresh = []
    for layer in cache:
        for name, value in list(vars(layer).items()):
            new = copy(value)
            if new is not value:
                setattr(layer, name, new)
        fresh.append(layer)
    mx.eval(made)
    return fresh


def release_memory() -> None:
    """Hand the memory of finished work back, once a rank has been idle for a moment (the
    serving leader's engine, the worker's command loop) or its pair failed: arrays only
    garbage cycles still hold, MLX's buffer cache, and on Linux the C heap's free pages
    (glibc keeps freed arrays' pages resident, so a server's resident memory would follow its
    busiest moment forever). Not when the last session ends: the collection takes 15-25 ms,
    which a client that sends its next request at once would wait for, and the HTTP threads
    free their requests' objects only after it.

    Arrays in cycles: an exception's traceback, for one, holds the frames, and so the arrays,
    of the step that raised. Python's collector finds them only after enough new allocations,
    which an idle server never makes: a soak's leader sat idle with 4.2 MB of arrays that only
    cycles reached."""
    gc.collect()
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():
    global _TRIM
    if _TRIM is None:
        _TRIM = False
        if sys.platform.startswith("linux"):
            try:
                _TRIM = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):
                pass
    return _TRIM or None


_TRIM = None


class SessionTable:
    """The sessions, stored caches and decode batch of one rank; see the module docstring."""

    def __init__(self, model):
        self.model = model
        self.make_cache = lambda: make_cache(model)
        self.sessions: Dict[int, list] = {}  # prefilling, not yet in the batch
        self.stored: Dict[int, list] = {}
        self.rows: List[int] = []
        self.batch_cache: Optional[list] = None
        self._merged = False  # batch_cache is a BatchKVCache per layer (else one session's own)
        self._verifying: Optional[List[int]] = None  # the last VERIFY_BATCH's row lengths, until its commit
        self.step_count = 0
        self.ended = 0  # sessions destroyed: the prompts served
        self.last_logits: Optional[mx.array] = None
        # Pipelined decode (lockstep.row_sampling): each session's sampler, the token this rank
        # sampled for it at the last step (an EVAL_PENDING row's input), and, by session, why
        # its sampler failed there.
        self.samplers: Dict[int, RowSampler] = {}
        self.pending: Dict[int, mx.array] = {}
        self.row_errors: Dict[int, str] = {}
        self._drawn_hash: Optional[mx.array] = None  # [rows] uint32: see the module docstring
        self._said_no_merge = False  # prefill_batch's fallback is logged once
        # Token ids index the embedding, which MLX does not bounds-check (an id past the table
        # reads other memory or crashes), so every id from the wire is checked here first.
        self.vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)

    @property
    def busy(self) -> bool:
        """True while a generation is under way (the leader's next command is imminent)."""
        return bool(self.sessions or self.rows)

    # -- commands ------------------------------------------------------------
    def apply(self, ftype, payload: bytes) -> Optional[mx.array]:
        """Execute one command; EVAL_BATCH returns the rows' logits [rows, vocab]."""
        if self._verifying is not None and ftype != F.COMMIT_BATCH:
            raise tr.FrameError(f"a {ftype.name} frame arrived before the COMMIT_BATCH of the last "
                                "VERIFY_BATCH: the ranks are out of step")
        if ftype == F.SESSION_CREATE:
            self.create(*unpack(CREATE, payload, ftype))
        elif ftype == F.REWIND:
            session, keep, _ = unpack(REWIND, payload, ftype)
            self.rewind(session, keep)
        elif ftype == F.PREFILL_BATCH:
            self.prefill_batch(*unpack_prefill_batch(payload))
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
        elif ftype == F.VERIFY_BATCH:
            step, sessions, rows = batch_verify.unpack_verify_batch(payload)
            if step != self.step_count + 1:
                raise tr.FrameError(f"VERIFY_BATCH step {step} arrived after step {self.step_count}: "
                                    "the ranks are out of step")
            return self.verify_batch(sessions, rows)
        elif ftype == F.COMMIT_BATCH:
            self.commit_batch(*batch_verify.unpack_commit(payload))
        elif ftype == F.SESSION_DESTROY:
            self.destroy(*unpack(DESTROY, payload, ftype))
        elif ftype == F.SAMPLER:
            session, options, context, seed = unpack_sampler(payload)
            self._session(session)
            self.check_tokens(np.asarray(context))
            self.samplers[session] = RowSampler(options, context, seed, self.vocab)
        elif ftype == F.INVALIDATE:
            (cache_id,) = unpack(INVALIDATE, payload, ftype)
            if self.stored.pop(cache_id, None) is None:
                raise tr.FrameError(f"INVALIDATE names stored cache {cache_id}, which does not exist")
        else:
            raise tr.FrameError(f"the worker cannot execute a {ftype.name} frame here")
        return None

    def create(self, session: int, cache_id: int, mode: int, kv: int = 0) -> None:
        """A new session: a fresh cache (its KV quantized as `kv` says, kv_code), or stored
        cache `cache_id` moved or copied (quantized as it was made)."""
        if session in self.sessions or session in self.rows:
            raise tr.FrameError(f"SESSION_CREATE for session {session}, which already exists")
        if mode == FRESH:
            bits, group_size = kv_of_code(kv)
            cache = self.make_cache()
            if bits:
                from .quantized_cache import quantize_session_cache

                cache = quantize_session_cache(cache, bits, group_size)
            self.sessions[session] = cache
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
        size = cache[0].size() if cache else 0  # a model without layer caches holds nothing
        if keep > size:
            raise tr.FrameError(f"REWIND session {session} to {keep} tokens, but it holds {size}")
        trim_prompt_cache(cache, size - keep)

    def prefill(self, session: int, tokens: np.ndarray) -> None:
        """Append tokens to a session that is not decoding yet (batch of one): only the cache is
        evaluated, so neither the vocabulary projection, its logits gather nor the last block's
        gates run (fill_cache)."""
        self.check_tokens(tokens)
        fill_cache(self.model, tokens.tolist(), self._session(session))

    def prefill_batch(self, sessions: List[int], chunks: List[np.ndarray]) -> None:
        """One prefill chunk of each of several sessions that are not decoding yet, in one padded
        forward, as mlx-lm's PromptProcessingBatch.prompt processes prompts together: the
        caches merged (left-padded to the longest history, so a reused cache joins as it is),
        the chunks right-padded to the longest, prepare / forward / finalize (the right padding
        rolled into left padding), then each row extracted back into its session's own cache,
        so joining the decode batch, destroying and storing a cache are unchanged. One row is
        prefill() itself, bit for bit; a cache family mlx-lm cannot merge runs the rows one
        at a time (the same decision on both ranks: it depends on the model alone)."""
        from mlx_lm.generate import _merge_caches, _right_pad_prompts

        if len(set(sessions)) != len(sessions) or len(sessions) != len(chunks) or not sessions:
            raise tr.FrameError(f"PREFILL_BATCH sessions {sessions} with {len(chunks)} chunks: "
                                "each session once, one non-empty chunk each")
        caches = [self._session(s) for s in sessions]
        for tokens in chunks:
            self.check_tokens(tokens)
            if len(tokens) == 0:
                raise tr.FrameError("PREFILL_BATCH carries an empty chunk")
        batch = None
        if len(sessions) > 1 and caches[0]:
            try:
                batch = _merge_caches(caches)
            except ValueError as exc:
                if not self._said_no_merge:
                    tr.log(f"prefill: prompts are prefilled one at a time ({exc})")
                    self._said_no_merge = True
        if batch is None:
            for tokens, cache in zip(chunks, caches):
                fill_cache(self.model, tokens.tolist(), cache)
            return
        lengths = [len(t) for t in chunks]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        tokens = _right_pad_prompts([t.tolist() for t in chunks], max_length=longest)
        if max(padding):
            for c in batch:
                c.prepare(lengths=lengths, right_padding=padding)
        # Chunked as fill_cache is, so the attention scores never outgrow one chunk's; the
        # finalize joins the last chunk's evaluation (it moves cache entries, no gates).
        for start in range(0, longest, PREFILL_STEP):
            self.model(tokens[:, start:start + PREFILL_STEP], cache=batch)
            if start + PREFILL_STEP >= longest and max(padding):
                for c in batch:
                    c.finalize()
            mx.eval([c.state for c in batch])
        # The rows' own copies (owned: an extracted row may be a view of the padded batch), so
        # the padded batch's memory goes before the next forward.
        for i, session in enumerate(sessions):
            self.sessions[session] = owned([c.extract(i) for c in batch])
        # As mlx-lm after each prompt chunk: MLX keeps freed buffers for reuse, and a padded
        # forward's activations would otherwise stay held as the process's memory.
        mx.clear_cache()

    def size(self, session: int) -> int:
        """Tokens a session's (unbatched) cache holds."""
        cache = self._session(session)
        return cache[0].size() if cache else 0

    def step(self, sessions: List[int], tokens: np.ndarray) -> mx.array:
        """One decode forward over the batch's rows; sessions that are not in the batch yet
        join it (after the existing rows, in the order given). Where every row's session has
        a sampler (SAMPLER), this rank samples them all inside the step's graph and queues it
        without waiting (pipelined: the leader reads the tokens while the next step runs);
        otherwise the logits are evaluated here."""
        self._take_rows("EVAL_BATCH", sessions)
        inputs = self._step_inputs(sessions, tokens)
        self.step_count += 1
        logits = self.model(inputs[:, None], cache=self.batch_cache)
        logits = logits[:, -1, :]
        self.last_logits = logits
        samplers = [self.samplers.get(s) for s in sessions]
        if all(samplers):
            errors: Dict[int, str] = {}
            drawn = sample_batch(logits, samplers, errors)
            for i, session in enumerate(sessions):
                self.pending[session] = drawn[i:i + 1]
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

    def _step_inputs(self, sessions: List[int], tokens: np.ndarray) -> mx.array:
        """The step's input tokens: each row's own, or (EVAL_PENDING) this rank's last sample."""
        pending = tokens == EVAL_PENDING
        self.check_tokens(tokens[~pending])
        if not pending.any():
            return mx.array(tokens, dtype=mx.int32)
        parts = []
        for session, token, mine in zip(sessions, tokens.tolist(), pending.tolist()):
            if mine and session not in self.pending:
                raise tr.FrameError(f"EVAL_BATCH asks for session {session}'s own sampled token (id "
                                    f"{token}), but this rank has none pending: an id outside the "
                                    "model's vocabulary otherwise; the ranks are out of step")
            parts.append(self.pending[session] if mine else mx.array([token], dtype=mx.int32))
        return mx.concatenate(parts)

    def verify_batch(self, sessions: List[int], rows: List[np.ndarray]) -> mx.array:
        """One decode forward whose rows carry an input token and drafts (batch_verify):
        logits [rows, width, vocab]; the caches hold every position until COMMIT_BATCH."""
        self._take_rows("VERIFY_BATCH", sessions)
        for row in rows:
            self.check_tokens(row)
        self.step_count += 1
        logits = batch_verify.forward_rows(self.model, self.batch_cache, rows)
        self.last_logits = logits
        self._verifying = [len(r) for r in rows]
        return logits

    def commit_batch(self, step: int, keep: List[int]) -> None:
        """Keep the positions of each row of the last VERIFY_BATCH its session accepted."""
        if step != self.step_count:
            raise tr.FrameError(f"COMMIT_BATCH for step {step} after step {self.step_count}")
        problem = batch_verify.check_commit(keep, self._verifying or [])
        if problem:
            raise tr.FrameError(problem)
        width = max(self._verifying)
        self._verifying = None
        batch_verify.commit_rows(self.batch_cache, self._merged, width, keep)

    def _take_rows(self, frame: str, sessions: List[int]) -> None:
        if len(set(sessions)) != len(sessions):
            raise tr.FrameError(f"{frame} names a session twice: {sessions}")
        if sessions[: len(self.rows)] != self.rows:
            raise tr.FrameError(f"{frame} rows {sessions} do not begin with this rank's batch "
                                f"{self.rows}: the ranks are out of step")
        joining = sessions[len(self.rows):]
        if joining:
            self._join(joining)

    def _join(self, joining: List[int]) -> None:
        caches = [self._session(s) for s in joining]
        for s in joining:
            del self.sessions[s]
        if self.batch_cache is None and len(caches) == 1:
            self.batch_cache, self._merged = caches[0], False
        else:
            if self.batch_cache is not None and not self._merged:
                caches.insert(0, self.batch_cache)  # the lone row's own cache joins the merge
                self.batch_cache = None
            merged = [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]
            if self.batch_cache is None:
                self.batch_cache = merged
            else:
                for mine, new in zip(self.batch_cache, merged):
                    mine.extend(new)
            self._merged = True
        self.rows.extend(joining)

    def _hash_rows(self, rows: int) -> mx.array:
        """The rows' token hashes, a fresh 0 for each row that joined since the last fold."""
        have = 0 if self._drawn_hash is None else self._drawn_hash.shape[0]
        fresh = mx.zeros((rows - have,), dtype=mx.uint32)
        return fresh if self._drawn_hash is None else mx.concatenate([self._drawn_hash, fresh])

    def logits_hash(self) -> int:
        """Hash of the last decode step's logits: equal on both ranks while they are in step."""
        return logits_hash(self.last_logits) if self.last_logits is not None else 0

    def hash_of(self, session: int) -> Tuple[int, str]:
        """(hash, what it covers) for a HASH frame's first field: 0, the last step's logits;
        a session in the batch, the tokens this rank sampled for it (0 before any)."""
        if session == 0:
            return self.logits_hash(), "logits"
        if session not in self.rows:
            raise tr.FrameError(f"HASH asks for the sampled tokens of session {session}, which is "
                                f"not in the decode batch {self.rows}")
        row = self.rows.index(session)
        if self._drawn_hash is None or row >= self._drawn_hash.shape[0]:
            return 0, "tokens decoded"
        return int(self._drawn_hash[row].item()), "tokens decoded"

    def destroy(self, session: int, store_as: int) -> None:
        """End a session (leaving the batch if it is in it); keep its cache as `store_as`."""
        if session in self.rows:
            idx = self.rows.index(session)
            del self.rows[idx]
            self._drop_hash_row(idx)
            if not self._merged:
                cache, self.batch_cache = self.batch_cache, None
            else:
                cache = [c.extract(idx) for c in self.batch_cache] if store_as else None
                if self.rows:
                    keep = [i for i in range(len(self.rows) + 1) if i != idx]
                    for c in self.batch_cache:
                        c.filter(keep)
                else:
                    self.batch_cache, self._merged = None, False
        elif session in self.sessions:
            cache = self.sessions.pop(session)
        else:
            raise tr.FrameError(f"SESSION_DESTROY for session {session}, which does not exist")
        for kept in (self.samplers, self.pending, self.row_errors):
            kept.pop(session, None)
        self.ended += 1
        if store_as:
            if store_as in self.stored:
                raise tr.FrameError(f"SESSION_DESTROY stores under cache id {store_as}, already taken")
            self.stored[store_as] = owned(cache)

    def _drop_hash_row(self, row: int) -> None:
        held = 0 if self._drawn_hash is None else self._drawn_hash.shape[0]
        if row < held:
            keep = [i for i in range(held) if i != row]
            self._drawn_hash = self._drawn_hash[mx.array(keep)] if keep else None

    def stored_bytes(self, cache_id: int) -> int:
        """Bytes a stored cache's arrays take on this rank."""
        return sum(int(getattr(c, "nbytes", 0) or 0) for c in self.stored.get(cache_id, ()))

    def _session(self, session: int) -> list:
        cache = self.sessions.get(session)
        if cache is None:
            raise tr.FrameError(f"session {session} does not exist or is already decoding")
        return cache

    def check_tokens(self, tokens: np.ndarray) -> None:
        if self.vocab and len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab)][0])
            raise tr.FrameError(f"token id {bad}, outside the model's vocabulary [0, {self.vocab}): "
                                "the leader runs another model or the frame is corrupt")
