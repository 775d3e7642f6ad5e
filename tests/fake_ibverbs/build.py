"""Build the tests' fake libibverbs (fake_ibverbs.c beside this script, with
ucsim's engine from mlx_ds4tp/ linked in).

    python tests/fake_ibverbs/build.py OUT_DIR

prints the shared library's path as its last line. Point the real ibverbs
provider at it with DS4_TP_VERBS_LIBRARY=PATH (Python) or
lib.tp_set_verbs_library(PATH). Needs a C compiler and rdma-core's
infiniband/verbs.h (Debian: libibverbs-dev), whose ABI the fake implements.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(os.path.dirname(HERE)), "mlx_ds4tp")
SOURCES = [os.path.join(HERE, "fake_ibverbs.c"),
           os.path.join(PKG, "csrc", "util.c"),
           os.path.join(PKG, "csrc", "rdma", "ucsim.c")]
LIBRARY = "libfake_ibverbs.dylib" if sys.platform == "darwin" else "libfake_ibverbs.so"


def build(out_dir: str) -> str:
    """Compile the fake into out_dir; returns the library's path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit("build.py: no C compiler found (set CC)")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(os.path.abspath(out_dir), LIBRARY)
    # Hidden by default: only the ibv_* entry points are exported, so the
    # engine's tp_* symbols never mix with those of mlx_ds4tp._verbs when
    # both live in one process.
    cmd = [cc, "-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-fvisibility=hidden",
           "-I", os.path.join(PKG, "csrc"), *SOURCES, "-o", out, "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"build.py: {' '.join(cmd)} failed:\n{res.stderr}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/fake_ibverbs/build.py OUT_DIR")
    print(build(sys.argv[1]))
