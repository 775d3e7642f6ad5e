"""The compiled C module (mlx_ds4tp._verbs, built by _verbs_build.py): TCP gate
and RDMA hot paths with the GIL released."""

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


def sum_partials(dtype: int, rank: int, mine, peer, out) -> None:
    """out = rank 0's partial + rank 1's (mine is this rank's), in C (tp_sum2): dtype is
    lib.TP_SUM_F32 / _F16 / _BF16, the three buffers the same byte size. The order is the
    same on both ranks, so both hold identical bits."""
    ffi, lib = load_verbs()
    a = ffi.from_buffer(mine)
    b = ffi.from_buffer(peer)
    o = ffi.from_buffer(out, require_writable=True)
    if not len(a) == len(b) == len(o):
        raise ValueError(f"sum of partials: {len(a)}, {len(b)} and {len(o)} bytes; they must match")
    item = 4 if dtype == lib.TP_SUM_F32 else 2
    first, second = (a, b) if rank == 0 else (b, a)
    if len(a) % item or lib.tp_sum2(dtype, first, second, o, len(a) // item) != lib.TP_OK:
        raise ValueError(f"sum of partials: dtype code {dtype} with {len(a)} bytes is not a whole "
                         "number of float32, float16 or bfloat16 items")
