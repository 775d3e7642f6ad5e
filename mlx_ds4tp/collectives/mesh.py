"""A mesh of N ranks as an ``mlx.core.distributed.Group``: the compiled backend's MeshGroup
(csrc/mlx/mesh_group.cpp) over the C mesh (tp_mesh, csrc/exchange.c), whose links are the
mesh's pairs (link/mesh.py). ``mx.distributed``'s collectives, ``mlx.nn``'s sharded layers
and mlx-lm's ``shard()`` take it as they take a pair's group; ``split(color, key)`` makes
subgroups over the same links."""

from __future__ import annotations

from typing import Dict, Tuple

from ..errors import TransportError
from ..link.native import load_verbs
from .backend import _address, _pairgroup


def _c_mesh(ffi, mesh):
    """The C mesh (tp_mesh) over `mesh`'s pairs, and its links: C memory the caller keeps."""
    cmesh = ffi.new("tp_mesh *")
    cmesh.rank = mesh.rank
    cmesh.size = mesh.size
    links = {}
    for peer, pair in mesh.pairs.items():
        link = ffi.new("tp_link *")
        link.pair = pair.state
        link.dev = pair.rdma.dev if pair.rdma is not None else ffi.NULL
        link.fd = pair.data.fileno()
        link.rank = pair.rank
        link.spin_ns = pair.spin_ns
        link.timeout_s = pair.timeout
        cmesh.links[peer] = link
        links[peer] = link
    return cmesh, links


class MeshGroup(_pairgroup.MeshGroup):
    """The N ranks of a mesh (rank 0 the leader). Beside MLX's surface: ``transport`` ("tcp",
    "rdma", or "mixed" when the links differ), ``links()`` (each link's transport and RDMA
    queue pair builds), ``close()`` (also a context manager), ``mesh`` (the pairs)."""

    def __init__(self, mesh):
        ffi, lib = load_verbs()
        cmesh, links = _c_mesh(ffi, mesh)
        super().__init__(mesh.rank, mesh.size, _address(ffi, cmesh),
                         _address(ffi, lib.tp_mesh_exchange_address()),
                         _address(ffi, lib.tp_sum2_address()),
                         _address(ffi, lib.tp_mesh_close_address()))
        self._take(cmesh, links, mesh)

    def _take(self, cmesh, links, mesh) -> None:
        self._cmesh, self._links = cmesh, links  # C memory the backend reads: kept with the group
        self._mesh = mesh
        kinds = set(mesh.transports().values())
        self.transport = kinds.pop() if len(kinds) == 1 else "mixed"

    def reattach(self, mesh) -> None:
        """Run this closed group over a new mesh of the same ranks, this rank at its place
        (`ds4tp serve` taking a restarted rank back): a model split over this group, whose
        layers hold it, works on unchanged; nothing of the old mesh is carried over."""
        if self._mesh is not None:
            raise TransportError("this mesh is still open; close() it before reattach()")
        if (mesh.rank, mesh.size) != (self.rank(), self.size()):
            raise ValueError(f"the new mesh makes this process rank {mesh.rank} of {mesh.size}; the group "
                             f"is rank {self.rank()} of {self.size()}: a group keeps its rank and size")
        ffi, _ = load_verbs()
        cmesh, links = _c_mesh(ffi, mesh)
        self._attach_backend(_address(ffi, cmesh))
        self._take(cmesh, links, mesh)

    @property
    def mesh(self):
        if self._mesh is None:
            raise TransportError("this group is closed; create a new one with mlx_ds4tp.init(...)")
        return self._mesh

    def links(self) -> Dict[int, dict]:
        """{peer rank: {"transport", "builds"}}: each link's transport and, over RDMA, how many
        times its queue pair was built (1: the first warm-up passed)."""
        out = {}
        for peer, pair in sorted(self.mesh.pairs.items()):
            builds = pair.rdma.setup_attempt + 1 if pair.rdma is not None else 0
            out[peer] = {"transport": pair.transport, "builds": builds}
        return out

    def close(self) -> None:
        """Stop the collectives of this mesh and its subgroups (one in flight is woken and
        fails), then close every link."""
        if self._mesh is None:
            return
        self._close_backend()
        mesh, self._mesh = self._mesh, None
        mesh.close()

    def __enter__(self) -> "MeshGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
            pass

    # -- statistics: the mesh keeps no gate latency ring (the pair's does), so its figures say
    # nothing was measured, as MLX's own groups do (collectives.backend.MlxGroup).
    def gate_latency_us(self) -> Tuple[float, float]:
        return 0.0, 0.0

    def exchange_seconds(self) -> float:
        return 0.0

    def gates(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<mlx_ds4tp MeshGroup rank={self.rank()} size={self.size()} transport={self.transport}>"
