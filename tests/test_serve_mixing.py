"""serve.engine.mixing and the scheduler's mixes(): the leader's turn-by-turn choice between a mixed
decode step and a prefill forward of its own, from the costs it measured (fed here by hand, so no
timing luck)."""

from __future__ import annotations

import pytest

from mlx_ds4tp.serve.engine.mixing import PROBE_EVERY, MixChoice
from mlx_ds4tp.serve.engine.schedule import mixes


def _mix(choice: MixChoice) -> bool:
    """One turn's choice, counted as the engine counts it when the plan says it was measured."""
    mix, decided = mixes(choice.estimates())
    if decided:
        choice.decided()
    return mix


def _measured(separate_us: float, decode_ms: float, mixed_ms: float, tokens: int = 8) -> MixChoice:
    choice = MixChoice()
    choice.prefill_timed(separate_us * 1e-6 * 100, 100)
    choice.decode_timed(decode_ms * 1e-3)
    choice.mixed_timed(mixed_ms * 1e-3, tokens)
    return choice


def test_it_measures_the_separate_forward_first_then_tries_the_mixed_step():
    choice = MixChoice()
    assert _mix(choice) is False  # nothing measured: a prefill forward of its own
    choice.prefill_timed(0.05, 100)
    assert _mix(choice) is False  # no plain decode step measured yet
    choice.decode_timed(0.01)
    assert _mix(choice) is True  # the mixed step is tried
    assert choice.figures() == {"mixed_prefill_policy": "cheaper", "separate_prefill_us_per_token": 500.0,
                                "mixed_prefill_us_per_token": None}
    # A mixed step whose decode rows carried drafts (3 wide) has no decode step to stand
    # beside yet: not counted, and until one is, it is tried again every PROBE_EVERY turns.
    choice.mixed_timed(0.02, 8, width=3)
    assert choice.mixed_per_token is None
    picks = [_mix(choice) for _ in range(PROBE_EVERY)]
    assert picks == [False] * (PROBE_EVERY - 1) + [True]
    choice.decode_timed(0.018, width=3)
    choice.mixed_timed(0.02, 8, width=3)
    assert choice.mixed_per_token == pytest.approx(0.002 / 8)


def test_the_cheaper_kind_per_prompt_token_wins_and_the_other_is_probed():
    # Bandwidth-bound (a Mac): 8 prompt tokens add 0.4 ms to a 10 ms step, 50 us a token,
    # against 500 us a token in a forward of their own.
    cheap = _measured(separate_us=500, decode_ms=10, mixed_ms=10.4)
    picks = [_mix(cheap) for _ in range(2 * PROBE_EVERY + 1)]
    assert [i for i, p in enumerate(picks) if not p] == [PROBE_EVERY, 2 * PROBE_EVERY]
    # Compute-bound (this CPU): the decode rows padded to 4 positions cost 4 times theirs.
    dear = _measured(separate_us=500, decode_ms=10, mixed_ms=40)
    picks = [_mix(dear) for _ in range(2 * PROBE_EVERY + 1)]
    assert [i for i, p in enumerate(picks) if p] == [PROBE_EVERY, 2 * PROBE_EVERY]


def test_the_estimates_follow_a_change_in_cost():
    choice = _measured(separate_us=500, decode_ms=10, mixed_ms=10.4)
    assert _mix(choice) is True
    for _ in range(12):  # the mixed steps grow dear (a longer batch, say)
        choice.mixed_timed(0.05, 8)
    assert _mix(choice) is False
    # A step slower than the plain decode estimate never makes a negative cost.
    choice.mixed_timed(0.001, 8)
    assert choice.mixed_per_token >= 0


def test_always_mixes_and_a_bad_policy_is_named():
    assert _mix(MixChoice("always")) is True
    with pytest.raises(ValueError, match="'sometimes': give one of cheaper, always"):
        MixChoice("sometimes")
