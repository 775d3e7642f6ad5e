"""The face model code sees: a two-rank Group and the collectives.

Names, signatures and results follow ``mx.distributed`` (``init``,
``Group.rank()``, ``Group.size()``, ``all_sum``, ``all_gather``, ``all_max``,
``all_min``, ``sum_scatter``, ``send``, ``recv``, ``recv_like``; ``group=None``
is the group ``init`` returned last), so moving between this and MLX's own
backends is a one-line change. The machinery behind them is in collectives/: the
state one pair keeps (state.py) and the collectives themselves (ops.py).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import transport as tr
from .collectives import ops as _c
from .collectives.dtypes import DTYPE_CODES, DTYPE_NAMES, NUMPY_DTYPES  # noqa: F401 - re-exported
from .collectives.seam import MlxCollective
from .collectives.state import LATENCY_WINDOW, PairCollectives  # noqa: F401 - re-exported
from .errors import TransportError

# ============================================================================
# Groups
# ============================================================================


class Group:
    """Two ranks joined by a Pair (tcp or rdma) or by mx.distributed ("mlx")."""

    def __init__(self, pair: Optional[tr.Pair] = None, mlx_group=None):
        # A pair's collectives keep their state (gate signature, buffers, slots, the
        # round-trip ring) in a PairCollectives; MLX's own group goes through the
        # collective seam, the one caller of mx.distributed. Exactly one is set.
        self._pc: Optional[PairCollectives] = PairCollectives(pair) if pair is not None else None
        self._mlx = MlxCollective(mlx_group) if mlx_group is not None else None
        # all_sum's fast path looks here first: the state's own dict (empty for "mlx"), one
        # attribute away from the group instead of two.
        self.sum_slots = self._pc.sum_slots if self._pc is not None else {}
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
        if self._pc is not None:
            self._pc.close()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<mlx_ds4tp Group rank={self._rank} size=2 transport={self.transport}>"

    # -- the pair and its statistics ------------------------------------------
    @property
    def pair(self) -> tr.Pair:
        """The Pair under this group (control channel, gates); TransportError once closed."""
        if self._pc is None:
            raise TransportError("this group is closed; create a new one with mlx_ds4tp.init(...)")
        return self._pc.pair

    def gate_latency_us(self) -> Tuple[float, float]:
        """(p50, p99) of the recent decode gates' round trips, in microseconds."""
        return (0.0, 0.0) if self._pc is None else self._pc.gate_latency_us()

    def exchange_seconds(self) -> float:
        """Seconds this rank has spent in gates, bulk exchanges and signature checks since
        init, waiting for the peer included (0 over transport="mlx", whose collectives MLX
        runs). In lockstep decode that is mostly waiting: a rank that finishes its half of a
        layer first waits at the gate for the other's. Take the difference across a span of
        work to see how much of it was exchange."""
        return 0.0 if self._pc is None else self._pc.exchange_seconds()

    def latency_ring(self) -> Tuple[np.ndarray, np.ndarray]:
        """(round trips in ns, [how many were recorded, their total ns]): the float gates'
        C side writes both."""
        if self._pc is None:
            return np.zeros(LATENCY_WINDOW, dtype=np.int64), np.zeros(2, dtype=np.uint64)
        return self._pc.latency_ring()


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

    The group returned becomes the default of every collective's group=None,
    as mx.distributed.init sets the global group.
    """
    global _LAST_GROUP
    if transport == "mlx":
        _LAST_GROUP = _init_mlx(role)
        return _LAST_GROUP
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
    # connect() hands out a complete pair: its RDMA queue pair proven, or TCP chosen.
    pair = tr.connect(config, rdma_probe=lambda: tr.rdma_probe(config.rdma_device, config.verbs_library))
    _LAST_GROUP = Group(pair=pair)
    return _LAST_GROUP


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

# The group init returned last: what group=None means (mx.distributed's global group).
_LAST_GROUP: Optional[Group] = None


def _resolve(group: Optional[Group]) -> Group:
    if group is None:
        if _LAST_GROUP is None:
            raise RuntimeError(
                "group=None means the group mlx_ds4tp.init(...) returned last, and no group has "
                "been made in this process: call mlx_ds4tp.init(...) first (or pass group=...)"
            )
        return _LAST_GROUP
    if not isinstance(group, Group):
        raise TypeError(f"group={group!r}: pass the Group returned by mlx_ds4tp.init(...), or None")
    return group


def all_sum(x: mx.array, *, group: Optional[Group] = None, stream=None) -> mx.array:
    """Sum of the two ranks' x: same shape and dtype, identical bits on both ranks.

    x: any dtype of DTYPE_CODES (integers wrap as MLX's do; a bool sum is a logical
    or). group: a Group from init, default the one init returned last. stream: accepted
    for mx.distributed's signature; the bytes move on the host and the result is
    evaluated. Gradient: the cotangent passes through unchanged, as MLX's own.
    Raises HelloMismatchError when the peer's x differs in shape or dtype (or the peer
    called another collective), TransportError when the link fails, ValueError inside
    mx.compile / mx.vmap (nothing is sent).
    """
    # The decode gate: a float partial of a (dtype, shape) this group has gated before, its
    # signature agreed. This runs dozens of times per token on a round trip of ~10 us, so
    # each line counts (after the gate's system calls the interpreter runs with cold
    # caches: a lookup or call here costs 2-3x what it does in a tight loop). See link/sum_gates.py.
    # No group made yet, an mx.distributed group or a closed one (no slots) raise here and
    # take the general path. slot.current: this slot's signature is the one agreed last.
    try:
        slot = (group or _LAST_GROUP).sum_slots[(x.dtype, x.shape)]
    except (AttributeError, KeyError):
        return _all_sum(x, group, stream)
    try:
        mx.async_eval(x)  # refused while a transformation traces x: see collectives/ops.py
    except ValueError:
        return _c.traced(_c.sum_eager, _c.pass_cotangent, x, (group or _LAST_GROUP)._pc, "all_sum")
    local = memoryview(x)  # waits for x; on Apple Silicon its memory is the host's
    if not slot.current or not local.c_contiguous:
        return _c.sum_eager(x, (group or _LAST_GROUP)._pc)
    rc = slot.run(slot.ctx, slot.to_c(local), slot.nbytes)
    if rc:
        slot.fail(rc)
    return slot.finish()


def _all_sum(x: mx.array, group: Optional[Group], stream) -> mx.array:
    """all_sum's general path: MLX's own group, a first gate, another dtype, bad input."""
    group = _resolve(group)
    if group._mlx is not None:
        return group._mlx.all_sum(x, stream=stream)
    return _c.collective(_c.sum_eager, _c.pass_cotangent, x, group._pc, "all_sum")


def all_gather(x: mx.array, *, group: Optional[Group] = None, stream=None) -> mx.array:
    """Both ranks' x concatenated on axis 0 in rank order (scalars: shape (2,)).

    Arguments and errors as all_sum. Gradient: this rank's rows of the cotangent.
    """
    group = _resolve(group)
    if group._mlx is not None:
        return group._mlx.all_gather(x, stream=stream)
    return _c.collective(_c.gather_eager, _c.slice_cotangent, x, group._pc, "all_gather")


def all_max(x: mx.array, *, group: Optional[Group] = None, stream=None) -> mx.array:
    """Elementwise maximum of the two ranks' x (NaN propagates; complex compares the
    real part first). Arguments and errors as all_sum; gradient as MLX's (the
    cotangent unchanged)."""
    group = _resolve(group)
    if group._mlx is not None:
        return group._mlx.all_max(x, stream=stream)
    return _c.collective(_c.max_eager, _c.pass_cotangent, x, group._pc, "all_max")


def all_min(x: mx.array, *, group: Optional[Group] = None, stream=None) -> mx.array:
    """Elementwise minimum of the two ranks' x; as all_max."""
    group = _resolve(group)
    if group._mlx is not None:
        return group._mlx.all_min(x, stream=stream)
    return _c.collective(_c.min_eager, _c.pass_cotangent, x, group._pc, "all_min")


def sum_scatter(x: mx.array, *, group: Optional[Group] = None, stream=None) -> mx.array:
    """all_sum(x)[rank * n : (rank + 1) * n] with n = x.shape[0] // 2, moving half the
    bytes of an all_sum. x.shape[0] must be even (ValueError otherwise). Gradient: both
    ranks' cotangents gathered. Over transport="mlx" it is MLX's all_sum then the slice
    (MLX's own sum_scatter runs only on NCCL)."""
    group = _resolve(group)
    if group._mlx is not None:
        return group._mlx.sum_scatter(x, stream=stream)
    return _c.collective(_c.scatter_eager, _c.gather_cotangent, x, group._pc, "sum_scatter")


def send(x: mx.array, dst: int, *, group: Optional[Group] = None, stream=None) -> mx.array:
    """Send x to rank dst (the other rank); returns x. The peer calls recv / recv_like
    with src = this rank and the same shape and dtype (HelloMismatchError otherwise).
    Sent when called, not when the result is evaluated. No gradient flows to the peer."""
    group = _resolve(group)
    if group._mlx is not None:
        return group._mlx.send(x, dst, stream=stream)
    try:
        mx.async_eval(x)
    except ValueError:
        _c.evaluate_traced(x, "send")
    return _c.send_eager(x, dst, group._pc)


def recv(shape: Sequence[int], dtype: mx.Dtype, src: int, *, group: Optional[Group] = None,
         stream=None) -> mx.array:
    """The array of `shape` and `dtype` that rank src sends with send()."""
    group = _resolve(group)
    if group._mlx is not None:
        return group._mlx.recv(shape, dtype, src, stream=stream)
    return _c.recv(shape, dtype, src, group._pc)


def recv_like(x: mx.array, src: int, *, group: Optional[Group] = None, stream=None) -> mx.array:
    """recv(x.shape, x.dtype, src): the array rank src sends, shaped like x."""
    return recv(x.shape, x.dtype, src, group=group, stream=stream)
