"""What the engine does with a step's tokens: each into its session (text out, logprobs, the
finish reason), then the sessions that finished ended on both ranks, a completed one's cache
stored for reuse. A mixin of serve.engine.Engine, whose state it reads and changes; kept apart
because the steps that make tokens (lockstep, pipelined, verified) all end here alike."""

from __future__ import annotations

from typing import Dict, List, Optional

import mlx.core as mx

from ..lockstep.sampling import logprob_item
from .requests import RunningSession


class Finishing:
    """Engine's token intake and session ends (see the module docstring)."""

    def _take(self, rows: List[RunningSession], new: List[Optional[List[int]]], errors: Dict[int, str],
              commit: bool, fixed_keep: Optional[Dict[int, int]] = None,
              logprobs: Optional[list] = None) -> None:
        """Each row's new tokens (None: its sampling failed) into its session, in order, until
        one ends it; with `commit` (a verify step), both ranks then keep in each row's cache the
        positions its session used, before any session ends."""
        outcomes, keep = [], []
        for i, (session, tokens) in enumerate(zip(rows, new)):
            finish, flush, used = ("failed", False, 1) if tokens is None else (None, True, 0)
            for token in tokens or ():
                used += 1
                try:
                    finish, flush = self._advance(session, token, None if logprobs is None else logprobs[i])
                except Exception as exc:  # noqa: BLE001 - this request's text, reported to it alone
                    errors[i] = f"{type(exc).__name__}: {exc}"
                    finish, flush = "failed", False
                if finish is not None:
                    break
            if fixed_keep and i in fixed_keep:  # a prompt chunk: all kept, no token yet
                used = fixed_keep[i]
                finish, flush = ("cancelled", False) if session.request.cancelled else (None, True)
            outcomes.append((finish, flush))
            keep.append(used)
        if commit:
            self.sessions.commit_batch(keep)
        self._running = []
        for i, (session, (finish, flush)) in enumerate(zip(rows, outcomes)):
            if finish is None:
                self._running.append(session)
            elif finish == "failed":
                # Leader-only work failed for this request: the pair is fine, and the
                # session ends on both ranks like an abandoned one.
                session.request.events.put(("failed", errors[i]))
                self._end(session, "cancelled", False)
            else:
                self._end(session, finish, flush)

    def _advance(self, session: RunningSession, token: int, logprobs: Optional[mx.array] = None) -> tuple:
        """Take a session's new token: (finish reason or None, whether held text is sent);
        logprobs: what it was drawn from, where not its leader-side sampler's last."""
        request = session.request
        session.generated.append(token)
        request.completion_tokens += 1
        self.stats["generated_tokens"] += 1
        if token in self.eos:
            return "stop", True
        if request.logprobs is not None:
            drawn_from = session.sampler.last_logprobs if logprobs is None else logprobs
            session.items.append(logprob_item(self.tokenizer, drawn_from, token, request.logprobs))
        text, stopped = session.text.add(token)
        if text:
            request.events.put(("text", text, session.items))
            session.items = []
        if stopped:
            return "stop", False  # whatever follows a stop string is never sent
        if len(session.generated) >= request.max_tokens:
            return "length", True
        if request.cancelled:
            return "cancelled", False
        session.next_input = token
        return None, True

    def _end(self, session: RunningSession, finish: str, flush: bool) -> None:
        """Free the session on both ranks; a completed one's cache is stored for reuse."""
        request = session.request
        self._reserved -= session.reserved
        if finish == "cancelled":
            self.sessions.destroy(session.sid, 0)
            self._owned.pop(id(request), None)
            return
        # The cache holds every token fed in: the prompt and all but the last sampled one, or
        # all of them when a pipelined step already took the last one in.
        fed = session.generated if session.fed_all else session.generated[:-1]
        cache_id, evicted = self.index.insert(request.prompt + fed)
        self.sessions.destroy(session.sid, cache_id)
        if cache_id:
            evicted += self.index.charge(cache_id, self.sessions.table.stored_bytes(cache_id))
        for old in evicted:
            self.sessions.invalidate(old)
        tail = session.text.finish() if flush else ""
        if tail or session.items:
            request.events.put(("text", tail, session.items))
        request.events.put(("done", finish))
        self._owned.pop(id(request), None)

    def _end_cancelled(self) -> None:
        for waiting in (self._prefilling, self._ready):
            for session in [s for s in waiting if s.request.cancelled]:
                waiting.remove(session)
                self._reserved -= session.reserved
                self.sessions.destroy(session.sid, 0)
                self._owned.pop(id(session.request), None)
