"""The compiled C module (mlx_ds4tp._verbs, built by _verbs_build.py): the
exchange's TCP and RDMA hot paths with the GIL released, the RDMA device."""

from __future__ import annotations

from typing import Any, Tuple

from ..errors import RdmaUnavailableError


def load_verbs() -> Tuple[Any, Any]:
    """(ffi, lib) of the compiled module, or RdmaUnavailableError saying how to build it."""
    try:
        from .. import _verbs  # type: ignore[attr-defined]
    except ImportError as exc:
        raise RdmaUnavailableError(
            f"the C module mlx_ds4tp._verbs is not built ({exc}); reinstall with "
            "`pip install -e .` (needs a C compiler and cffi)"
        ) from None
    return _verbs.ffi, _verbs.lib
