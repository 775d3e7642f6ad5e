"""`--split auto`: the share that makes different Macs finish each decode step together and fits
every one's memory, from what each rank measured at start (split/measure.py, carried by the
hello). Pure arithmetic: no model is read here.

Decode of a big model streams every weight once a token, so a rank's step takes its part of the
weights over its bandwidth: rank r keeping s_r / (s_0 + ... + s_{N-1}) of every split count makes
all ranks finish together. Machines whose speeds are all within 10% of each other split evenly:
the measurement is not finer than that, and an even split is what every other tool and recipe
assumes. choose_share_among takes the N ranks' figures (N = 2..8); choose_share is the pair's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from math import lcm
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

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
    """What the ranks hold together: the weights and the KV cache the command needs; the
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


def speed_parts(figures: Sequence[RankFigures]) -> tuple[Fraction, ...]:
    """Each rank's fraction that equalises the ranks' step times (rank 0's first); one part
    each when every speed is within EVEN_WITHIN of every other."""
    speeds = [f.speed for f in figures]
    if max(speeds) <= min(speeds) * EVEN_WITHIN:
        return (Fraction(1, len(speeds)),) * len(speeds)
    total = sum(speeds)
    head = [Fraction(speed, total).limit_denominator(1000) for speed in speeds[:-1]]
    return (*head, 1 - sum(head))


def speed_fraction(leader: RankFigures, worker: RankFigures) -> Fraction:
    """Rank 0's fraction that equalises a pair's step time; 1/2 within EVEN_WITHIN."""
    return speed_parts([leader, worker])[0]


def memory_caps(need: ModelNeed, figures: Sequence[RankFigures]) -> tuple[float, ...]:
    """The highest fraction of the model each rank's memory holds (its part, the margin and
    the reserve)."""
    scale = need.total * (1 + MARGIN_SHARE) or 1
    return tuple((f.memory_bytes - RESERVE_BYTES) / scale for f in figures)


def fitting_range(need: ModelNeed, leader: RankFigures, worker: RankFigures) -> Tuple[float, float]:
    """(lowest, highest) fraction rank 0 of a pair may keep so that both ranks' parts fit their
    memory."""
    highest, worker_highest = memory_caps(need, [leader, worker])
    return max(1 - worker_highest, 0.0), min(highest, 1.0)


def _names(size: int) -> list[str]:
    return [f"rank {r}" for r in range(size)]


def _refusal(need: ModelNeed, figures: Sequence[RankFigures]) -> ShareRefusedError:
    may = ", ".join(f"{name} may use {f.memory_bytes / _GIB:.2f} GiB"
                    for name, f in zip(_names(len(figures)), figures)) + "; free memory on any Mac"
    return ShareRefusedError(
        f"the model needs {need.total / _GIB:.2f} GiB ({need.weight_bytes / _GIB:.2f} GiB of weights, "
        f"{need.kv_bytes / _GIB:.2f} GiB of KV cache) plus {MARGIN_SHARE:.0%} and "
        f"{RESERVE_BYTES / _GIB:.1f} GiB a rank, and no share fits: {may}, lower the KV cache "
        f"(--max-kv-tokens, --max-tokens), or use a smaller (more quantized) model")


def _even_parts(share: SplitShare, size: int) -> tuple[float, ...]:
    parts = share.wanted(size)
    return tuple(p / sum(parts) for p in parts)


def choose_share_among(figures: Sequence[RankFigures], need: ModelNeed, *,
                       granules: int = CANDIDATE_GRANULES,
                       parts: Optional[Callable[[SplitShare], Sequence[float]]] = None) -> SplitShare:
    """The share of N ranks (their figures in rank order) with the shortest predicted step among
    those every rank's memory holds (the even one when speed_parts says even); ShareRefusedError
    naming every memory and the model's size when none does.

    granules, parts: what the model's counts allow (split/apply.ModelCuts): the candidates are
    the cuts into n units with n dividing `granules`, and `parts(share)` is the part of the
    weights each rank keeps when a load asks for `share` (its counts round each class of them);
    the memory is checked on those parts."""
    size = len(figures)
    for name, rank_figures in zip(_names(size), figures):
        if not rank_figures.measured:
            raise ValueError(f"split auto: {name} reported no figures (memory "
                             f"{rank_figures.memory_bytes}, speed {rank_figures.speed}); run every rank of "
                             f"this version, or give --split even or A:B")
    caps = memory_caps(need, figures)
    if min(caps) < 0 or sum(min(cap, 1.0) for cap in caps) < 1:
        raise _refusal(need, figures)
    wanted = speed_parts(figures)
    common = lcm(*(f.denominator for f in wanted))
    target = SplitShare(tuple(int(f * common) for f in wanted))
    kept = parts or (lambda share: _even_parts(share, size))
    # Quickest first (nearest_cuts orders by step time: speeds 2.1:1 cut in eighths give 3:1,
    # whose step is 0.75 of the faster rank's whole step, before the nearer 5:3 at 0.79).
    # Each `parts` runs the plan on twins; a model whose plan rounds every share the same way
    # (one that only splits evenly) needs no more than a few to show it.
    for cut in nearest_cuts(target, size, granules, caps=caps)[:KEPT_TRIES]:
        share = EVEN if cut.is_even else SplitShare(cut.counts)
        if all(part <= cap for part, cap in zip(kept(share), caps)):
            return share
    raise _refusal(need, figures)


def choose_share(leader: RankFigures, worker: RankFigures, need: ModelNeed, *,
                 granules: int = CANDIDATE_GRANULES,
                 kept: Callable[[SplitShare], float] = lambda share: share.fraction) -> SplitShare:
    """A pair's share (choose_share_among of two ranks): `kept(share)` is the part of the
    weights rank 0 keeps when a load asks for `share`."""
    def parts(share: SplitShare) -> tuple[float, float]:
        first = kept(share)
        return first, 1 - first

    return choose_share_among([leader, worker], need, granules=granules, parts=parts)


def figures_line(name: str, figures: RankFigures) -> str:
    """A rank's figures as the logs give them."""
    return (f"{name}: {figures.memory_bytes / _GIB:.2f} GiB usable, "
            f"{figures.speed / 1e9:.2f} GB/s on a matrix-vector product")


__all__ = ["CANDIDATE_GRANULES", "EVEN_WITHIN", "ModelNeed", "choose_share", "choose_share_among",
           "figures_line", "fitting_range", "memory_caps", "model_need", "speed_fraction", "speed_parts"]
