"""tools/layout_check.py's rules, each on a tree of its own: no product module imports
mlx_ds4tp.testing (a planted import, relative or absolute, is named by file and line; testing/'s own
imports of itself and a tree without the import pass); and the group rules on a copy of the package
(the tree as it is passes; an isinstance() on a group class of collectives/ outside link/ and
collectives/ fails naming its file:line; so do size-2-style branches past the allowance, each
named; inside link/ they pass); no package module imports a link face; and none outside link/
imports connect(), one link's steps: a group forms through form_mesh."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tree(root: Path, files: dict) -> None:
    """A checkout of its own at `root`: the layout check and a small package of `files`."""
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "layout_check.py", root / "tools" / "layout_check.py")
    for rel, text in {"mlx_ds4tp/__init__.py": "", "mlx_ds4tp/cli/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "tools" / "layout_check.py")],
                          capture_output=True, text=True, timeout=60)


def test_a_product_module_importing_testing_fails_naming_file_and_line(tmp_path):
    _tree(tmp_path, {
        "mlx_ds4tp/testing/__init__.py": "",
        "mlx_ds4tp/testing/helpers.py": "from . import other\n",
        "mlx_ds4tp/testing/other.py": "",
        "mlx_ds4tp/cli/demo.py": '"""demo"""\n\nfrom ..testing import helpers\n',
        "mlx_ds4tp/cli/bench.py": "def f():\n    import mlx_ds4tp.testing.other\n",
    })
    done = _check(tmp_path)
    assert done.returncode == 1, done.stdout
    assert "mlx_ds4tp/cli/demo.py:3: product module mlx_ds4tp.cli.demo imports mlx_ds4tp.testing.helpers" \
        in done.stdout, done.stdout
    assert "mlx_ds4tp/cli/bench.py:2:" in done.stdout, done.stdout
    assert "testing/helpers.py" not in done.stdout, done.stdout


def test_the_rule_holds_without_a_testing_package(tmp_path):
    _tree(tmp_path, {"mlx_ds4tp/cli/demo.py": "from mlx_ds4tp.testing import localpair\n"})
    done = _check(tmp_path)
    assert done.returncode == 1 and "mlx_ds4tp/cli/demo.py:1:" in done.stdout, done.stdout


def test_a_tree_without_the_import_passes(tmp_path):
    _tree(tmp_path, {"mlx_ds4tp/cli/demo.py": "from ..onehost import localpair\n",
                     "mlx_ds4tp/onehost/__init__.py": "", "mlx_ds4tp/onehost/localpair.py": ""})
    done = _check(tmp_path)
    assert done.returncode == 0, done.stdout


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


def test_a_package_module_importing_a_link_face_is_named(tmp_path):
    """transport.py and warmup.py are for users and tests: a package module that imports either,
    by any spelling, fails naming its file:line; the package's __init__ may re-export them."""
    _tree(tmp_path, {
        "mlx_ds4tp/__init__.py": "from .transport import connect\n",
        "mlx_ds4tp/transport.py": "from .link.handshake import connect\n",
        "mlx_ds4tp/warmup.py": "",
        "mlx_ds4tp/link/__init__.py": "", "mlx_ds4tp/link/handshake.py": "def connect():\n    pass\n",
        "mlx_ds4tp/cli/run.py": '"""run"""\n\nfrom .. import transport as tr\n',
        "mlx_ds4tp/cli/doctor.py": "def f():\n    from mlx_ds4tp.warmup import x\n",
        "mlx_ds4tp/link/mesh.py": "from .handshake import connect\n",
        "mlx_ds4tp/cli/serve.py": "from ..link.mesh import connect\n",
    })
    done = _check(tmp_path)
    assert done.returncode == 1, done.stdout
    assert "mlx_ds4tp/cli/run.py:3: mlx_ds4tp.cli.run imports mlx_ds4tp.transport" in done.stdout, done.stdout
    assert "mlx_ds4tp/cli/doctor.py:2: mlx_ds4tp.cli.doctor imports mlx_ds4tp.warmup" in done.stdout, done.stdout
    assert "serve.py" not in done.stdout and "__init__.py" not in done.stdout, done.stdout


def test_connect_imported_from_outside_link_is_named(tmp_path):
    """A group forms one way (link/mesh.py's form_mesh): a module outside link/ that imports
    link/handshake.py (one link's connect()), by any spelling, fails naming its file:line;
    link/ itself and transport.py (the face tests check one link through) pass."""
    _tree(tmp_path, {
        "mlx_ds4tp/transport.py": "from .link.handshake import connect\n",
        "mlx_ds4tp/warmup.py": "",
        "mlx_ds4tp/link/__init__.py": "", "mlx_ds4tp/link/handshake.py": "def connect():\n    pass\n",
        "mlx_ds4tp/link/mesh.py": "from .handshake import connect\n\n\ndef form_mesh():\n    connect()\n",
        "mlx_ds4tp/gate_ops.py": '"""init"""\n\nfrom .link.handshake import connect\n',
        "mlx_ds4tp/cli/doctor.py": "def f():\n    from ..link import handshake\n",
        "mlx_ds4tp/cli/run.py": "from ..link.mesh import form_mesh\n",
    })
    done = _check(tmp_path)
    assert done.returncode == 1, done.stdout
    assert ("mlx_ds4tp/gate_ops.py:3: mlx_ds4tp.gate_ops imports mlx_ds4tp.link.handshake.connect: "
            "connect() is one link's steps") in done.stdout, done.stdout
    assert "mlx_ds4tp/cli/doctor.py:2: mlx_ds4tp.cli.doctor imports mlx_ds4tp.link.handshake" in done.stdout
    assert "run.py" not in done.stdout and "link/mesh.py" not in done.stdout, done.stdout
    assert "transport.py" not in done.stdout, done.stdout
    (tmp_path / "mlx_ds4tp" / "gate_ops.py").write_text("from .link.mesh import form_mesh\n")
    (tmp_path / "mlx_ds4tp" / "cli" / "doctor.py").write_text("")
    done = _check(tmp_path)
    assert done.returncode == 0 and done.stdout == "", done.stdout
