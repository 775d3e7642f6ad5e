"""N ranks of a split model in one process, with no transport: each rank's code in its own
thread, one thread running at a time, the collectives done here.

mlx-lm's sharded layers, its MoE blocks and our vocabulary split all call
mx.distributed.all_sum / all_gather by attribute, so while `LocalRanks.run` runs they are
replaced: a rank that reaches one hands its (evaluated) input in and passes the turn to the next
rank; the last rank to arrive reduces the N inputs in rank order (((x0 + x1) + x2) + ...: the
small-message order of a group of N) and every rank carries on with that same array, so every
rank holds bitwise the same result. The ranks reach their collectives in the same order (they
run the same code on their parts), as in a real group; one thread runs at a time, so MLX is
never entered from two threads at once. Every wait has a timeout, and a rank that raises stops
the others.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import mlx.core as mx
import pytest

WAIT_S = 120.0


class RanksFailedError(RuntimeError):
    """A rank raised, or the ranks stopped meeting at their collectives."""


class LocalRanks:
    """run(fns): fns[r]() as rank r, the collectives reduced here; returns their results."""

    def __init__(self, size: int):
        self.size = size
        self._cond = threading.Condition()
        self._turn = 0
        self._inputs: list[Any] = [None] * size
        self._results: dict[int, mx.array] = {}
        self._round = [0] * size
        self._error: BaseException | None = None
        self._local = threading.local()

    # -- the baton -------------------------------------------------------------------------
    def _wait_turn(self, rank: int) -> None:
        ok = self._cond.wait_for(lambda: self._turn == rank or self._error is not None, timeout=WAIT_S)
        if self._error is not None:
            raise RanksFailedError(f"rank {rank} stopped: another rank failed") from self._error
        if not ok:
            raise RanksFailedError(f"rank {rank} waited {WAIT_S:.0f} s for its turn: the ranks' collectives differ")

    def _pass_turn(self, rank: int) -> None:
        self._turn = (rank + 1) % self.size
        self._cond.notify_all()

    def _collective(self, x: mx.array, reduce: Callable[[list[mx.array]], mx.array]) -> mx.array:
        rank = self._local.rank
        mx.eval(x)
        with self._cond:
            index = self._round[rank]
            self._round[rank] += 1
            self._inputs[rank] = x
            if rank == self.size - 1:
                result = reduce(list(self._inputs))
                mx.eval(result)
                self._results[index] = result
            self._pass_turn(rank)
            self._wait_turn(rank)
            return self._results[index]

    def all_sum(self, x: mx.array, group: Any = None, stream: Any = None) -> mx.array:
        def in_rank_order(inputs: list[mx.array]) -> mx.array:
            total = inputs[0]
            for more in inputs[1:]:
                total = total + more
            return total

        return self._collective(x, in_rank_order)

    def all_gather(self, x: mx.array, group: Any = None, stream: Any = None) -> mx.array:
        return self._collective(x, lambda inputs: mx.concatenate(inputs, axis=0))

    # -- running ---------------------------------------------------------------------------
    def _rank_main(self, rank: int, fn: Callable[[], Any], out: list) -> None:
        self._local.rank = rank
        with self._cond:
            try:
                self._wait_turn(rank)
            except RanksFailedError as exc:
                out[rank] = exc
                return
        try:
            out[rank] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to run(), which raises it
            out[rank] = exc
            with self._cond:
                self._error = self._error or exc
                self._cond.notify_all()
            return
        with self._cond:
            self._pass_turn(rank)

    def run(self, fns: Sequence[Callable[[], Any]]) -> list:
        """fns[r]() as rank r (mx.distributed's all_sum and all_gather reduced here meanwhile);
        their results in rank order, or the first error a rank raised."""
        assert len(fns) == self.size
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mx.distributed, "all_sum", self.all_sum)
            patch.setattr(mx.distributed, "all_gather", self.all_gather)
            out = self._run_threads(fns)
        errors = [o for o in out if isinstance(o, BaseException)]
        if errors:
            raise next((e for e in errors if not isinstance(e, RanksFailedError)), errors[0])
        return out

    def _run_threads(self, fns: Sequence[Callable[[], Any]]) -> list:
        out: list = [None] * self.size
        threads = [threading.Thread(target=self._rank_main, args=(r, fn, out), daemon=True)
                   for r, fn in enumerate(fns)]
        for thread in threads:
            thread.start()
        for rank, thread in enumerate(threads):
            thread.join(timeout=WAIT_S * 4)
            if thread.is_alive():
                with self._cond:
                    self._error = self._error or RanksFailedError(f"rank {rank} did not finish")
                    self._cond.notify_all()
                raise RanksFailedError(f"rank {rank} did not finish within {WAIT_S * 4:.0f} s")
        return out
