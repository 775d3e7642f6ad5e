"""One bring-up for every rank of `ds4tp run`, `ds4tp serve` and `ds4tp demo`, and for every
re-join: join the group (a pair, or a mesh of `link.size` ranks), agree the share (the
leader's, split.agree), load this rank's part of the model (load_split), and hand back what the
rank then runs on. The rank count is the link's `size`, never a constant: the same code brings
up two ranks or four."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .. import gate_ops
from ..base.log import log
from ..checkpoint.parts_cache import PartsSettings
from ..errors import AuthenticationError, HelloMismatchError, TransportError
from ..link.config import LinkSettings
from ..link.hello import ModelIdentity
from ..split.agree import agree_share, with_figures
from ..split.auto import ModelNeed, model_need
from ..split.part_delivery import load_rank_part, parts_after_rejoin
from ..split.progress import LoadingBar
from ..split.share import SplitSettings, SplitShare


@dataclasses.dataclass(frozen=True)
class BringUp:
    """How one rank comes up: its link (link.size: the rank count), the model's directory and
    the model's identity its hello checks, its --split, the KV cache tokens the leader reserves
    room for when it picks a share, and whether a worker waits for its leader however long that
    takes (serve's --rejoin: a supervisor may start the worker first). A worker without the model
    (model_path None, identity PART_RECEIVER) receives its part from the leader into `parts`."""

    link: LinkSettings
    model_path: Optional[Path]
    identity: ModelIdentity
    split: SplitSettings
    kv_tokens: int = 0
    wait_for_leader: bool = False
    parts: PartsSettings = PartsSettings()


@dataclasses.dataclass
class Joined:
    """A rank brought up: its group (this rank's place in it: group.rank(), group.size()), its
    part of the model, the tokenizer and the share every rank loaded with."""

    group: Any
    model: Any
    tokenizer: Any
    share: SplitShare

    @property
    def leads(self) -> bool:
        return self.group.rank() == 0


def join(plan: BringUp) -> Any:
    """The group `plan.link` describes, this rank's figures in its hello when its split measures
    them (split.agree.with_figures); a worker told to wait for its leader retries until one
    answers (another model or secret still fails at once)."""
    link = with_figures(plan.link, plan.split)
    while True:
        try:
            return gate_ops.init_pair(link, plan.identity)
        except (HelloMismatchError, AuthenticationError):
            raise
        except TransportError as exc:
            if not plan.wait_for_leader:
                raise
            log(f"no leader yet ({exc}); still waiting (--rejoin)")
            time.sleep(0.5)


def bring_up(plan: BringUp, on_joined: Optional[Callable[[Any], None]] = None) -> Joined:
    """Join, agree the share, load this rank's part: the one bring-up of run, serve and demo.
    on_joined(group) runs once the group is formed, before any weight is read (serve's leader
    elected by discovery takes its HTTP port there). The group is closed when a later step fails."""
    group = join(plan)
    try:
        if on_joined is not None:
            on_joined(group)
        need = model_need(plan.model_path, plan.kv_tokens) if plan.model_path is not None else ModelNeed(0)
        share = agree_share(group, plan.split, need)
        t0 = time.perf_counter()
        model, tokenizer = load_rank_part(group, plan.model_path, share, plan.parts, progress=LoadingBar())
        log(f"weights loaded in {time.perf_counter() - t0:.1f} s (rank {group.rank()} of {group.size()})")
    except BaseException:
        group.close()
        raise
    return Joined(group, model, tokenizer, share)


def rejoin(group: Any, split: SplitSettings, share: SplitShare, model_path: Optional[Path]) -> None:
    """Every re-join (a leader taking a restarted worker back, a --rejoin worker finding its
    leader again): the group joined again with the settings it was made with (gate_ops.reconnect:
    the same hello, secret and fingerprint checks) and the share this rank's model is already
    split by agreed (a peer that asks for another is refused: the weights cannot change under a
    loaded model); a worker without --model offered its part as at a first start (model_path:
    this rank's --model, None on such a worker). Nothing is loaded again here. Raises as
    reconnect and agree_share do."""
    gate_ops.reconnect(group)
    agree_share(group, split, ModelNeed(0), held=share)
    parts_after_rejoin(group, model_path, share)


__all__ = ["BringUp", "Joined", "bring_up", "join", "rejoin"]
