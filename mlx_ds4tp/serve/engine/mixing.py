"""Whether a decode step carries the prompts still prefilling (`--mixed-prefill N`), decided
turn by turn from what the leader measures.

A mixed step is one forward for both: the decode rows and N prompt tokens of each prefilling
row, right-padded to one width. Where a forward is bound by reading the weights (decode on a
Mac), the prompt tokens ride almost free, and the running sessions never wait for a separate
prefill forward. Where it is bound by compute (this kind of CPU), every padded position costs,
and the decode rows padded to N positions cost about N times theirs: two forwards are cheaper.
Which holds depends on the machine, the model and the batch, so the leader times both and
takes, each turn, the one whose cost per prompt token is lower:

  separate: a prefill forward's seconds / the prompt tokens it carried
  mixed:    (a mixed step's seconds - a plain decode step's) / the prompt tokens it carried

(the decode step is paid either way). The estimates are moving averages; until both exist
the missing one is measured, and every PROBE_EVERY decisions the other kind is tried once so a
change in load is seen (a mixed step is set beside a decode step of its own width: with
drafts, a decode row is wider than one position). This module measures; the choice itself is
the scheduler's (serve/engine/schedule.py:mixes). Only the leader decides: the worker runs
the commands it is sent.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

POLICIES = ("cheaper", "always")
PROBE_EVERY = 16
WEIGHT = 0.25  # of the newest measurement in each moving average


def _blend(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new


@dataclasses.dataclass(frozen=True)
class MixEstimates:
    """What the choice is made from (serve/engine/schedule.py:mixes makes it): the policy, the
    seconds per prompt token of each kind (None: not measured yet), whether a plain decode step
    was timed, and the measured decisions made so far."""

    policy: str = "cheaper"
    separate_per_token: Optional[float] = None
    mixed_per_token: Optional[float] = None
    decode_timed: bool = False
    decisions: int = 0


class MixChoice:
    """The measurements the mixed batch's choice is made from (see the module docstring).
    policy "always" mixes whenever there is something to mix."""

    def __init__(self, policy: str = "cheaper"):
        if policy not in POLICIES:
            raise ValueError(f"mixed prefill policy {policy!r}: give one of {', '.join(POLICIES)}")
        self.policy = policy
        self.separate_per_token: Optional[float] = None
        self.mixed_per_token: Optional[float] = None
        # A decode step's seconds by its width (1 + the drafts of its widest row): a mixed
        # step's decode rows are compared with a step as wide as theirs.
        self.decode_step: Dict[int, float] = {}
        self._decisions = 0

    def estimates(self) -> MixEstimates:
        """The measurements now, as the scheduler reads them."""
        return MixEstimates(self.policy, self.separate_per_token, self.mixed_per_token, bool(self.decode_step),
                            self._decisions)

    def decided(self) -> None:
        """A measured decision was made (the scheduler's plan says so): the probes count these."""
        self._decisions += 1

    def prefill_timed(self, seconds: float, tokens: int) -> None:
        """A prefill forward of its own took `seconds` for `tokens` prompt tokens."""
        if tokens > 0:
            self.separate_per_token = _blend(self.separate_per_token, seconds / tokens)

    def decode_timed(self, seconds: float, width: int = 1) -> None:
        """A decode step without prompt rows, `width` positions wide, took `seconds`."""
        self.decode_step[width] = _blend(self.decode_step.get(width), seconds)

    def mixed_timed(self, seconds: float, tokens: int, width: int = 1) -> None:
        """A mixed step carrying `tokens` prompt tokens, its decode rows `width` wide, took
        `seconds` (not counted until a decode step of that width has been timed)."""
        base = self.decode_step.get(width)
        if tokens > 0 and base is not None:
            self.mixed_per_token = _blend(self.mixed_per_token, max(seconds - base, 0.0) / tokens)

    def figures(self) -> dict:
        """The estimates, in microseconds per prompt token (for /health)."""
        def us(value: Optional[float]) -> Optional[float]:
            return None if value is None else round(value * 1e6, 1)

        return {"mixed_prefill_policy": self.policy,
                "separate_prefill_us_per_token": us(self.separate_per_token),
                "mixed_prefill_us_per_token": us(self.mixed_per_token)}
