"""Exception types of the model split (mlx_ds4tp.split): the layer's own, beside the transport's
and the lockstep's in mlx_ds4tp.errors."""

from __future__ import annotations


class ShareRefusedError(ValueError):
    """No share fits both ranks' memories (--split auto): named with both memories and the
    model's size, before any weight is read."""


class EvenCutOnlyError(Exception):
    """The plan does something only an even cut follows (it repeats or reorders indices between
    ranks): the uneven share falls back to 1:1, logged. Never leaves split/units.py."""
