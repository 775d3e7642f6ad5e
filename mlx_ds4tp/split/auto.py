"""`--split auto`: the share that makes two different Macs finish each decode step together and
fits both memories, from what each rank measured at start (split/measure.py, carried by the
hello). Pure arithmetic: no model is read here.

Decode of a big model streams every weight once a token, so a rank's step takes its part of the
weights over its bandwidth: rank 0 keeping s0 / (s0 + s1) of every split count makes both ranks
finish together. Two machines within 10% of each other split evenly: the measurement is not
finer than that, and an even split is what every other tool and recipe assumes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional, Tuple

from ..link.hello import RankFigures
from .errors import ShareRefusedError
from .share import EVEN, SplitShare, nearest_cuts

# Two ranks whose speeds differ by at most this factor split evenly.
EVEN_WITHIN = 1.10
# On top of a rank's part of the weights and the KV cache: MLX's buffers, a prefill chunk's
# activations (a share of the part), and the process, tokenizer and runtime (a floor).
MARGIN_SHARE = 0.10
RESERVE_BYTES = 512 << 20
# The shares auto picks from: every A:B of up to 63 units whose count divides this (2 to 10,
# 12, 15, 16, 18, 20, ...); the load then takes the nearest the model's counts allow.
CANDIDATE_GRANULES = 5040
# The candidate shares choose_share asks the model's plan about before it gives up.
KEPT_TRIES = 4
_GIB = 1 << 30


@dataclass(frozen=True)
class ModelNeed:
    """What the two ranks hold together: the weights and the KV cache the command needs; the
    model's directory, whose plan says which shares a load can take (split/apply.ModelCuts)."""

    weight_bytes: int
    kv_bytes: int = 0
    path: Optional[Path] = None

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


def model_need(path: Path, kv_tokens: int) -> ModelNeed:
    """The model's weights (its .safetensors files' sizes) and `kv_tokens` tokens of KV cache
    (every layer's keys and values in the model's float type), read off its directory."""
    path = Path(path)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    heads = int(text.get("num_attention_heads", 0) or 0)
    kv_heads = int(text.get("num_key_value_heads", heads) or heads)
    head_dim = int(text.get("head_dim") or (int(text.get("hidden_size", 0)) // heads if heads else 0))
    layers = int(text.get("num_hidden_layers", 0) or 0)
    width = 4 if str(config.get("torch_dtype", "")) == "float32" else 2
    return ModelNeed(weights, max(kv_tokens, 0) * layers * kv_heads * head_dim * 2 * width, path)


def speed_fraction(leader: RankFigures, worker: RankFigures) -> Fraction:
    """Rank 0's fraction that equalises the two ranks' step time; 1/2 within EVEN_WITHIN."""
    fast, slow = max(leader.speed, worker.speed), min(leader.speed, worker.speed)
    if fast <= slow * EVEN_WITHIN:
        return Fraction(1, 2)
    return Fraction(leader.speed, leader.speed + worker.speed).limit_denominator(1000)


def fitting_range(need: ModelNeed, leader: RankFigures, worker: RankFigures) -> Tuple[float, float]:
    """(lowest, highest) fraction rank 0 may keep so that both ranks' parts fit their memory."""
    scale = need.total * (1 + MARGIN_SHARE) or 1
    highest = (leader.memory_bytes - RESERVE_BYTES) / scale
    lowest = 1 - (worker.memory_bytes - RESERVE_BYTES) / scale
    return max(lowest, 0.0), min(highest, 1.0)


def _refusal(need: ModelNeed, leader: RankFigures, worker: RankFigures) -> ShareRefusedError:
    return ShareRefusedError(
        f"the model needs {need.total / _GIB:.2f} GiB ({need.weight_bytes / _GIB:.2f} GiB of weights, "
        f"{need.kv_bytes / _GIB:.2f} GiB of KV cache) plus {MARGIN_SHARE:.0%} and "
        f"{RESERVE_BYTES / _GIB:.1f} GiB a rank, and no share fits: the leader may use "
        f"{leader.memory_bytes / _GIB:.2f} GiB and the worker {worker.memory_bytes / _GIB:.2f} GiB; "
        f"free memory on either Mac, lower the KV cache (--max-kv-tokens, --max-tokens), or use "
        f"a smaller (more quantized) model")


def choose_share(leader: RankFigures, worker: RankFigures, need: ModelNeed, *,
                 granules: int = CANDIDATE_GRANULES,
                 kept: Callable[[SplitShare], float] = lambda share: share.fraction) -> SplitShare:
    """The share with the shortest predicted step among those both memories hold (the even one
    when speed_fraction says even); ShareRefusedError naming both memories and the model's size when
    none does.

    granules, kept: what the model's counts allow (split/apply.ModelCuts): the candidates are
    the shares u/n with n dividing `granules`, and `kept(share)` is the part of the weights
    rank 0 keeps when a load asks for it (its counts round each class of them); the memory is
    checked on that part."""
    for name, figures in (("leader", leader), ("worker", worker)):
        if not figures.measured:
            raise ValueError(f"split auto: the {name} reported no figures (memory "
                             f"{figures.memory_bytes}, speed {figures.speed}); run both ranks of "
                             f"this version, or give --split even or A:B")
    lowest, highest = fitting_range(need, leader, worker)
    if lowest > highest:
        raise _refusal(need, leader, worker)
    wanted = speed_fraction(leader, worker)
    target = SplitShare((wanted.numerator, wanted.denominator - wanted.numerator))
    # Quickest first (nearest_cuts orders by step time: speeds 2.1:1 cut in eighths give 3:1,
    # whose step is 0.75 of the faster rank's whole step, before the nearer 5:3 at 0.79).
    fitting = [cut for cut in nearest_cuts(target, 2, granules) if lowest <= cut.counts[0] / cut.units <= highest]
    # Each `kept` runs the plan on twins; a model whose plan rounds every share the same way
    # (one that only splits evenly) needs no more than a few to show it.
    for cut in fitting[:KEPT_TRIES]:
        share = EVEN if cut.is_even else SplitShare(cut.counts)
        if lowest <= kept(share) <= highest:
            return share
    raise _refusal(need, leader, worker)


def figures_line(name: str, figures: RankFigures) -> str:
    """A rank's figures as the logs give them."""
    return (f"{name}: {figures.memory_bytes / _GIB:.2f} GiB usable, "
            f"{figures.speed / 1e9:.2f} GB/s on a matrix-vector product")


__all__ = ["CANDIDATE_GRANULES", "EVEN_WITHIN", "ModelNeed", "choose_share",
           "figures_line", "fitting_range", "model_need", "speed_fraction"]
