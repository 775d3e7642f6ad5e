"""The engine of `ds4tp serve`: one thread on the leader that plans each turn (schedule), admits
requests (admission), prefills their prompts (prefill), decodes them in the leader's one batch
(lockstep/batch.py; mixing measures the mixed-prefill costs) and hands each its text and its end
(finishing, events). Its face to the HTTP side: Engine (loop: submit, cancel), the Ticket it
hands back (generation) and the events it answers with (events)."""

from .loop import Engine

__all__ = ["Engine"]
