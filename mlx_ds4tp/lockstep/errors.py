"""Exception types of the lockstep layer's own (the pair's are in mlx_ds4tp.errors)."""

from __future__ import annotations


class ForeignFileError(ValueError):
    """A sound prompt-cache file made for another model, share or rank: left alone, never used
    (lockstep.disk_cache)."""


class GrammarError(ValueError):
    """Constrained decoding (lockstep.grammar): a grammar or schema the engine cannot compile,
    or a drawn token its matcher refuses; the message (one line) names what it refused."""


__all__ = ["ForeignFileError", "GrammarError"]
