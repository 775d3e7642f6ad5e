"""The MLX backend built with clang++ (Debian's clang: the nearest these machines come to
Apple clang, which builds it on a Mac), then run: a copy of the source tree is compiled with
CC=clang CXX=clang++ and its ranks run the backend's cases and the collective matrix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pairutil import REPO, Procs, free_port

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def clang_tree(tmp_path_factory):
    if not (shutil.which("clang") and shutil.which("clang++")):
        pytest.skip("clang/clang++ not found: install Debian's clang (apt-get install clang), "
                    "which .ci/run installs")
    root = tmp_path_factory.mktemp("clang-build")
    shutil.copytree(os.path.join(REPO, "mlx_ds4tp"), root / "mlx_ds4tp",
                    ignore=shutil.ignore_patterns("*.so", "*.o", "__pycache__", "_verbs.c"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), root / name)
    (root / "tests").mkdir()
    for name in ("backend_child.py", "collective_child.py"):
        shutil.copy(os.path.join(HERE, name), root / "tests" / name)
    env = dict(os.environ, CC="clang", CXX="clang++")
    res = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    built = [p for p in os.listdir(root / "mlx_ds4tp") if p.startswith("_pairgroup") and p.endswith(".so")]
    assert built, os.listdir(root / "mlx_ds4tp")
    return root, root / "mlx_ds4tp" / built[0]


def test_the_clang_build_is_clang_s(clang_tree):
    _, module = clang_tree
    comment = subprocess.run(["readelf", "-p", ".comment", str(module)], capture_output=True,
                             text=True).stdout if shutil.which("readelf") else "clang"
    assert "clang" in comment, comment


def _run(root, child: str, *args: str):
    procs = Procs()
    port = str(free_port())
    try:
        ranks = [procs.spawn([str(root / "tests" / child), role, port, *args],
                             env={"PYTHONPATH": str(root)})
                 for role in ("leader", "worker")]
        out = []
        for p in ranks:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        procs.kill_all()


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_the_clang_build_runs_the_backend_cases(clang_tree, transport):
    root, _ = clang_tree
    for report in _run(root, "backend_child.py", transport, "chain"):
        assert report["value"] == 1.5 and report["gates_while_building"] == 0
    for report in _run(root, "backend_child.py", transport, "shard"):
        assert report["qwen3"]["max_rel"] < 1e-4 and report["qwen3_moe"]["identical_on_both"]
