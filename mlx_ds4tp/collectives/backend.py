"""Our transport as an MLX distributed backend: a pair's group that IS an
``mlx.core.distributed.Group``.

The compiled module ``mlx_ds4tp._pairgroup`` (csrc/mlx/) implements MLX's
``GroupImpl`` over the pair's exchange (csrc/exchange.c): ``mx.distributed.all_sum(x,
group=g)`` and every other collective are primitives in MLX's graph, run when MLX
evaluates it, on a CPU stream, with no interpreter on the path. So a decode token is
one graph and one evaluation, mlx-lm's ``shard()`` plans and ``mlx.nn``'s sharded
layers run over the pair unchanged, and ``mx.compile``, ``mx.grad`` and
``mx.async_eval`` work.

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
import numpy as np

from ..errors import TransportError
from ..link.native import load_verbs

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARKER = re.compile(rb"ds4tp-built-against-mlx=([0-9A-Za-z.+-]+);")
LATENCY_WINDOW = 8192


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


class PairGroup(_pairgroup.PairGroup):
    """The two ranks of a pair (rank 0 the leader) as an ``mx.distributed.Group``.

    Beside MLX's surface (``rank()``, ``size()``, every ``mx.distributed`` collective):
    ``transport`` ("tcp" | "rdma"), ``close()`` (also a context manager), ``pair`` (the
    control channel and the hellos, for the lockstep above), and the exchange statistics
    (``gate_latency_us()``, ``exchange_seconds()``)."""

    def __init__(self, pair):
        ffi, lib = load_verbs()
        # Round trips of the last LATENCY_WINDOW decode gates and their count and total,
        # written by the C exchange.
        self._latency_ns = np.zeros(LATENCY_WINDOW, dtype=np.int64)
        self._latency_count = np.zeros(2, dtype=np.uint64)
        link = self._new_link(pair)
        super().__init__(pair.rank, _address(ffi, link),
                         _address(ffi, lib.tp_link_exchange_address()),
                         _address(ffi, lib.tp_sum2_address()),
                         _address(ffi, lib.tp_link_close_address()))
        self._link = link  # C memory the backend reads: kept as long as this group
        self._pair = pair
        self.transport = pair.transport

    def _new_link(self, pair):
        ffi, _ = load_verbs()
        link = ffi.new("tp_link *")
        link.pair = pair.state
        link.dev = pair.rdma.dev if pair.rdma is not None else ffi.NULL
        link.fd = pair.data.fileno()
        link.rank = pair.rank
        link.spin_ns = pair.spin_ns
        link.timeout_s = pair.timeout
        link.latency_ns = ffi.cast("int64_t *", ffi.from_buffer(self._latency_ns))
        link.latency_len = LATENCY_WINDOW
        link.latency_count = ffi.cast("uint64_t *", ffi.from_buffer(self._latency_count))
        return link

    def reattach(self, pair) -> None:
        """Run this closed group over a new pair with the same peer rank come back (`ds4tp
        serve`'s rejoin): a model split over this group, whose layers hold it, works on
        unchanged. The new pair's sequence numbers start again at zero on both ranks."""
        if self._pair is not None:
            raise TransportError("this group is still open; close() it before reattach()")
        if pair.rank != self.rank():
            raise ValueError(f"the new pair makes this process rank {pair.rank}, the group is rank "
                             f"{self.rank()}: a group keeps its rank")
        ffi, _ = load_verbs()
        link = self._new_link(pair)
        self._attach_backend(_address(ffi, link))
        self._link, self._pair, self.transport = link, pair, pair.transport

    @property
    def link(self):
        """The C link (``tp_link *``) the backend's exchanges run on: link/exchange.py's
        Exchange calls the same entry point on it from Python (bench, doctor, tests)."""
        return self._link

    @property
    def pair(self):
        if self._pair is None:
            raise TransportError("this group is closed; create a new one with mlx_ds4tp.init(...)")
        return self._pair

    def close(self) -> None:
        """Stop the collectives (one in flight is woken and fails; later ones fail saying
        the group is closed), then close the pair's connections."""
        if self._pair is None:
            return
        self._close_backend()
        pair, self._pair = self._pair, None
        pair.close()

    def __enter__(self) -> "PairGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # MLX's graph may hold the implementation longer than Python holds this object:
        # it must never reach the link's memory once that is freed.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
            pass

    def __repr__(self) -> str:
        return f"<mlx_ds4tp PairGroup rank={self.rank()} size=2 transport={self.transport}>"

    # -- statistics ------------------------------------------------------------
    def gate_latency_us(self) -> Tuple[float, float]:
        """(p50, p99) of the recent decode gates' round trips, in microseconds."""
        n = min(int(self._latency_count[0]), LATENCY_WINDOW)
        if n == 0:
            return 0.0, 0.0
        p50, p99 = np.percentile(self._latency_ns[:n], [50, 99]) / 1000.0
        return float(p50), float(p99)

    def exchange_seconds(self) -> float:
        """Seconds this rank has spent in exchanges since init (decode gates, bulk
        exchanges and signature swaps), waiting for the peer included. In lockstep
        decode that is mostly waiting: a rank that finishes its half of a layer first
        waits at the gate for the other's."""
        return (int(self._latency_count[1]) + int(self._link.other_ns)) / 1e9

    def gates(self) -> int:
        """Decode gates run since init."""
        return int(self._latency_count[0])


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
    a pair's group has: ``transport`` ("mlx"), ``close()`` (MLX owns the connections: the
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
