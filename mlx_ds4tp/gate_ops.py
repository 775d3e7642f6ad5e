"""The face model code sees: ``init()`` and the collectives.

``init(transport="tcp" | "rdma" | "auto")`` returns a :class:`Group` that IS an
``mx.distributed.Group`` (collectives/group.py: MLX's ``GroupImpl`` over the ranks' links, in
C++, for 2 to 8 ranks): ``mx.distributed.all_sum(x, group=g)``, ``mlx.nn``'s sharded layers and mlx-lm's
``model.shard(g)`` take it as they take MLX's own groups, every collective is a lazy
primitive in MLX's graph, and ``mx.compile``, ``mx.grad`` and ``mx.async_eval`` work.
``transport="mlx"`` returns MLX's own group (ring or JACCL, as MLX's launcher configures).

The functions here are ``mx.distributed``'s, with ``group=None`` meaning the group
``init`` returned last (as ``mx.distributed.init`` sets the global group), so moving
between this and MLX's own backends is a one-line change.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from .collectives.backend import SUPPORTED_DTYPES, MlxGroup
from .collectives.group import Group
from .errors import TransportError
from .link.config import MLX, LinkSettings, PairAddress, pair_address
from .link.hello import ModelIdentity
from .link.mesh import Mesh, form_mesh


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
    identity: Optional[ModelIdentity] = None,
    tcp_spin_us: Optional[int] = None,
    size: Optional[int] = None,
    rank: Optional[int] = None,
):
    """Join a group of `size` ranks. The leader (rank 0) listens, the workers dial it.

    size: 2 to 8; None (the default): 2 on the leader, the leader's on a worker. The leader
    listens with size=N, each worker dials it and is given a rank: the one it asks for with
    rank= (1 .. N-1), else the lowest free one in the order the workers joined; every pair of
    ranks then makes its own link (docs/nranks.md). The same Group comes back for any size
    (split(color, key) too). A worker given a size other than the leader's is refused naming
    both (HelloMismatchError).

    transport: "auto" (RDMA when both sides have it, else TCP), "rdma" (error
    if either side lacks it), "tcp", or "mlx" (mx.distributed: ring or jaccl
    as MLX chooses, configured by MLX's own launcher environment; MLX's own
    group is returned; listen and coordinator are MLX's launcher's to give).
    secret (str or bytes, default DS4_TP_SECRET): both ranks prove they hold it
    (HMAC challenge-response in the hello) before any session state exists.
    tcp_spin_us (default DS4_TP_TCP_SPIN_US, else 5000 with 8 cores or more, 200 with 2-7, 0 on one):
    how long a TCP gate polls for the peer's message before it sleeps.

    The group returned becomes the default of every collective's group=None,
    as mx.distributed.init sets the global group. The keywords' one path is init_pair.
    """
    address = PairAddress(role, None, None) if transport == MLX else pair_address(role, listen, coordinator)
    if size is None and (address.role != "worker" or transport == MLX):
        size = 2  # a leader (or MLX's own group) is a pair unless told otherwise
    link = LinkSettings(address, transport, rdma_device=rdma_device, gid_index=gid_index,
                        secret=secret, timeout=timeout, tcp_spin_us=tcp_spin_us, size=size,
                        ask_rank=rank)
    return init_pair(link, identity)


def init_pair(link: LinkSettings, identity: Optional[ModelIdentity] = None):
    """Join as `link` says (init's one path): a Group over links whose hellos check
    `identity` (the model's fingerprint), or MLX's own group for transport "mlx"."""
    global _LAST_GROUP
    link.check()
    if link.transport == MLX:
        _LAST_GROUP = _init_mlx(link.address.role)
        return _LAST_GROUP
    found_by = link if link.discovery is not None else None
    if link.finds_a_lobby:
        # Discovery finds a group of N in a lobby (the ranks, the leader's address), then it forms
        # there; two ranks need no lobby (their election is all), so _form finds them (meet).
        from .link.findgroup import find_group

        link = find_group(link, identity or ModelIdentity()).settings(link)
    mesh, link = _form(link, identity)
    try:
        group = Group(mesh)
    except BaseException:
        mesh.close()
        raise
    _JOINED_WITH[group] = (link, identity)
    if found_by is not None:
        _FOUND_BY[group] = found_by  # its leader advertises its door again to take a rank back
    _LAST_GROUP = group
    return group


def _form(link: LinkSettings, identity: Optional[ModelIdentity]) -> Tuple[Mesh, LinkSettings]:
    """The group `link` describes, formed (link/mesh.py), and the settings it forms again with:
    a pair discovery finds (link/meet.py: it elects who leads) its leader's door, its worker's
    discovering settings (it finds its leader again); an address keeps the size the group
    formed with (the leader's, for a worker started without one), and no regrouping (its
    door's rule is for this forming)."""
    if link.discovery is not None:
        from .link.meet import meet

        return meet(link, identity or ModelIdentity())
    mesh = form_mesh(link.resolved(identity))
    return mesh, dataclasses.replace(link, size=mesh.size, regrouping=None)


def reconnect(group: Group, link: Optional[LinkSettings] = None) -> Group:
    """Join the group again on a closed group, with the settings it was made with (or `link`):
    the same hello, secret and model fingerprint checks, then the group runs over the new links
    (every rank forms them again, each keeping its rank). A model split over the group keeps
    working, so a rank that lost its peers serves on once they (restarted) are back; nothing of
    the old links' state is carried over."""
    if not callable(getattr(group, "reattach", None)):
        raise TypeError(f"group={group!r}: reconnect() takes a group mlx_ds4tp.init(...) returned")
    made_with, identity = _JOINED_WITH.get(group, (None, None))
    link = link or made_with
    if link is None:
        raise ValueError(f"{group!r} was not made by mlx_ds4tp.init(...): pass "
                         "link=LinkSettings(...) to say how to join again")
    if link.check().transport == MLX:
        raise ValueError("transport='mlx': MLX's own groups cannot be rejoined; relaunch them")
    if link.size is None:  # a link given here that takes the leader's size: the group's is it
        link = dataclasses.replace(link, size=group.size())
    mesh = _form_again(group, link, identity)
    try:
        group.reattach(mesh)
    except BaseException:
        mesh.close()
        raise
    _JOINED_WITH[group] = (link, identity)
    return group


def rejoin_address(group) -> Optional[Tuple[str, int]]:
    """Where reconnect() joins `group` again: the leader's door (a worker's coordinator, the
    leader's own listen address), found by discovery or given; None for a group not made here."""
    link = _JOINED_WITH.get(group, (None, None))[0]
    if link is None:
        return None
    return link.address.coordinator or link.address.listen


def joined_with(group) -> Tuple[LinkSettings, Optional[ModelIdentity]]:
    """What `group` was joined with (its link settings, the model identity its hellos check),
    for a group formed again at another size (serve/resize.py); ValueError for a group not made
    here."""
    made = _JOINED_WITH.get(group)
    if made is None:
        raise ValueError(f"{group!r} was not made by mlx_ds4tp.init(...)")
    return made


def discovered_with(group) -> Optional[LinkSettings]:
    """The discovering settings of a group that discovery found (its leader advertises its door
    again with them, link.findgroup.Reopened: a group of N's lobby, a pair's door), or None: a
    group formed by addresses."""
    return _FOUND_BY.get(group)


def rejoin_timeout(group) -> float:
    """The connect timeout reconnect() joins `group` again with (DS4_TP_TIMEOUT_SEC's when unset)."""
    from .link.config import default_timeout

    link = _JOINED_WITH.get(group, (None, None))[0]
    return float(link.timeout) if link is not None and link.timeout else float(default_timeout())


# The discovering settings of a mesh discovery found (its leader's lobby opens again on reconnect).
_FOUND_BY: "weakref.WeakKeyDictionary[Group, LinkSettings]" = weakref.WeakKeyDictionary()

# What each group of ours was joined with, for reconnect(); weak, so a dropped group goes.
_JOINED_WITH: "weakref.WeakKeyDictionary[Group, Tuple[LinkSettings, Optional[ModelIdentity]]]" = \
    weakref.WeakKeyDictionary()


def _form_again(group: Group, link: LinkSettings, identity: Optional[ModelIdentity]) -> Mesh:
    """reconnect()'s new links, this rank at its old place: the group forms again (the leader
    at its address, each worker asking for the rank it had, so a restarted worker, asking for
    none, gets the one left free). The worker of a pair discovery found finds its leader again,
    as a worker. The leader of a group that discovery found advertises its door again meanwhile
    (link.findgroup.Reopened): a restarted rank, which runs discovery again, finds it (a group
    of N's lobby sends it to the door; a pair's worker joins the door it finds); the ranks still
    in the group dial that door directly (the address discovery found first)."""
    if link.discovery is not None:  # a pair's worker (its leader keeps its door's address)
        want = "lead" if group.rank() == 0 else "work"
        link = dataclasses.replace(link, discovery=dataclasses.replace(link.discovery, want=want))
        return _form(link, identity)[0]
    if group.rank() != 0:
        link = dataclasses.replace(link, ask_rank=group.rank())
    found_by = _FOUND_BY.get(group)
    reopened = None
    if group.rank() == 0 and found_by is not None:
        from .link.findgroup import Reopened

        reopened = Reopened(found_by, identity or ModelIdentity(), link.address.listen)
    try:
        return form_mesh(link.resolved(identity))
    finally:
        if reopened is not None:
            reopened.close()


def _init_mlx(role: Optional[str]):
    group = mx.distributed.init(strict=True)
    if group.size() != 2:
        raise TransportError(
            f"transport='mlx' needs exactly 2 ranks, mx.distributed has {group.size()}; "
            "launch with `mlx.launch -n 2` or a 2-host hostfile"
        )
    if role is not None and {"leader": 0, "worker": 1}[role] != group.rank():
        raise ValueError(
            f"role={role!r} but mx.distributed made this process rank {group.rank()}; "
            "drop role= or fix MLX_RANK"
        )
    return MlxGroup(group)


# ============================================================================
# Collectives: mx.distributed's, group=None being the group init returned last
# ============================================================================

_LAST_GROUP = None


def _resolve(group):
    if group is None:
        if _LAST_GROUP is None:
            raise RuntimeError(
                "group=None means the group mlx_ds4tp.init(...) returned last, and no group has "
                "been made in this process: call mlx_ds4tp.init(...) first (or pass group=...)"
            )
        return _LAST_GROUP
    if not isinstance(group, mx.distributed.Group):
        raise TypeError(f"group={group!r}: pass the Group returned by mlx_ds4tp.init(...) (or an "
                        "mx.distributed.Group), or None")
    return group


def all_sum(x: mx.array, *, group=None, stream=None) -> mx.array:
    """Sum of the ranks' x: same shape and dtype, identical bits on every rank (the partials
    added in rank order). Lazy, as mx.distributed.all_sum: the exchange runs when MLX evaluates
    the result. Integers wrap as MLX's do; a bool sum is a logical or. Gradient: the
    cotangent unchanged (MLX's own). A peer at another collective, shape or dtype, a dead
    or stopped peer, or a closed group is a RuntimeError from the evaluation."""
    return mx.distributed.all_sum(x, group=_resolve(group), stream=stream)


def all_gather(x: mx.array, *, group=None, stream=None) -> mx.array:
    """The ranks' x concatenated on axis 0 in rank order (scalars: shape (size,)).
    Gradient: this rank's rows of the cotangent."""
    return mx.distributed.all_gather(x, group=_resolve(group), stream=stream)


def all_max(x: mx.array, *, group=None, stream=None) -> mx.array:
    """Elementwise maximum of the ranks' x (NaN propagates; complex compares the real part
    first)."""
    return mx.distributed.all_max(x, group=_resolve(group), stream=stream)


def all_min(x: mx.array, *, group=None, stream=None) -> mx.array:
    """Elementwise minimum of the ranks' x; as all_max."""
    return mx.distributed.all_min(x, group=_resolve(group), stream=stream)


def sum_scatter(x: mx.array, *, group=None, stream=None) -> mx.array:
    """all_sum(x)[rank * n : (rank + 1) * n] with n = x.shape[0] // size. Over our group only
    (N-1)/N of an all_sum's bytes move; over MLX's own backends (whose sum_scatter runs only
    on NCCL) it is MLX's all_sum and the slice. ValueError when x.shape[0] does not divide.
    Gradient: every rank's cotangent gathered."""
    group = _resolve(group)
    size = group.size()
    if x.ndim == 0 or x.shape[0] % size:
        raise ValueError(f"sum_scatter: x.shape[0] must be divisible by the group size {size}, "
                         f"got shape {tuple(x.shape)}")
    if callable(getattr(group, "link_to", None)):  # ours, whose C++ scatters
        # MLX's ReduceScatter has no vjp: the transpose of a reduce-scatter is an all-gather
        # of the cotangents, wired in here (off the decode path: no split model scatters).
        scatter = mx.custom_function(lambda a: mx.distributed.sum_scatter(a, group=group, stream=stream))
        scatter.vjp(lambda primal, cotangent, output: mx.distributed.all_gather(
            cotangent, group=group, stream=stream))
        return scatter(x)
    rows = x.shape[0] // size
    total = mx.distributed.all_sum(x, group=group, stream=stream)
    return total[group.rank() * rows: (group.rank() + 1) * rows]


def _peer_rank(group, rank: int, what: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < group.size() or rank == group.rank():
        raise ValueError(f"{what}={rank!r}: give another rank of this group of {group.size()} "
                         f"(0 .. {group.size() - 1}, not this rank {group.rank()})")


def send(x: mx.array, dst: int, *, group=None, stream=None) -> mx.array:
    """Send x to rank dst when the result is evaluated (mx.distributed.send); the peer calls
    recv / recv_like with src = this rank and the same shape and dtype."""
    group = _resolve(group)
    _peer_rank(group, dst, "dst")
    return mx.distributed.send(x, dst, group=group, stream=stream)


def recv(shape: Sequence[int], dtype: mx.Dtype, src: int, *, group=None, stream=None) -> mx.array:
    """The array of `shape` and `dtype` that rank src sends with send()."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).split(".")[-1] for d in SUPPORTED_DTYPES)
        raise TypeError(f"dtype {dtype!r} is not supported by the collectives; use one of {names}")
    group = _resolve(group)
    _peer_rank(group, src, "src")
    return mx.distributed.recv(tuple(shape), dtype, src, group=group, stream=stream)


def recv_like(x: mx.array, src: int, *, group=None, stream=None) -> mx.array:
    """recv(x.shape, x.dtype, src): the array rank src sends, shaped like x."""
    return recv(x.shape, x.dtype, src, group=group, stream=stream)
