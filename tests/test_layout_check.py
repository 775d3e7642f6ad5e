"""tools/layout_check.py's rule that no product module imports mlx_ds4tp.testing: a planted
import, relative or absolute, is named by file and line and fails the check; testing/'s own
imports of itself and a tree without the import pass."""

import shutil
import subprocess
import sys
from pathlib import Path

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
