"""tools/layout_check.py's group rules on a copy of the package: the tree as it is passes; an
isinstance() on a group class of collectives/ outside link/ and collectives/ fails naming its
file:line; so do size-2-style branches past the allowance, each named; inside link/ they pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tree(tmp_path):
    """A copy of tools/layout_check.py and the package's Python modules (all the check reads)."""
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "layout_check.py", tmp_path / "tools")
    shutil.copytree(REPO / "mlx_ds4tp", tmp_path / "mlx_ds4tp",
                    ignore=shutil.ignore_patterns("*.so", "*.o", "__pycache__", "csrc"))
    return tmp_path


def check(tree: Path):
    res = subprocess.run([sys.executable, str(tree / "tools" / "layout_check.py")], capture_output=True,
                         text=True, timeout=120)
    return res.returncode, res.stdout


def test_the_package_as_it_is_passes(tree):
    assert check(tree) == (0, "")


def test_an_isinstance_on_a_group_class_is_named_by_file_and_line(tree):
    planted = tree / "mlx_ds4tp" / "cli" / "planted.py"
    planted.write_text("from ..collectives.group import Group\n\n\ndef f(g):\n"
                       "    return isinstance(g, (int, Group))\n")
    rc, out = check(tree)
    assert rc == 1 and "mlx_ds4tp/cli/planted.py:5: isinstance() on a group class" in out, out
    # MLX's own class is the interface every group has: asking for it is no kind test.
    planted.write_text("import mlx.core as mx\n\n\ndef f(g):\n    return isinstance(g, mx.distributed.Group)\n")
    assert check(tree) == (0, "")


def test_size_branches_past_the_allowance_are_each_named(tree):
    lines = ["def f(group, size, ranks):"] + [f"    a{i} = group.size() == 2" for i in range(3)] + \
        ["    b = size > 2", "    c = 3 <= ranks", "    d = (size or 2) == 2", "    return a0, b, c, d"]
    (tree / "mlx_ds4tp" / "lockstep" / "planted.py").write_text("\n".join(lines) + "\n")
    rc, out = check(tree)
    assert rc == 1, out
    for line in range(2, 8):
        assert f"mlx_ds4tp/lockstep/planted.py:{line}: a size compared with 2 or 3" in out, out
    # The same in link/, where the pair's and the mesh's formation on the wire differ, is allowed.
    (tree / "mlx_ds4tp" / "lockstep" / "planted.py").rename(tree / "mlx_ds4tp" / "link" / "planted.py")
    assert check(tree) == (0, "")
