"""`ds4tp doctor [--ranks N]` (N = 2 to 8, 2 by default): the checks of a group of N ranks
(doctor.py calls these).

On this machine alone: a group of N ranks in this process over the emulated RDMA device (ucsim),
every link's bring-up and warm-up as a group's are, then all_sums checked exact on every rank.
Over the real group (`--listen HOST PORT [--ranks N]` on the leader's machine, `--peer HOST PORT`
on the N-1 others, or `--interface NAME [--ranks N]` on all N): a short run of the group's
collective, an all_sum of 16 KiB, timed (p50, p99), each link's transport named and the sums
checked exact on every rank; with --model, the share `--split auto` would pick for the N ranks
and the one `--split even` takes (the nearest the model's counts allow, 3:3:2 for 8 KV heads on
3 ranks, said to be uneven).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..link.config import MAX_MESH_SIZE, MLX
from ..link.rdma import UCSIM
from .doctor_lines import FAIL, OK, Check, line
from .doctor_wiring import wiring_checks
from .pair_args import ranks_from_args

# The all_sums of the local mesh, and the round trip's timed ones (the first WARM_SUMS not
# counted: the links' first messages and MLX's first graphs are slower than the steady state).
LOCAL_SUMS = 200
ROUND_TRIPS = 2000
WARM_SUMS = 200
# 16 KiB of float32: the pair's round trip's message, so the two are read side by side.
ELEMENTS = 4096
# How long the local mesh's ranks may take, all together (bring-up, warm-up and the sums).
LOCAL_LIMIT_SEC = 60.0
RANKS_HELP = (f"how many machines (ranks) to check, 2 to {MAX_MESH_SIZE} (default 2: a pair); "
              "alone: a mesh of N in this process over ucsim; with --listen: the group's leader; "
              "with --interface: every one of the N runs it; --peer needs none (the leader's N)")


def add_ranks_arg(p: argparse.ArgumentParser) -> None:
    """doctor's --ranks: None when not given (a --peer then takes the leader's N, where it can)."""
    p.add_argument("--ranks", type=int, default=None, metavar="N", help=RANKS_HELP)


def group_size(args: argparse.Namespace, peer: bool = False) -> Optional[int]:
    """The group size this doctor checks: --ranks (checked: 2 .. 8, else exit naming the value),
    else 2, or for a --peer the leader's (None: it learns N from the leader). --ranks 3 or more
    with --transport mlx exits saying why and what to give."""
    if args.ranks is None:
        return None if peer else 2
    size = ranks_from_args(args, "doctor")
    if size > 2 and args.transport == MLX:
        raise SystemExit(f"ds4tp doctor: --ranks {size} with --transport mlx: a group of more than two "
                         "ranks is our mesh, which MLX's own group (ring or JACCL) is not; give "
                         "--transport auto, tcp or rdma, or --ranks 2")
    return size


def check_ucsim_group(size: int) -> List[Check]:
    """`size` ranks in this process (one thread each) over the emulated device: every link's
    bring-up and warm-up, then LOCAL_SUMS all_sums, each exact on every rank."""
    import mlx.core as mx

    from .. import gate_ops
    from ..onehost.localpair import free_port

    here = ("127.0.0.1", free_port())
    groups: List[Any] = [None] * size
    errors: List[str] = []

    def rank(r: int) -> None:
        where = ({"role": "leader", "listen": here} if r == 0
                 else {"role": "worker", "coordinator": here, "rank": r})
        try:
            g = groups[r] = gate_ops.init(transport="rdma", rdma_device=UCSIM, timeout=20.0,
                                          size=size, **where)
            x = mx.full((ELEMENTS,), float(r + 1), dtype=mx.float32)
            want = size * (size + 1) / 2
            for i in range(LOCAL_SUMS):
                y = gate_ops.all_sum(x, group=g)
                if not mx.all(y == want).item():
                    errors.append(f"rank {r}'s all_sum {i} is {y[:2].tolist()}..., not {want}")
                    return
        except Exception as exc:  # noqa: BLE001 - reported as a doctor line
            errors.append(f"rank {r}: {exc}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    deadline = t0 + LOCAL_LIMIT_SEC
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    for g in groups:
        if g is not None:
            g.close()
    what = f"ucsim group of {size}"
    if errors or hung:
        said = "; ".join(errors) or f"rank(s) {', '.join(map(str, hung))} did not finish in {LOCAL_LIMIT_SEC:.0f} s"
        return [line(FAIL, what, said)]
    return [line(OK, what, f"bring-up, warm-up and {LOCAL_SUMS} all_sums in {time.perf_counter() - t0:.2f} s")]


def links_line(group: Any) -> str:
    """This rank's links as `0<->1 tcp, 0<->2 rdma`."""
    me = group.rank()
    return ", ".join(f"{me}<->{peer} {link['transport']}" for peer, link in group.links().items())


def timed_sums(group: Any) -> Tuple[List[int], int]:
    """ROUND_TRIPS all_sums of ELEMENTS float32 (rank r sends r + 1 everywhere): each one's
    nanoseconds, and how many sums came out wrong on all the ranks together (one more all_sum
    tells every rank the others' counts)."""
    import mlx.core as mx

    from .. import gate_ops

    size, rank = group.size(), group.rank()
    x = mx.full((ELEMENTS,), float(rank + 1), dtype=mx.float32)
    want = mx.full((ELEMENTS,), size * (size + 1) / 2, dtype=mx.float32)
    mx.eval(x, want)
    samples, wrong = [], 0
    for _ in range(ROUND_TRIPS):
        t0 = time.perf_counter_ns()
        y = gate_ops.all_sum(x, group=group)
        mx.eval(y)
        samples.append(time.perf_counter_ns() - t0)
        # Checked outside the timed span, every sum: a link that corrupts one in a thousand shows.
        wrong += not mx.array_equal(y, want).item()
    total = gate_ops.all_sum(mx.array([wrong], dtype=mx.int32), group=group)
    return samples, int(total.item())


def group_checks(group: Any, model: Optional[str], where: str) -> List[Check]:
    """The checks of a formed group of N ranks: its links, with --model the fingerprints (the
    links' hellos compared them) and the shares, then the timed all_sums."""
    from ..bench.gates import percentiles

    size, rank = group.size(), group.rank()
    out = [line(OK, f"group of {size}", f"this Mac is rank {rank}; links {links_line(group)}")]
    if model is not None:
        out.append(fingerprint_line(group, model))
        out += share_lines(group, model)
    samples, wrong = timed_sums(group)
    p = percentiles(samples[WARM_SUMS:])
    exact = "exact on every rank" if wrong == 0 else f"WRONG DATA: {wrong} sum(s) wrong across the ranks"
    out.append(line(OK if wrong == 0 else FAIL, f"all_sum round trip with {where}",
                    f"{size} ranks, transport {group.transport}, 16 KiB p50 {p['p50_us']} us "
                    f"p99 {p['p99_us']} us over {ROUND_TRIPS - WARM_SUMS}, {exact}"))
    return out + wiring_checks(group)


def fingerprint_line(group: Any, model: str) -> Check:
    """This rank's model fingerprint and each peer's, as their links' hellos carried them (a
    difference had stopped the hello: the mesh would not have formed)."""
    peers = [r for r in range(group.size()) if r != group.rank()]
    here = group.link_to(peers[0]).fingerprint_labels()[0]
    theirs = ", ".join(f"rank {peer} {group.link_to(peer).fingerprint_labels()[1]}" for peer in peers)
    return line(OK, "model fingerprint", f"{here} here; {theirs} ({model})")


def rank_figures(group: Any) -> list:
    """Every rank's figures in rank order: this rank's own, and each peer's from its link's hello."""
    peers = [r for r in range(group.size()) if r != group.rank()]
    mine = group.link_to(peers[0]).mine.figures
    return [mine if r == group.rank() else group.link_to(r).peer_hello.figures for r in range(group.size())]


def share_lines(group: Any, model: str) -> List[Check]:
    """The share `--split auto` would pick for these N ranks (every rank prints the same: the
    same arithmetic on the same N hellos' figures), and the one `--split even` takes."""
    from ..split.apply import ModelCuts
    from ..split.auto import choose_share_among, figures_line, model_need

    size = group.size()
    figures = rank_figures(group)
    said = "; ".join(figures_line(f"rank {r}", f) for r, f in enumerate(figures))
    try:
        need = model_need(Path(model), 0)
        cuts = ModelCuts(need.path)
        share = choose_share_among(figures, need, granules=cuts.granules,
                                   parts=lambda s: cuts.parts(s, size))
    except (ValueError, FileNotFoundError, KeyError) as exc:
        return [line(FAIL, "split auto", f"{exc} ({said})")]
    auto = line(OK, "split auto", f"would pick {share} (rank 0's part first) for the {size} ranks: {said}")
    return [auto, even_line(cuts, size)]


def even_line(cuts: Any, size: int) -> Check:
    """What `--split even` takes on `size` ranks: one part each where every count divides by
    `size`, else the nearest cut the counts allow (uneven: the ranks with more wait less)."""
    from ..split.share import EVEN

    try:
        layout = cuts.layout(EVEN, size)
    except ValueError as exc:
        return line(FAIL, "split even", str(exc))
    if layout.is_even:
        return line(OK, "split even", f"{layout.cut} on {size} ranks: every count divides by {size}")
    columns = ("" if layout.columns is None or layout.columns == layout.cut else
               f" for the attention, {layout.columns} for the MLP's columns and the vocabulary")
    return line(OK, "split even", f"{layout.cut}{columns} (rank 0's part first): the model's counts do not "
                f"divide by {size}, so --split even takes the nearest cut they allow, which is uneven")
