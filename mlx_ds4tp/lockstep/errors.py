"""Exception types of the lockstep layer's own (the pair's are in mlx_ds4tp.errors)."""

from __future__ import annotations


class ForeignFileError(ValueError):
    """A sound prompt-cache file made for another model, share or rank: left alone, never used
    (lockstep.disk_cache)."""


__all__ = ["ForeignFileError"]
