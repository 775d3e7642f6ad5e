"""A generation's text as a client may see it: detokenized, with stop strings cut off."""

from __future__ import annotations

from typing import List


class TextStream:
    """Detokenized text with stop strings cut off: text is released only once no stop
    string can begin in it, so a client never sees part of a stop string."""

    def __init__(self, detokenizer, stop: List[str]):
        self.detok = detokenizer
        self.detok.reset()
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def add(self, token: int) -> tuple:
        """(text to send now, True when a stop string ended the text)."""
        self.detok.add_token(token)
        return self._release(self.detok.last_segment, final=False)

    def finish(self) -> str:
        """The text still held back, at the end of a generation that no stop string ended."""
        self.detok.finalize()
        return self._release(self.detok.last_segment, final=True)[0]

    def _release(self, segment: str, final: bool) -> tuple:
        self.pending += segment
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            text, self.pending = self.pending[: min(hits)], ""
            return text, True
        cut = len(self.pending) if final else max(0, len(self.pending) - self.hold)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False
