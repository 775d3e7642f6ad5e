"""The worker rank of an in-test leader, as its own process (tests/test_serve_units.py):

    worker_child.py MODEL_DIR PORT

joins the pair on 127.0.0.1:PORT over tcp, loads its half of the model and runs the serving
command loop until the leader says stop; prints {"steps": ...} as its last line. Two ranks
evaluating in one process would share MLX's scheduler, whose cap on tasks in flight is
global: one rank's gate waiting for the other could stall the other's graph before it gets
there.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx_ds4tp as tp  # noqa: E402
from mlx_ds4tp.lockstep.protocol.sessions import serve_worker  # noqa: E402
from mlx_ds4tp.model_split import load_split  # noqa: E402


def main() -> None:
    path, port = sys.argv[1], int(sys.argv[2])
    with tp.init(role="worker", coordinator=("127.0.0.1", port), transport="tcp", timeout=60.0) as g:
        split, _ = load_split(path, g)
        table = serve_worker(g, split)
    print(json.dumps({"steps": table.batch.step_count}), flush=True)


if __name__ == "__main__":
    main()
