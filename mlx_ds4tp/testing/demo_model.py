"""The demo's model: a small llama with fixed random weights, built once into the cache."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from ..base.log import log

DEMO_PRESET = "tiny"
DEMO_SEED = 0


def demo_model_dir() -> Path:
    """Built once with fixed random weights, then reused from the cache. Safe to call from
    both ranks at once (`ds4tp serve --model demo` twice): the first builds, under a lock,
    while the other waits, so neither reads a directory the other is replacing."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_ds4tp"
    path = root / f"demo-llama-{DEMO_PRESET}-seed{DEMO_SEED}"
    if _built(path):
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _build(root, path)
    return path


def _built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def _build(root: Path, path: Path) -> None:
    from .tiny_model import save_llama

    if not _built(path):
        log(f"building the demo model (synthetic random weights) in {path}")
        tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=root))
        save_llama(tmp, DEMO_PRESET, seed=DEMO_SEED)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)
