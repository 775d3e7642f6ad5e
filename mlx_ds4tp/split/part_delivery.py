"""Each rank's part of the model, where a rank may hold no model: the leader first sends every
worker that joined without --model its part (split/part_send.py), then each rank loads: from
the model's directory as load_split does, or, on a worker without one, from the part it
received into its parts cache (split/part_receive.py, split/part_plan.py's load_part)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from ..base.log import log
from ..checkpoint.parts_cache import PartsSettings
from ..link.hello import receives_part
from .apply import load_split
from .part_bulk import bulk_path
from .part_plan import load_part
from .part_receive import decline_part, receive_part, stated_fingerprint
from .part_send import CHUNK_BYTES, PartSender
from .share import SplitShare


def load_rank_part(group: Any, model_path: Optional[Path], share: SplitShare, parts: PartsSettings,
                   progress: Optional[Callable[[int, int, str], None]] = None) -> Tuple[Any, Any]:
    """(model, tokenizer) of this rank: model_path None on a worker started without --model."""
    if model_path is None:
        if not callable(getattr(group, "link_to", None)) or group.rank() == 0:
            raise ValueError("only a worker of a group of our own (--transport auto, tcp or rdma) can "
                             "start without --model; give this rank the model's directory")
        entry = receive_part(group.link_to(0), group.rank(), group.size(), share, parts,
                             bulk_path(group, 0, CHUNK_BYTES))
        return load_part(entry, group, share)
    offer_parts(group, model_path, share)
    return load_split(str(model_path), group, split=share, progress=progress)


def offer_parts(group: Any, model_path: Path, share: SplitShare) -> None:
    """On the leader: each worker whose hello says it joined without --model offered its part
    (nothing when its cache holds it all); on any other rank nothing."""
    if group.rank() != 0 or not callable(getattr(group, "link_to", None)):
        return
    receivers = [r for r in range(1, group.size()) if receives_part(group.link_to(r).peer_hello)]
    if not receivers:
        return
    fingerprint = stated_fingerprint(group.link_to(receivers[0]).mine.fingerprint)
    if not fingerprint:
        raise ValueError(f"rank {receivers[0]} joined without --model, but this leader's hello "
                         "states no model fingerprint to check its part against; give the "
                         "leader an identity with one (ds4tp run and serve do)")
    send_parts(group, model_path, share, fingerprint, receivers)


def send_parts(group: Any, model_path: Path, share: SplitShare, fingerprint: str, receivers: List[int]) -> None:
    """The leader's side for each worker of `receivers` (started without --model), all at once:
    each link is a cable of its own, so three workers of a group of four receive at three
    cables' rate, not one after the other (the leader's disk reads each part once). Over TCP a
    thread a worker; the RDMA bulk paths one after the other on one more thread (the links'
    exchanges are driven from one thread at a time, as the gates drive them). Each part is
    planned here first (MLX, which runs in one thread at a time). The first error is raised
    once every transfer has ended (what arrived stays in each worker's cache, resumed next time)."""
    senders = [PartSender(model_path, rank, group.size(), share, fingerprint) for rank in receivers]
    tcp, rdma = [], []
    for sender in senders:
        bulk = bulk_path(group, sender.rank, CHUNK_BYTES)
        log(f"rank {sender.rank} has no model: offering its part ({len(sender.plan.files)} part files, "
            f"{sender.plan.weight_bytes / 1e6:.1f} MB of weights, over {'the RDMA bulk path' if bulk else 'TCP'})")
        (rdma if bulk is not None else tcp).append((sender, bulk))
    errors: List[BaseException] = []

    def send(batch: List[Tuple[PartSender, Any]]) -> None:
        for sender, bulk in batch:
            try:
                sent = sender.send(group.link_to(sender.rank).control, bulk)
            except BaseException as exc:  # noqa: BLE001 - raised on the leader's thread below
                errors.append(exc)
                continue  # the next rank's transfer still runs: its wait is no shorter for this one
            held = "" if sent else " (its cache held all of it)"
            log(f"rank {sender.rank}'s part: {sent / 1e6:.1f} MB sent{held}")

    batches = [[pair] for pair in tcp] + ([rdma] if rdma else [])
    if len(batches) == 1:
        send(batches[0])
    else:
        threads = [threading.Thread(target=send, args=(batch,), name="ds4tp-part-to", daemon=True)
                   for batch in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()  # each send's every wait is bounded (the link's timeout, PART_WAIT_S)
    if errors:
        raise errors[0]


def parts_after_rejoin(group: Any, model_path: Optional[Path], share: SplitShare) -> None:
    """After a re-join (lockstep.join_and_load.rejoin), the same exchange as a first start's:
    the leader offers every worker without --model its part, since a restarted one comes up
    through load_rank_part and waits for it (it receives what its cache lacks); a worker
    without --model that kept running holds its part loaded already and declines the offer."""
    if group.rank() == 0:
        if model_path is not None:
            offer_parts(group, model_path, share)
    elif model_path is None:
        decline_part(group.link_to(0), group.rank(), group.size(), share)


__all__ = ["load_rank_part", "offer_parts", "parts_after_rejoin", "send_parts"]
