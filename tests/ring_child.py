"""One rank of a group over a ring (tests/test_group_ring.py runs N of these), run as a script:

    ring_child.py RANK PORT TRANSPORT SIZE CASE

The group forms as a full mesh (tests/mesh_child.py's way) with DS4_TP_TOPOLOGY=ring, so its
collectives run over the ring 0-1-...-(N-1)-0 alone. CASE:
  same     every collective over the ring, 1 element to 4 MiB, float32/float16/bfloat16,
           against the rank-order reference and then against the same group's links run as
           the full mesh (the same bytes); the links off the ring carry no exchange (their
           sequence numbers stay); send/recv to a rank that is no neighbour, and a subgroup
           with no way between its members, are refused by name
  cut      the links off the ring shut down first (their data sockets), then mesh_child's
           exact suite over the ring: it never needs them
  matrix   mesh_child's matrix (MLX's collective test matrix, send/recv to the next rank,
           split into evens and odds, compile, grad) over the ring of 3, where those splits
           are neighbours
  rejoin   the group closed and joined again by every rank (reconnect): still over the
           ring, its collectives exact
  partial  a mesh of the ring's links only, cabled out of rank order (0-2-1-3 at 4), as auto
           finds it: the ring learned over the links, then the exact suite
  cabled   every link there, but the mesh says its cables form the ring 0-2-1-3 (--transport
           rdma over a ring of cables): the exact suite round that ring, the other links idle
Prints one JSON object as its last stdout line.
"""

from __future__ import annotations

import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402

import mlx_ds4tp as tp  # noqa: E402
from mesh_child import FLOATS, Report, exact, in_order, join_from_argv, matrix, partial, same  # noqa: E402
from mlx_ds4tp.collectives.group import Group  # noqa: E402
from mlx_ds4tp.link.mesh import Mesh  # noqa: E402


def seqs(g) -> dict:
    return {peer: int(g.c_link(peer).pair.seq) for peer in g.mesh.pairs}


def neighbours(ring, rank: int) -> set:
    k = ring.index(rank)
    return {ring[k - 1], ring[(k + 1) % len(ring)]}


def ring_cases(g):
    """(name, the collective over g) for every collective and size the ring case checks."""
    n, rank = g.size(), g.rank()
    for dtype in FLOATS:
        item = 4 if dtype == mx.float32 else 2
        for count in (1, 5, 16384 // item, 16384 // item + 1, (65536 // item) + 3,
                      (4 << 20) // item, (4 << 20) // item + n - 1):
            parts = [partial(r, dtype, (count,), 7) for r in range(n)]
            case = f"{dtype} {count * item} bytes"
            yield f"all_sum {case}", parts, lambda grp, p=parts: tp.all_sum(p[rank], group=grp), in_order(mx.add, parts)
            yield (f"all_min {case}", parts, lambda grp, p=parts: tp.all_min(p[rank], group=grp),
                   in_order(mx.minimum, parts))
            yield (f"all_gather {case}", parts, lambda grp, p=parts: tp.all_gather(p[rank], group=grp),
                   mx.concatenate(parts))
        rows = [partial(r, dtype, (n * 3000, 4), 8) for r in range(n)]
        if dtype == mx.float32:
            # Odd byte counts past a gate: the opposite member's block split into halves
            # that overlap by a byte (all_gather; all_sum's gathered chunks, one padded).
            odd = [partial(r, mx.uint8, (40001,), 11) for r in range(n)]
            yield ("all_gather uint8 40001", odd, lambda grp, p=odd: tp.all_gather(p[rank], group=grp),
                   mx.concatenate(odd))
            wide = [partial(r, mx.int8, (n * 40001 - 1,), 12) for r in range(n)]
            yield ("all_sum int8 odd chunks", wide, lambda grp, p=wide: tp.all_sum(p[rank], group=grp),
                   in_order(mx.add, wide))
        want = in_order(mx.add, rows)[rank * 3000:(rank + 1) * 3000]
        yield (f"sum_scatter {dtype}", rows, lambda grp, p=rows: tp.sum_scatter(p[rank], group=grp), want)


def same_case(g) -> dict:
    report = Report()
    n, rank = g.size(), g.rank()
    report.check("ring", g.ring == list(range(n)))
    near = neighbours(g.ring, rank)
    before = seqs(g)
    got = {}
    for name, _, run, want in ring_cases(g):
        y = run(g)
        report.check(f"ring {name}", same(y, want))
        got[name] = bytes(memoryview(y))
    # send/recv with each neighbour; a rank two places on is refused by name.
    x = partial(rank, mx.float32, (100,), 9)
    if rank == 0:
        report.check("send to a neighbour", same(tp.send(x, 1, group=g), x))
    elif rank == 1:
        report.check("recv from a neighbour", same(tp.recv((100,), mx.float32, 0, group=g),
                                                   partial(0, mx.float32, (100,), 9)))
    if n >= 4:
        try:
            mx.eval(tp.send(x, (rank + 2) % n, group=g))
            report.check("send off the ring refused", False)
        except ValueError as exc:
            report.check("send off the ring refused", "no neighbour" in str(exc) and "ring 0-1-2" in str(exc))
        try:
            g.split(rank % 2)
            report.check("split off the ring refused", False)
        except ValueError as exc:
            report.check("split off the ring refused", "no way between its members" in str(exc))
    # Every rank in one subgroup, in reverse order: still the whole ring.
    sub = g.split(0, key=n - rank)
    parts = [partial(r, mx.float32, (70000,), 10) for r in range(n)]
    report.check("reversed subgroup", same(tp.all_sum(parts[rank], group=sub),
                                           in_order(mx.add, parts[::-1])))
    after = seqs(g)
    idle = {p: after[p] - before[p] for p in after if p not in near}
    busy = {p: after[p] - before[p] for p in after if p in near}
    # The same links as the full mesh: the same bytes.
    mesh = Group(g.mesh, "mesh")
    report.check("mesh twin", mesh.ring == [])
    for name, _, run, _want in ring_cases(g):
        report.check(f"mesh same as ring {name}", bytes(memoryview(run(mesh))) == got[name])
    used_all = all(seqs(g)[p] > after[p] for p in after)
    drop(mesh)
    return {"cases": report.cases, "failed": report.failed, "idle": idle, "busy": busy,
            "mesh_used_all": used_all}


def drop(twin) -> None:
    """A second group over g's links stopped, its links left for g to close."""
    twin._close_backend()
    twin._mesh = None


def cut_case(g) -> dict:
    near = neighbours(g.ring, g.rank())
    for peer, pair in g.mesh.pairs.items():
        if peer not in near:
            pair.data.shutdown(socket.SHUT_RDWR)
    result = exact(g)
    result["cut"] = sorted(set(g.mesh.pairs) - near)
    return result


def rejoin_case(g) -> dict:
    g.close()
    tp.reconnect(g)
    result = exact(g)
    result["ring"] = g.ring
    return result


def partial_case(g) -> dict:
    n, rank = g.size(), g.rank()
    cabled = list(range(0, n, 2)) + list(range(1, n, 2))  # 0-2-1-3 at 4, 0-2-4-1-3 at 5
    near = neighbours(cabled, rank)
    ring_only = Mesh(rank, n, {p: g.mesh.pairs[p] for p in near}, b"", None, [])
    pg = Group(ring_only, "auto")
    result = exact(pg)
    result["ring"] = pg.ring
    drop(pg)
    return result


def cabled_case(g) -> dict:
    """--transport rdma over cables that form a ring (link/mesh.py's Mesh.cabled_ring): every
    link is there, the collectives go round the cabled ring 0-2-1-3 alone, the other links
    (the TCP ones between ranks without a cable) carry not one exchange."""
    n, rank = g.size(), g.rank()
    cabled = list(range(0, n, 2)) + list(range(1, n, 2))
    ringed = Mesh(rank, n, dict(g.mesh.pairs), b"", None, [], cabled_ring=cabled)
    before = seqs(g)
    pg = Group(ringed, "auto")
    result = exact(pg)
    after = seqs(g)
    result["ring"] = pg.ring
    result["transport"] = pg.transport
    result["idle"] = {p: after[p] - before[p] for p in after if p not in neighbours(cabled, rank)}
    try:
        Group(ringed, "mesh")
        result["mesh_refused"] = ""
    except Exception as exc:  # noqa: BLE001 - the refusal's text is what the test checks
        result["mesh_refused"] = str(exc)
    drop(pg)
    return result


def main() -> None:
    g, case = join_from_argv()
    size = g.size()
    if g.ring != list(range(size)):
        raise SystemExit(f"DS4_TP_TOPOLOGY=ring but the group runs over {g!r}")
    result = {"same": same_case, "cut": cut_case, "partial": partial_case, "matrix": matrix,
              "rejoin": rejoin_case, "cabled": cabled_case}[case](g)
    result["rank"] = g.rank()
    print(json.dumps(result), flush=True)
    g.close()


if __name__ == "__main__":
    main()
