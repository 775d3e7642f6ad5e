"""The leader's index of stored prompt caches: which cache a new request reuses, and where.

Both ranks hold the KV caches themselves (each its half of the heads); only the leader holds
this index, and every decision it takes (reuse this cache, moved or copied, trimmed to this
many tokens; evict that one) travels to the worker as a command, so the worker never decides
anything on its own and the ranks cannot drift apart. The search is mlx-lm's own PromptTrie
(what its LRUPromptCache uses); the values are cache ids instead of caches.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

# How a session starts from a stored cache (the values travel in SESSION_CREATE).
FRESH, MOVE, COPY = 0, 1, 2

# PromptTrie keys its entries by model too; one server serves one model.
_MODEL = "model"


@dataclasses.dataclass(frozen=True)
class Reuse:
    """What a new session starts from: `cache_id` (0: a fresh cache), taken as is (MOVE) or
    as a copy (COPY), then trimmed to its first `keep` tokens."""

    cache_id: int = 0
    mode: int = FRESH
    keep: int = 0
    stored_len: int = 0

    @property
    def needs_rewind(self) -> bool:
        return self.mode != FRESH and self.keep < self.stored_len


class PromptCacheIndex:
    """A bounded LRU of stored prompt caches keyed by their tokens."""

    def __init__(self, max_size: int = 10, trimmable: bool = True, max_bytes: int = 0):
        from mlx_lm.models.cache import PromptTrie

        if max_size < 0:
            raise ValueError(f"prompt cache size {max_size} must be >= 0 (0 disables reuse)")
        if max_bytes < 0:
            raise ValueError(f"prompt cache bytes {max_bytes} must be >= 0 (0: no bound)")
        self.max_size = max_size
        # Stored caches' bytes (each rank's own: both hold the same share), bounded by
        # max_bytes (0: only max_size bounds them).
        self.max_bytes = max_bytes
        self._bytes: Dict[int, int] = {}
        self.trimmable = trimmable
        self._trie = PromptTrie()
        self._lru: "OrderedDict[int, Tuple[int, ...]]" = OrderedDict()
        self._next_id = 0
        # The tokens of the caches evicted for room (least recently used), by id, until the
        # caller takes them (take_evicted_keys): with --prompt-cache-dir they go to disk. A
        # cache evicted because a longer stored one covers it is not among them.
        self._evicted_keys: Dict[int, Tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, prompt: Sequence[int]) -> Reuse:
        """The longest stored prefix of `prompt` to start from. At least the prompt's last
        token is always left to compute: the session needs its logits."""
        found = self._find(prompt)
        return self._take(*found) if found is not None else Reuse()

    def reusable(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens lookup would reuse, without taking anything."""
        found = self._find(prompt)
        return found[1] if found is not None else 0

    def _find(self, prompt: Sequence[int]) -> Optional[Tuple[Tuple[int, ...], int, int]]:
        if not self._lru or len(prompt) < 2:
            return None
        tokens = list(prompt)
        found = self._trie.search(_MODEL, tokens)
        shorter = len(found.shorter) if found.shorter is not None else 0
        if found.exact is not None:
            # Its copy is trimmed by the prompt's last token, which an untrimmable cache cannot.
            return (tuple(tokens), len(tokens) - 1, COPY) if self.trimmable else None
        if found.longer is not None and found.common_prefix > shorter and self.trimmable:
            keep = min(len(tokens) - 1, found.common_prefix)
            return tuple(found.longer), keep, COPY
        if shorter > 0:
            # A stored prefix of the prompt: the new session extends it and stores the longer
            # sequence when it ends, which covers this one, so the cache moves instead of
            # being copied.
            return tuple(found.shorter), shorter, MOVE
        return None

    def _take(self, key: Tuple[int, ...], keep: int, mode: int) -> Reuse:
        cache_id = self._trie.get(_MODEL, list(key))
        if mode == MOVE:
            self.remove(cache_id)
        else:
            self._lru.move_to_end(cache_id)
        return Reuse(cache_id=cache_id, mode=mode, keep=keep, stored_len=len(key))

    def insert(self, tokens: Sequence[int]) -> Tuple[int, List[int]]:
        """Store a finished session's cache covering `tokens`: (its new id, or 0 when the
        index is disabled, and the ids evicted to make room, which both ranks must drop)."""
        if self.max_size == 0 or not tokens:
            return 0, []
        self._next_id += 1
        cache_id = self._next_id
        key = list(tokens)
        evicted: List[int] = []
        previous = self._trie.add(_MODEL, key, cache_id)
        if previous is not None:
            del self._lru[previous]
            evicted.append(previous)
        self._lru[cache_id] = tuple(key)
        if self.trimmable:
            # A stored strict prefix of this sequence is covered by it (reused by trimming).
            for _, prefix_id in self._trie.pop_prefixes(_MODEL, key):
                del self._lru[prefix_id]
                evicted.append(prefix_id)
        while len(self._lru) > self.max_size:
            evicted.append(self._evict_oldest())
        for gone in evicted:
            self._bytes.pop(gone, None)
        return cache_id, evicted

    def charge(self, cache_id: int, nbytes: int) -> List[int]:
        """Record a stored cache's size; the ids evicted (least recently used first, the new
        one too if it alone is past max_bytes) to keep all within max_bytes."""
        if cache_id not in self._lru:
            return []
        self._bytes[cache_id] = nbytes
        evicted: List[int] = []
        while self.max_bytes and self.nbytes() > self.max_bytes and self._lru:
            evicted.append(self._evict_oldest())
        return evicted

    def remove(self, cache_id: int) -> None:
        """Forget stored cache `cache_id` (one whose load from disk failed, or one a session moves)."""
        key = self._lru.pop(cache_id)
        self._trie.pop(_MODEL, list(key))
        self._bytes.pop(cache_id, None)

    def nbytes(self) -> int:
        """Bytes the stored caches take (as charged)."""
        return sum(self._bytes.get(i, 0) for i in self._lru)

    def _evict_oldest(self) -> int:
        old_id, old_key = self._lru.popitem(last=False)
        self._trie.pop(_MODEL, list(old_key))
        self._bytes.pop(old_id, None)
        self._evicted_keys[old_id] = old_key
        return old_id

    def take_evicted_keys(self) -> Dict[int, Tuple[int, ...]]:
        """The tokens of the caches evicted for room since the last call, by id."""
        keys, self._evicted_keys = self._evicted_keys, {}
        return keys

    def entries(self) -> List[Tuple[int, Tuple[int, ...]]]:
        """(id, tokens) of every stored cache, least recently used first."""
        return list(self._lru.items())

    def ids(self) -> List[int]:
        """The stored ids, least recently used first."""
        return list(self._lru)
