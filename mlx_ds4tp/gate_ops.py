"""The face model code sees: a two-rank Group and the gate collectives.

Names and shapes follow ``mx.distributed`` (``init``, ``Group.rank()``,
``Group.size()``, ``all_sum``, ``all_gather``) so moving between this and MLX's
own backends is a one-line change.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import transport as tr
from . import warmup
from ._collective import MlxCollective
from ._wire import DESCRIPTOR, DESCRIPTOR_MAGIC, MAX_DIMS
from .errors import HelloMismatchError, TransportError

# ============================================================================
# Groups
# ============================================================================

DTYPE_CODES = {mx.float32: 1, mx.float16: 2, mx.bfloat16: 3}
DTYPE_NAMES = {1: "float32", 2: "float16", 3: "bfloat16"}
NUMPY_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}
LATENCY_WINDOW = 8192


def _describe(dtype_code: int, shape: Sequence[int]) -> str:
    return f"{DTYPE_NAMES.get(dtype_code, f'dtype#{dtype_code}')} {tuple(shape)}"


class Group:
    """Two ranks joined by a Pair (tcp or rdma) or by mx.distributed ("mlx")."""

    def __init__(self, pair: Optional[tr.Pair] = None, mlx_group=None):
        self._pair = pair
        # MLX's own group goes through the collective seam, the one caller of mx.distributed.
        self._mlx = MlxCollective(mlx_group) if mlx_group is not None else None
        self._signature: Optional[Tuple[int, Tuple[int, ...]]] = None
        self._scratch: Dict[Tuple[int, int], np.ndarray] = {}
        # Round trips of the last LATENCY_WINDOW decode gates, for the
        # closing line of a run (p50/p99); recording costs one store.
        self._latency_ns = np.zeros(LATENCY_WINDOW, dtype=np.int64)
        self._latency_count = 0
        if pair is not None:
            self.transport = pair.transport
            self._rank = pair.rank
        else:
            self.transport = "mlx"
            self._rank = mlx_group.rank()

    # -- the mx.distributed.Group surface --------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2

    def all_sum(self, x: mx.array) -> mx.array:
        """all_sum(x, group=self): the Collective method split models call."""
        return all_sum(x, group=self)

    def all_gather(self, x: mx.array) -> mx.array:
        """all_gather(x, group=self): the Collective method split models call."""
        return all_gather(x, group=self)

    def close(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<mlx_ds4tp Group rank={self._rank} size=2 transport={self.transport}>"

    # -- internals used by the collectives ---------------------------------
    @property
    def pair(self) -> tr.Pair:
        if self._pair is None:
            raise TransportError("this group is closed; create a new one with mlx_ds4tp.init(...)")
        return self._pair

    def gate_latency_us(self) -> Tuple[float, float]:
        """(p50, p99) of the recent decode gates' round trips, in microseconds."""
        n = min(self._latency_count, LATENCY_WINDOW)
        if n == 0:
            return 0.0, 0.0
        p50, p99 = np.percentile(self._latency_ns[:n], [50, 99]) / 1000.0
        return float(p50), float(p99)

    def record_latency(self, ns: int) -> None:
        self._latency_ns[self._latency_count % LATENCY_WINDOW] = ns
        self._latency_count += 1

    def scratch(self, nbytes: int, np_dtype) -> np.ndarray:
        """Reusable receive buffers: the gate path allocates nothing per call."""
        key = (nbytes, np.dtype(np_dtype).num)
        buf = self._scratch.get(key)
        if buf is None:
            buf = np.empty(nbytes // np.dtype(np_dtype).itemsize, dtype=np_dtype)
            self._scratch[key] = buf
        return buf

    def agree_signature(self, dtype_code: int, shape: Tuple[int, ...]) -> None:
        """When the partial's dtype/shape changes, both ranks compare theirs."""
        sig = (dtype_code, shape)
        if sig == self._signature:
            return
        if len(shape) > MAX_DIMS:
            raise ValueError(f"gate arrays have at most {MAX_DIMS} dimensions, got shape {shape}")
        dims = list(shape) + [0] * (MAX_DIMS - len(shape))
        mine = DESCRIPTOR.pack(DESCRIPTOR_MAGIC, dtype_code, len(shape), 0, *dims)
        theirs = self.pair.exchange_small(mine, "gate signature")
        magic, pcode, pndim, _, *pdims = DESCRIPTOR.unpack(theirs)
        if magic != DESCRIPTOR_MAGIC:
            raise HelloMismatchError(
                f"gate signature: this rank changed its partial to {_describe(dtype_code, shape)} "
                f"while the peer did not (it sent magic 0x{magic:08x}); both ranks must run "
                "the same sequence of gates"
            )
        pshape = tuple(pdims[:pndim])
        if (pcode, pshape) != sig:
            raise HelloMismatchError(
                f"gate partial mismatch: this rank has {_describe(dtype_code, shape)}, the peer "
                f"has {_describe(pcode, pshape)}; both ranks must pass the same shape and dtype"
            )
        self._signature = sig


def init(
    role: Optional[str] = None,
    listen: Optional[Tuple[str, int]] = None,
    coordinator: Optional[Tuple[str, int]] = None,
    transport: str = "auto",
    *,
    rdma_device: Optional[str] = None,
    gid_index: Optional[int] = None,
    timeout: Optional[float] = None,
    secret=None,
    identity: Optional[tr.ModelIdentity] = None,
    tcp_spin_us: Optional[int] = None,
) -> Group:
    """Join the pair. The leader (rank 0) listens, the worker (rank 1) dials.

    transport: "auto" (RDMA when both sides have it, else TCP), "rdma" (error
    if either side lacks it), "tcp", or "mlx" (mx.distributed: ring or jaccl
    as MLX chooses, configured by MLX's own launcher environment).
    secret (str or bytes, default DS4_TP_SECRET): both ranks prove they hold it
    (HMAC challenge-response in the hello) before any session state exists.
    tcp_spin_us (default DS4_TP_TCP_SPIN_US, else 5000; 0 on a one-core machine):
    how long a TCP gate polls for the peer's message before it sleeps.
    """
    if transport == "mlx":
        return _init_mlx(role)
    config = tr.PairConfig(
        role=role,
        listen=tuple(listen) if listen is not None else None,
        coordinator=tuple(coordinator) if coordinator is not None else None,
        transport=transport,
        rdma_device=rdma_device,
        gid_index=gid_index,
        timeout=timeout,
        identity=identity or tr.ModelIdentity(),
        secret=secret,
        tcp_spin_us=tcp_spin_us,
    )
    pair = tr.connect(config, rdma_probe=lambda: tr.rdma_probe(config.rdma_device))
    try:
        if pair.transport == "rdma":
            pair.attach_rdma(warmup.bring_up_rdma(pair))
    except BaseException:
        pair.close()
        raise
    return Group(pair=pair)


def _init_mlx(role: Optional[str]) -> Group:
    group = mx.distributed.init(strict=True)
    if group.size() != 2:
        raise TransportError(
            f"transport='mlx' needs exactly 2 ranks, mx.distributed has {group.size()}; "
            "launch with `mlx.launch -n 2` or a 2-host hostfile"
        )
    if role is not None:
        want = {"leader": 0, "worker": 1}.get(role)
        if want is None:
            raise ValueError(f"role={role!r}: use 'leader' or 'worker'")
        if want != group.rank():
            raise ValueError(
                f"role={role!r} but mx.distributed made this process rank {group.rank()}; "
                "drop role= or fix MLX_RANK"
            )
    return Group(mlx_group=group)


# ============================================================================
# Collectives
# ============================================================================


def _require_group(group: Optional[Group]) -> Group:
    if not isinstance(group, Group):
        raise TypeError(
            f"group={group!r}: pass the Group returned by mlx_ds4tp.init(...)"
        )
    return group


def _host_view(x: mx.array) -> Tuple[mx.array, memoryview]:
    """Evaluate x and return its own buffer (unified memory on Apple Silicon:
    the partial goes out with no staging copy)."""
    if x.dtype not in DTYPE_CODES:
        raise TypeError(
            f"gate dtype {x.dtype} is not supported; use float32, float16 or bfloat16"
        )
    mx.eval(x)
    view = memoryview(x)
    if not view.c_contiguous:
        x = mx.contiguous(x)
        mx.eval(x)
        view = memoryview(x)
    return x, view.cast("B")


def _exchange(x: mx.array, group: Group, kind: int) -> Tuple[mx.array, np.ndarray, np.ndarray]:
    """Send x's bytes, receive the peer's: a decode gate when it fits one
    message pair, a bulk exchange (prefill rows, logits) otherwise."""
    x, local_bytes = _host_view(x)
    code = DTYPE_CODES[x.dtype]
    group.agree_signature(code, tuple(x.shape))
    np_dtype = NUMPY_DTYPES[x.dtype]
    peer = group.scratch(local_bytes.nbytes, np_dtype)
    if local_bytes.nbytes <= tr.GATE_MAX_BYTES:
        t0 = time.perf_counter_ns()
        group.pair.gate(local_bytes, peer, layer=kind, gate=code)
        group.record_latency(time.perf_counter_ns() - t0)
    else:
        group.pair.bulk(local_bytes, peer, layer=kind)
    return x, np.frombuffer(local_bytes, dtype=np_dtype), peer


def all_sum(x: mx.array, *, group: Group, stream=None) -> mx.array:
    """local + peer partial, same shape and dtype, bit-identical on both ranks."""
    group = _require_group(group)
    if group._mlx is not None:
        return group._mlx.all_sum(x)
    x, local, peer = _exchange(x, group, kind=1)
    # The same order on both ranks (rank 0's partial first): the float sum is
    # then the same expression everywhere, so both ranks hold identical bits.
    first, second = (local, peer) if group.rank() == 0 else (peer, local)
    if x.dtype == mx.bfloat16:
        return _to_mlx(_bf16_add(first, second).reshape(x.shape), x.dtype)
    return _to_mlx(np.add(first, second).reshape(x.shape), x.dtype)


def _to_mlx(values: np.ndarray, dtype) -> mx.array:
    """A materialised array (numpy has no bfloat16: its bits travel as uint16).
    Evaluated here so the result does not depend on this thread's stream."""
    out = mx.array(values)
    if dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
        mx.eval(out)
    return out


def _bf16_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bfloat16 a + b computed in float32 and rounded to nearest-even, as MLX does."""
    fa = (a.astype(np.uint32) << 16).view(np.float32)
    fb = (b.astype(np.uint32) << 16).view(np.float32)
    bits = (fa + fb).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(fa + fb)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def all_gather(x: mx.array, *, group: Group, stream=None) -> mx.array:
    """Both partials concatenated on axis 0, in rank order."""
    group = _require_group(group)
    if group._mlx is not None:
        return group._mlx.all_gather(x)
    x, local, peer = _exchange(x, group, kind=2)
    parts = (local, peer) if group.rank() == 0 else (peer, local)
    shape = (2 * x.shape[0],) + tuple(x.shape[1:]) if x.ndim else (2,)
    return _to_mlx(np.concatenate(parts).reshape(shape), x.dtype)
