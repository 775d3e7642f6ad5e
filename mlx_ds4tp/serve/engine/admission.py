"""The lifetime of requests' sessions on both ranks, as the scheduler (serve/engine/schedule.py)
decides who starts: the waiting queue, the KV budget's accounting, and the index of stored
prompt caches, in memory and with --prompt-cache-dir on
disk (docs/serving.md's "Bounded memory", "Prompt cache" and "Prompt cache on disk" say what each
does). Every request between its start and its end is owned here, so the pair going down
reaches each of them, whatever a step was doing with its session.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

from ...lockstep.batch import Batch, Row
from ...lockstep.caches.prompt_cache import PromptCacheIndex
from ...lockstep.caches.session_caches import kv_code
from ...lockstep.protocol.commands import DiskSave, Invalidate
from ...lockstep.protocol.sessions import LeaderSessions
from ...lockstep.request import GenerationRequest
from ..limits import ServeLimits
from .events import BusyEvent, PairDownEvent, StartedEvent
from .generation import Ticket


def _index(sessions: LeaderSessions, limits: ServeLimits) -> PromptCacheIndex:
    return PromptCacheIndex(limits.prompt_cache_size, sessions.caches_trim(), limits.prompt_cache_bytes)


class Admission:
    """The waiting queue, the KV budget's accounting and the prompt-cache index (see the module
    docstring). Who starts, waits or is refused is the scheduler's (serve/engine/schedule.py);
    this carries it out."""

    def __init__(self, batch: Batch, limits: ServeLimits):
        self.batch = batch
        self.limits = limits
        self.kv_budget, self.max_queued = limits.kv_budget, limits.max_queued
        # Every fresh session's cache is quantized so (0: float): the same for all, so that
        # sessions merge into one decode batch.
        self.kv = kv_code(limits.kv_bits, limits.kv_group_size)
        self.index = _index(batch.sessions, limits)
        self.waiting: Dict[int, Ticket] = {}  # by ticket id, in arrival order
        self.reserved = 0
        self.started: Dict[int, Ticket] = {}  # by row id: every request between its start and its end
        self.row_of: Dict[int, int] = {}  # ticket id -> row id
        self.stats = {"requests": 0, "cached_tokens": 0}
        if self.disk is not None:
            self.stats.update(disk_hits=0, disk_tokens=0, disk_load_ms=0, disk_load_failures=0)

    def check(self, request: GenerationRequest) -> None:
        """ValueError when the request could never fit the budget, however long it waited."""
        need = request.kv_tokens
        if self.kv_budget and need > self.kv_budget:
            raise ValueError(f"the prompt and max_tokens need {need} cache tokens, more than the "
                             f"server's whole budget (--max-kv-tokens {self.kv_budget}); send a "
                             "shorter prompt or a smaller max_tokens")

    def queue(self, ticket: Ticket) -> None:
        """A request waits behind the others (the scheduler starts it, or refuses it)."""
        self.waiting[ticket.id] = ticket

    def drop(self, ticket_id: int) -> None:
        """A waiting request cancelled: it leaves the queue, nobody to tell."""
        self.waiting.pop(ticket_id)

    def refuse(self, ticket_id: int) -> None:
        """A waiting request refused: too many already wait for room (BusyEvent)."""
        self.waiting.pop(ticket_id).events.put(BusyEvent(
            f"{self.max_queued} requests already wait for room in the KV budget "
            f"(--max-kv-tokens {self.kv_budget}, --max-queued {self.max_queued}); retry shortly"))

    def start(self, ticket_id: int) -> Row:
        """Start a waiting request: its KV tokens reserved, the longest stored prefix of its
        prompt found (in memory, or loaded from disk), its session made on every rank; its row."""
        ticket = self.waiting.pop(ticket_id)
        request = ticket.request
        self._from_disk(request.prompt)
        reuse = self.index.lookup(request.prompt)
        row = self.batch.row(self.batch.insert(request, reuse, self.kv))
        self.reserved += request.kv_tokens
        self.started[row.id] = ticket
        self.row_of[ticket.id] = row.id
        self.stats["requests"] += 1
        self.stats["cached_tokens"] += reuse.keep
        ticket.events.put(StartedEvent(reuse.keep))
        return row

    def close(self, row: Row, fed: Optional[List[int]]) -> None:
        """End a session on every rank and hand its reservation back; `fed`: the tokens its
        cache holds, to store it for reuse under, or None to drop it (an abandoned session)."""
        if fed is None:
            self.batch.remove(row.id)
        else:
            cache_id, evicted = self.index.insert(fed)
            self.batch.remove(row.id, cache_id)
            if cache_id and self.disk is not None:
                # Written through: both ranks' writers have it on disk moments from now, so a
                # stop of any kind (a kill -9 too) keeps it; eviction then only drops it.
                self.sessions.send(DiskSave, cache_id, fed, False)
            if cache_id:
                evicted += self.index.charge(cache_id, self.sessions.stored_bytes(cache_id))
            self._drop(evicted)
        self.reserved -= row.request.kv_tokens
        ticket = self.started.pop(row.id, None)
        if ticket is not None:
            self.row_of.pop(ticket.id, None)

    @property
    def sessions(self) -> LeaderSessions:
        """The pair's sessions the batch drives (a pair joined anew: the new one's)."""
        return self.batch.sessions

    @property
    def disk(self):
        """The leader's --prompt-cache-dir (lockstep.caches.disk_cache.DiskCache), or None."""
        return self.sessions.disk

    def _drop(self, evicted: List[int]) -> None:
        """Drop evicted stored caches on both ranks; those evicted for room go to disk first."""
        keys = self.index.take_evicted_keys()
        for old in evicted:
            if self.disk is not None and old in keys:
                self.sessions.send(DiskSave, old, keys[old], True)
            else:
                self.sessions.send(Invalidate, old)

    def _from_disk(self, prompt: Sequence[int]) -> None:
        """Load the longest prefix of `prompt` stored on disk as a stored cache on both ranks,
        when it reuses more tokens than memory holds; lookup then takes it as any other."""
        disk = self.disk
        if disk is None or self.index.max_size == 0:
            return
        tokens, keep = disk.find(prompt, self.index.trimmable)
        if tokens is None or keep <= self.index.reusable(prompt):
            return
        began = time.perf_counter()
        key = tokens.tolist()
        cache_id, evicted = self.index.insert(key)
        # Loaded before the evicted caches go to disk: writing them may make room by removing
        # the very file this load is about to read.
        loaded = self.sessions.disk_load(cache_id, key)
        self._drop(evicted)
        if not loaded:
            self.index.remove(cache_id)
            disk.discard(key)  # useless without the worker's half: never chosen again
            self.stats["disk_load_failures"] += 1
            return
        self._drop(self.index.charge(cache_id, self.sessions.stored_bytes(cache_id)))
        self.stats["disk_hits"] += 1
        self.stats["disk_tokens"] += keep
        self.stats["disk_load_ms"] += int(1000 * (time.perf_counter() - began))

    def fail(self, message: str) -> None:
        """The pair is down: every request under way or waiting gets PairDownEvent(message)."""
        tickets = list(self.started.values()) + list(self.waiting.values())
        self.started, self.row_of, self.waiting = {}, {}, {}
        for ticket in tickets:
            ticket.events.put(PairDownEvent(message))
        self.reserved = 0

    def renew(self) -> None:
        """Admit onto a pair joined anew (the batch now drives it): the stored caches went with
        the old worker, so the index starts empty."""
        self.index = _index(self.sessions, self.limits)
        self.reserved = 0
