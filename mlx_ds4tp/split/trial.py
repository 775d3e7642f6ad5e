"""`--split auto`'s lockstep trial: both ranks time a stand-in decode step at each share
split/auto.trial_shares could not tell apart, and the leader loads the quicker.

Why a trial and not one more figure: each rank's matrix-vector speed is measured alone, but the
pair steps in lockstep through a gate every half layer, and a rank whose speed comes in bursts
(a core shared with another process, a Mac that throttles) loses more to that than its figure
shows. The stand-in step is what decode does on the rank's part: a vector times this rank's rows
of a layer-sized matrix and back (an MLP's two products), then the gate the model uses
(mx.distributed.all_sum over the pair's group), layer after layer, over 128 MiB in all (more
than any cache, as split/measure.py's product), one graph evaluated a step.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

from ..base.log import log
from .auto import leader_part
from .measure import PIECES, SIDE
from .share import SplitShare

# Seconds each share is timed a round, and the rounds (the shares alternate, so a slow spell of
# the machine falls on both): about a second at start for two shares.
TRIAL_SEC = 0.25
TRIAL_ROUNDS = 2
MIN_STEPS = 2


def step_ms(group: Any, share: SplitShare, seconds: float = TRIAL_SEC) -> float:
    """Milliseconds a stand-in decode step takes the pair at `share`; both ranks call it with
    the same share, and both run the same steps: the leader's clock decides when to stop, and
    its word rides the step's last gate."""
    import mlx.core as mx

    rank = group.rank()
    rows = round(leader_part(share) * SIDE)
    mine = rows if rank == 0 else SIDE - rows
    # Entries of 1/SIDE keep the vector's size steady through the layers: each rank's two
    # products give (its rows / SIDE) of the vector's mean, and the gate adds the two parts.
    pieces = [mx.full((mine, SIDE), 1.0 / SIDE, dtype=mx.float32) for _ in range(PIECES)]
    mx.eval(pieces)

    def step(vector, stop: float):
        # The leader's word to stop rides the last layer's gate: no gate beside the step's own.
        for piece in pieces[:-1]:
            vector = mx.distributed.all_sum((vector @ piece.T) @ piece, group=group)
        last = (vector @ pieces[-1].T) @ pieces[-1]
        summed = mx.distributed.all_sum(mx.concatenate([last, mx.array([[stop]])], axis=1), group=group)
        return summed[:, :SIDE], summed[0, SIDE]

    vector, _ = step(mx.ones((1, SIDE), dtype=mx.float32), 0.0)
    mx.eval(vector)  # kernels warm and the buffers allocated before the clock
    steps, start = 0, time.perf_counter()
    while True:
        done = rank == 0 and steps >= MIN_STEPS and time.perf_counter() - start >= seconds
        vector, stop = step(vector, 1.0 if done else 0.0)
        mx.eval(vector, stop)
        steps += 1
        if stop.item() > 0:
            break
    return (time.perf_counter() - start) * 1e3 / steps


def quickest_share(group: Any, shares: List[SplitShare], tell: Callable[[SplitShare], None]) -> SplitShare:
    """The leader's side: each share told to the worker (`tell`) and timed, TRIAL_ROUNDS rounds
    in turn; the share of the shortest mean step, logged with every figure."""
    taken: Dict[SplitShare, List[float]] = {share: [] for share in shares}
    for _ in range(TRIAL_ROUNDS):
        for share in shares:
            tell(share)
            taken[share].append(step_ms(group, share))
    means = {share: sum(ms) / len(ms) for share, ms in taken.items()}
    quickest = min(shares, key=lambda share: means[share])
    figures = ", ".join(f"{share} {means[share]:.1f} ms" for share in shares)
    log(f"split auto: lockstep trial, a stand-in step at {figures}: {quickest}")
    return quickest


__all__ = ["MIN_STEPS", "TRIAL_ROUNDS", "TRIAL_SEC", "quickest_share", "step_ms"]
