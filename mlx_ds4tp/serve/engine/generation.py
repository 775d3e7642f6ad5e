"""What the engine hands back for a request it takes, and what it writes while the request runs:
the Ticket (the request's id, which Engine.cancel takes, the request, the queue of its events)
and the Reply (its text as it is detokenized, stop strings cut off, and the logprobs entries
not sent yet). The request itself is lockstep/request.py's GenerationRequest, frozen; the row
the batch keeps for it is lockstep/batch.py's Row."""

from __future__ import annotations

import dataclasses
from typing import List

from ...lockstep.request import GenerationRequest
from .events import EventQueue
from .text_stream import TextStream


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A request the engine took (Engine.submit): `events` receives StartedEvent when it
    starts, TextEvents, then one that ends it: DoneEvent, FailedEvent when this request alone
    failed, PairDownEvent when the pair is down, BusyEvent when it was refused for want of KV
    room (serve/engine/events.py); a cancelled request gets no more events."""

    id: int
    request: GenerationRequest
    events: EventQueue = dataclasses.field(default_factory=EventQueue, compare=False)


class Reply:
    """What the engine writes for one started request (serve/engine/finishing.py): its events,
    its text and the logprobs entries not sent yet. Engine thread only."""

    def __init__(self, ticket: Ticket, tokenizer):
        self.ticket = ticket
        self.text = TextStream(tokenizer.detokenizer, list(ticket.request.stop))
        self.items: List[dict] = []
