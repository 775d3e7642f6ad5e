"""The engine of `ds4tp serve`: one thread on the leader that admits requests (admission), prefills
their prompts (prefill), decodes them in one batch (decoding, mixing) and hands each its text and
its end (finishing, events). Its face to the HTTP side: Engine (loop), the Request it takes and
the events it answers with (generation, events)."""

from .loop import Engine

__all__ = ["Engine"]
