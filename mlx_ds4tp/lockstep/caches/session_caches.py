"""One rank's caches of the sessions not decoding yet (from SESSION_CREATE until they join
lockstep.protocol.decode_batch) and its stored prompt caches (a destroyed session's, which a later one
moves or copies as the leader's lockstep.caches.prompt_cache decides); lockstep.protocol.table applies the
commands that change them."""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ...base.log import log
from ...errors import FrameError
from ..compute import PREFILL_STEP, fill_cache, make_cache
from ..protocol.commands.base import check_tokens
from .disk_cache import DiskCache
from .prompt_cache import COPY, FRESH, MOVE

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
        raise FrameError(f"SESSION_CREATE asks for a KV cache of {bits} bits in groups of "
                            f"{group_size} (bits {KV_BITS}, groups {KV_GROUP_SIZES})")
    return bits, group_size


def owned(cache: list) -> list:
    """The cache with every array its own copy. A row extracted from the batch may be a view of
    the whole batch's buffer (mlx-lm's extract of the longest row of a just-merged batch is
    contiguous, so no copy is made), and a stored cache would then keep every other row's
    keys and values alive for as long as it is kept."""
    made: list = []

    def own(value):
        if isinstance(value, mx.array):
            made.append(mx.array(value))
            return made[-1]
        if isinstance(value, (list, tuple)) and any(isinstance(v, mx.array) for v in value):
            return type(value)(own(v) for v in value)
        return value

    for layer in cache:
        for name, value in list(vars(layer).items()):
            new = own(value)
            if new is not value:
                setattr(layer, name, new)
    mx.eval(made)
    return cache


class SessionCaches:
    """The caches of the sessions not yet decoding, and the stored caches, of one rank."""

    def __init__(self, model, vocab: int, disk: Optional[DiskCache] = None):
        self.model = model
        self.vocab = vocab
        self.disk = disk  # this rank's --prompt-cache-dir (None: stored caches live in memory only)
        self._said_no_disk = False
        self.make_cache = lambda: make_cache(model)
        self.sessions: Dict[int, list] = {}  # prefilling, not yet in the batch
        self.stored: Dict[int, list] = {}
        self._said_no_merge = False  # prefill_batch's fallback is logged once

    def create(self, session: int, cache_id: int, mode: int, kv: int = 0) -> None:
        """A new session: a fresh cache (its KV quantized as `kv` says, kv_code), or stored
        cache `cache_id` moved or copied (quantized as it was made)."""
        if mode == FRESH:
            bits, group_size = kv_of_code(kv)
            cache = self.make_cache()
            if bits:
                from .quantized_cache import quantize_session_cache

                cache = quantize_session_cache(cache, bits, group_size)
            self.sessions[session] = cache
            return
        if cache_id not in self.stored:
            raise FrameError(f"SESSION_CREATE reuses stored cache {cache_id}, which does not exist")
        if mode == MOVE:
            self.sessions[session] = self.stored.pop(cache_id)
        elif mode == COPY:
            self.sessions[session] = copy.deepcopy(self.stored[cache_id])
        else:
            raise FrameError(f"SESSION_CREATE mode {mode} is not FRESH, MOVE or COPY")

    def rewind(self, session: int, keep: int) -> None:
        """Trim a (reused) session cache to its first `keep` tokens."""
        from mlx_lm.models.cache import trim_prompt_cache

        cache = self.session(session)
        size = cache[0].size() if cache else 0  # a model without layer caches holds nothing
        if keep > size:
            raise FrameError(f"REWIND session {session} to {keep} tokens, but it holds {size}")
        trim_prompt_cache(cache, size - keep)

    def prefill_batch(self, sessions: List[int], chunks: List[np.ndarray]) -> None:
        """One prefill chunk of each of several sessions that are not decoding yet, in one padded
        forward, as mlx-lm's PromptProcessingBatch.prompt processes prompts together (a reused
        cache joins the merge as it is); each row then goes back into its session's own cache,
        so joining the decode batch, destroying and storing a cache are unchanged. One row is
        fill_cache itself, bit for bit; a cache family mlx-lm cannot merge runs the rows one at
        a time (the same decision on both ranks: it depends on the model alone)."""
        caches = self._prefill_caches(sessions, chunks)
        batch = self._merged(caches) if len(sessions) > 1 and caches[0] else None
        if batch is None:
            for tokens, cache in zip(chunks, caches):
                fill_cache(self.model, tokens.tolist(), cache)
            return
        self._prefill_padded(batch, chunks)
        # The rows' own copies (owned: an extracted row may be a view of the padded batch), so
        # the padded batch's memory goes before the next forward.
        for i, session in enumerate(sessions):
            self.sessions[session] = owned([c.extract(i) for c in batch])
        # As mlx-lm after each prompt chunk: MLX keeps freed buffers for reuse, and a padded
        # forward's activations would otherwise stay held as the process's memory.
        mx.clear_cache()

    def _prefill_caches(self, sessions: List[int], chunks: List[np.ndarray]) -> List[list]:
        """The caches of a PREFILL_BATCH's rows; FrameError unless each session is here once
        with one non-empty chunk of ids in the vocabulary."""
        if len(set(sessions)) != len(sessions) or len(sessions) != len(chunks) or not sessions:
            raise FrameError(f"PREFILL_BATCH sessions {sessions} with {len(chunks)} chunks: "
                                "each session once, one non-empty chunk each")
        caches = [self.session(s) for s in sessions]
        for tokens in chunks:
            check_tokens(tokens, self.vocab)
            if len(tokens) == 0:
                raise FrameError("PREFILL_BATCH carries an empty chunk")
        return caches

    def _merged(self, caches: List[list]) -> Optional[list]:
        """The rows' caches merged as mlx-lm's batched prompt processing merges them, or None
        when this cache family cannot merge (the rows then go one at a time; logged once)."""
        from mlx_lm.generate import _merge_caches

        try:
            return _merge_caches(caches)
        except ValueError as exc:
            if not self._said_no_merge:
                log(f"prefill: prompts are prefilled one at a time ({exc})")
                self._said_no_merge = True
            return None

    def _prefill_padded(self, batch: list, chunks: List[np.ndarray]) -> None:
        """The chunks right-padded to the longest through the merged cache."""
        from mlx_lm.generate import _right_pad_prompts

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

    def session(self, session: int) -> list:
        """The cache of a session not yet decoding; FrameError for any other."""
        cache = self.sessions.get(session)
        if cache is None:
            raise FrameError(f"session {session} does not exist or is already decoding")
        return cache

    def take(self, session: int) -> list:
        """The cache of a session that joins the decode batch, no longer held here."""
        self.session(session)  # FrameError for a session not here
        return self.sessions.pop(session)

    def store(self, cache_id: int, cache: list) -> None:
        """Keep a destroyed session's cache as stored cache `cache_id` (its own arrays)."""
        if cache_id in self.stored:
            raise FrameError(f"SESSION_DESTROY stores under cache id {cache_id}, already taken")
        self.stored[cache_id] = owned(cache)

    def invalidate(self, cache_id: int) -> None:
        """Drop stored cache `cache_id`."""
        if self.stored.pop(cache_id, None) is None:
            raise FrameError(f"INVALIDATE names stored cache {cache_id}, which does not exist")

    def save(self, cache_id: int, tokens: Sequence[int], drop: bool) -> bool:
        """Hand stored cache `cache_id` (covering `tokens`) to this rank's directory's writer
        (it is written in the background, soon: DiskCache.save_later), then drop it from memory
        if `drop` (the writer holds what it writes); False when it will not be written (no
        directory here, a writer far behind: logged, the rank serves on). Only a cache leaving
        memory waits for room in the writer's queue; one that stays is written when it leaves."""
        cache = self.stored.get(cache_id)
        if cache is None:
            raise FrameError(f"DISK_SAVE names stored cache {cache_id}, which does not exist")
        written = self.disk.save_later(tokens, cache, wait=drop) if self.disk is not None else self._no_disk()
        if drop:
            del self.stored[cache_id]
        return written

    def load(self, cache_id: int, digest: bytes, count: int) -> bool:
        """Read this rank's half of the cache of the `count` tokens of `digest` as stored cache
        `cache_id`; False (logged) when this rank has no such file or it does not check out."""
        if cache_id in self.stored:
            raise FrameError(f"DISK_LOAD stores under cache id {cache_id}, already taken")
        cache = self.disk.load(digest, count) if self.disk is not None else self._no_disk()
        if not cache:
            return False
        self.stored[cache_id] = cache
        return True

    def _no_disk(self) -> bool:
        if not self._said_no_disk:
            log("prompt cache: the leader keeps prompt caches on disk but this rank was started "
                "without --prompt-cache-dir: its prefixes are recomputed (give both ranks the flag)")
            self._said_no_disk = True
        return False

    def stored_bytes(self, cache_id: int) -> int:
        """Bytes a stored cache's arrays take on this rank."""
        return sum(int(getattr(c, "nbytes", 0) or 0) for c in self.stored.get(cache_id, ()))
