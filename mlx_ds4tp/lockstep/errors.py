"""Exception types of the lockstep layer's own (the pair's are in mlx_ds4tp.errors)."""

from __future__ import annotations


class ForeignFileError(ValueError):
    """A sound prompt-cache file made for another model, share or rank: left alone, never used
    (lockstep.caches.disk_cache)."""


class GrammarError(ValueError):
    """Constrained decoding (lockstep.sampling.grammar): a grammar or schema the engine cannot compile,
    or a drawn token its matcher refuses; the message (one line) names what it refused."""


class MeshReformingError(Exception):
    """A serving leader's REFORM to a worker of its group (any N): a rank died, the leader lives
    and forms the group again at its door; a worker still alive joins it again with its rank and
    share (serve.rejoin). The message is the leader's reason; `resize` the RESIZE payload when
    the leader forms a group of another size instead (lockstep/regroup.py reads it)."""

    def __init__(self, message: str, resize: bytes = b""):
        super().__init__(message)
        self.resize = resize


__all__ = ["ForeignFileError", "GrammarError", "MeshReformingError"]
