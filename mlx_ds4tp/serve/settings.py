"""What one rank of `ds4tp serve` runs with, beside its ServeLimits: the model served, the HTTP
front, and the whole of it as one object; cli/serve.py makes them once from the flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from ..checkpoint.parts_cache import PartsSettings
from ..link.config import LinkSettings
from ..lockstep.sampling.options import SamplingOptions
from ..lockstep.settings import DraftSettings
from ..split.share import SplitSettings
from .limits import ServeLimits


@dataclass(frozen=True)
class ServedModel:
    """The model this rank loads its half of, the ids requests may name it by, and the
    leader's drafting (lockstep.settings.DraftSettings: a whole draft model, or prompt lookup
    N-grams; neither: no drafts)."""

    path: Optional[Path]              # None: a worker that receives its part from the leader
    name: str                         # the id /v1/models lists
    aliases: Tuple[str, ...] = ()     # other ids a request may give (--model as given, its path)
    draft: DraftSettings = DraftSettings()

    @property
    def ids(self) -> Tuple[str, ...]:
        """name first, then the aliases that differ from it, each once."""
        return tuple(dict.fromkeys((self.name, *self.aliases)))


@dataclass(frozen=True)
class HttpSettings:
    """The leader's HTTP front: where it listens, who may call, how long a client may take to
    send its request's headers and then its body, or keep an idle connection, and what a request
    that names no max_tokens or sampling gets."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    keepalive_sec: float = 10.0       # a stream not started after this gets an SSE comment
    default_max_tokens: int = 512
    sampling: SamplingOptions = SamplingOptions()
    header_timeout_sec: float = 10.0  # headers not in by then: closed; a body not in as long after: 408
    keep_alive_timeout_sec: float = 5.0  # a connection idle this long after an answer closes


@dataclass(frozen=True)
class ServeSettings:
    """One rank of `ds4tp serve`. kv_budget_from_memory: --max-kv-tokens was not given, so
    the leader sizes limits.kv_budget from what the machine's memory holds once the weights
    are in. rejoin: the worker outlives its leader and waits for the next one. split: this
    rank's --split (the leader's decides, and a worker taken back gets the same)."""

    link: LinkSettings
    model: ServedModel
    limits: ServeLimits = ServeLimits()
    http: HttpSettings = HttpSettings()
    kv_budget_from_memory: bool = False
    rejoin: bool = False
    split: SplitSettings = SplitSettings()
    parts: PartsSettings = PartsSettings()  # a worker without --model: where its part is kept
    shrink_after: float = 30.0  # the leader: a lost worker's wait before the ranks left serve (0: never)
