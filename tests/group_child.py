"""One rank of a group of N found by discovery (tests/test_discovery_group.py runs these in
network namespaces), run as a script:

    group_child.py INTERFACE SIZE GO_FILE TIMEOUT [init_pair]

The secret is the environment's DS4_TP_SECRET. The rank imports everything, prints "ready",
waits for GO_FILE (so the ranks start looking together, not when their interpreters happen to
finish loading), then finds the group (link.findgroup.find_group, TIMEOUT seconds), inits the
mesh with what it found (mlx_ds4tp.init(**found.init_kwargs())), and checks it with an
all_sum (each rank adds rank + 1: every rank must hold N(N+1)/2) and an all_gather of the
ranks (0 .. N-1, once each). With `init_pair` it makes the group in one call instead,
mlx_ds4tp.gate_ops.init_pair(discovering settings of size N), as `ds4tp run|serve` will.
Prints one JSON object as its last stdout line.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

import mlx_ds4tp as tp  # noqa: E402
from mlx_ds4tp.errors import GroupNotFoundError  # noqa: E402
from mlx_ds4tp.link.config import DiscoverySettings, LinkSettings, PairAddress  # noqa: E402
from mlx_ds4tp.link.findgroup import find_group  # noqa: E402
from mlx_ds4tp.link.hello import ModelIdentity  # noqa: E402


def main() -> int:
    interface, size, go_file, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    link = LinkSettings(PairAddress(None, None, None), "tcp", timeout=timeout,
                        discovery=DiscoverySettings((interface,)), size=size)
    identity = ModelIdentity()
    print("ready", flush=True)
    until = time.monotonic() + 120
    while not os.path.exists(go_file):
        if time.monotonic() > until:
            print(json.dumps({"error": "no go file within 120 s"}))
            return 2
        time.sleep(0.01)
    began = time.time()
    if sys.argv[5:] == ["init_pair"]:
        return _in_one_call(link, identity, began)
    try:
        found = find_group(link, identity)
    except GroupNotFoundError as exc:
        print(json.dumps({"error": str(exc), "kind": "not found", "after": time.time() - began,
                          "instance": _instance()}))
        return 1
    found_at = time.time()
    g = tp.init(**found.init_kwargs(), transport="tcp", timeout=60.0, identity=identity)
    total = tp.all_sum(mx.array([float(g.rank() + 1)]), group=g)
    ranks = tp.all_gather(mx.array([g.rank()], dtype=mx.int32), group=g)
    mx.eval(total, ranks)
    formed_at = time.time()
    result = {"rank": g.rank(), "size": g.size(), "role": found.role, "found_rank": found.rank,
              "sum": total.item(), "ranks": ranks.tolist(), "began": began, "found_at": found_at,
              "formed_at": formed_at, "roster": [list(r) for r in found.roster],
              "address": list(found.address), "instance": _instance()}
    g.close()
    print(json.dumps(result), flush=True)
    return 0


def _in_one_call(link: LinkSettings, identity: ModelIdentity, began: float) -> int:
    from mlx_ds4tp.gate_ops import init_pair

    g = init_pair(link, identity)
    total = tp.all_sum(mx.array([float(g.rank() + 1)]), group=g)
    ranks = tp.all_gather(mx.array([g.rank()], dtype=mx.int32), group=g)
    mx.eval(total, ranks)
    print(json.dumps({"rank": g.rank(), "size": g.size(), "sum": total.item(), "ranks": ranks.tolist(),
                      "began": began, "formed_at": time.time(), "instance": _instance()}), flush=True)
    g.close()
    return 0


def _instance() -> str:
    """This process's advert's instance id (what the others' rosters and logs name it by)."""
    from mlx_ds4tp.link import meet

    return next(iter(meet._finders.values())).me.instance


if __name__ == "__main__":
    sys.exit(main())
