"""The demo's model: a small llama with fixed random weights, built once into the cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..base.log import log

DEMO_PRESET = "tiny"
DEMO_SEED = 0


def demo_model_dir() -> Path:
    """Built once with fixed random weights, then reused from the cache."""
    from .tiny_model import save_llama

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_ds4tp"
    path = root / f"demo-llama-{DEMO_PRESET}-seed{DEMO_SEED}"
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        log(f"building the demo model (synthetic random weights) in {path}")
        tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=root if root.exists() else None))
        save_llama(tmp, DEMO_PRESET, seed=DEMO_SEED)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)
    return path
