"""Our transport as an MLX distributed backend: the compiled module, loaded once and checked,
and the groups with no links of ours (cut only, gateless, MLX's own).

The compiled module ``mlx_ds4tp._pairgroup`` (csrc/mlx/) implements MLX's
``GroupImpl`` over the ranks' exchange (csrc/exchange.c): ``mx.distributed.all_sum(x,
group=g)`` and every other collective are primitives in MLX's graph, run when MLX
evaluates it, on a CPU stream, with no interpreter on the path. So a decode token is
one graph and one evaluation, mlx-lm's ``shard()`` plans and ``mlx.nn``'s sharded
layers run over the ranks unchanged, and ``mx.compile``, ``mx.grad`` and
``mx.async_eval`` work. The group of our links is collectives/group.py's.

The module is loaded only under the MLX it was compiled against: MLX's C++ API and
nanobind's internals are not stable across versions, so another version could crash
the process instead of failing. The version it was built against is read from the
file first (a marker string the build embeds), so a mismatch is a clear error even
when the module could not be loaded at all.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
from typing import Optional, Tuple

import mlx.core as mx

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARKER = re.compile(rb"ds4tp-built-against-mlx=([0-9A-Za-z.+-]+);")


def rebuild_command() -> str:
    """The command that rebuilds the compiled modules against the MLX installed now."""
    root = os.path.dirname(_HERE)
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        target = f"-e {root}"
    else:
        target = "mlx-ds4tp"
    return (f"pip install wheel nanobind==3.1.0 && pip install --no-build-isolation --no-deps "
            f"--force-reinstall {target}")


def built_against(path: str) -> Optional[str]:
    """The MLX version the extension at `path` was compiled against (None: no marker)."""
    with open(path, "rb") as f:
        found = _MARKER.search(f.read())
    return found.group(1).decode() if found else None


def _extension_path() -> str:
    found = sorted(glob.glob(os.path.join(_HERE, "_pairgroup*.so")) +
                   glob.glob(os.path.join(_HERE, "_pairgroup*.pyd")))
    if not found:
        raise ImportError(
            f"mlx_ds4tp's MLX backend (mlx_ds4tp/_pairgroup) is not built in {_HERE}; "
            f"build it: {rebuild_command()}")
    return found[0]


def load_pairgroup():
    """The compiled backend, after checking it was built against the MLX installed."""
    path = _extension_path()
    built = built_against(path)
    installed = mx.__version__
    if built != installed:
        raise ImportError(
            f"mlx_ds4tp's MLX backend was built against MLX {built or 'unknown'}, but MLX "
            f"{installed} is installed (MLX's C++ interface differs between versions, so it is "
            f"not loaded); rebuild it against this MLX: {rebuild_command()}")
    return importlib.import_module("mlx_ds4tp._pairgroup")


_pairgroup = load_pairgroup()
# Every dtype the collectives take, in the order of their codes (csrc/exchange_codes.h),
# as the backend's own table lists them.
SUPPORTED_DTYPES = tuple(dtype for dtype, _ in _pairgroup.dtype_codes())


def _address(ffi, pointer) -> int:
    return int(ffi.cast("uintptr_t", pointer))


def cut_only_group(rank: int, size: int) -> "mx.distributed.Group":
    """An mx.distributed.Group that only says who this rank is: enough for code that cuts
    weights (mlx-lm's shard()), whose every collective fails at evaluation saying so."""
    return _pairgroup.LocalGroup(rank, size, False)


def gateless_group(rank: int, size: int = 2) -> "mx.distributed.Group":
    """An mx.distributed.Group whose gates do nothing (all_sum hands the local partial back,
    all_gather repeats it): the compute ceiling's, where the ranks never meet."""
    return _pairgroup.LocalGroup(rank, size, True)


class MlxGroup(_pairgroup.SharedGroup):
    """MLX's own group (ring or JACCL, as init(transport="mlx") returns it) with the extras
    our group has: ``transport`` ("mlx"), ``close()`` (MLX owns the connections: the
    group simply stops being the default), the context manager, and statistics that MLX
    does not keep (zero)."""

    transport = "mlx"

    def close(self) -> None:
        pass

    def __enter__(self) -> "MlxGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<mlx_ds4tp MlxGroup rank={self.rank()} size={self.size()} transport=mlx>"

    def gate_latency_us(self) -> Tuple[float, float]:
        return 0.0, 0.0

    def exchange_seconds(self) -> float:
        return 0.0

    def gates(self) -> int:
        return 0
