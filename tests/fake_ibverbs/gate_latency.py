"""16 KiB gate latency over the real ibverbs provider with the fake libibverbs,
beside ucsim's, in one run: pairs of two processes (tests/fake_ibverbs/
pair_rank.py), the two contenders alternating ROUNDS times so a drift of the
machine hits both alike. Prints one JSON object per pair, then the medians.

    python tests/fake_ibverbs/gate_latency.py [ITERS] [ROUNDS]

Both run ucsim's engine underneath (datagrams over loopback): the difference
is the provider layer, i.e. the header inlines through rdma-core's ops table
and the fake's translation, against ucsim called directly.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from mlx_ds4tp.onehost.localpair import free_port  # noqa: E402


def run_pair(library: str, device: str, iters: int) -> dict:
    port = free_port("127.0.0.1")
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "pair_rank.py"), role, str(port),
                               library, device, f"bench:{iters}"], env=dict(env, DS4_TP_FAKE_IBV_ROLE=role),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("leader", "worker")]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a rank failed:\n{out}\n{err}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    out_dir = tempfile.mkdtemp(prefix="fake_ibverbs_")
    built = subprocess.run([sys.executable, os.path.join(HERE, "build.py"), out_dir],
                           capture_output=True, text=True, check=True)
    library = built.stdout.strip().splitlines()[-1]
    contenders = {"rdma-ucsim": ("", "ucsim"), "rdma-ibverbs-fake": (library, "")}
    got = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (lib_path, device) in contenders.items():
            rec = run_pair(lib_path, device, iters)
            got[name].append(rec)
            print(json.dumps({"name": name, "bytes": 16384, **rec}), flush=True)
    for name, recs in got.items():
        print(json.dumps({"name": name, "bytes": 16384, "iters": iters, "rounds": rounds,
                          "p50_us": statistics.median(r["p50_us"] for r in recs),
                          "p99_us": statistics.median(r["p99_us"] for r in recs), "median_of_rounds": True}))


if __name__ == "__main__":
    main()
