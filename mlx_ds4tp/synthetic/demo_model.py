"""The demo's model: a small llama with fixed random weights, built once into the cache (the
bench's preset models are built the same way)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..base.log import log

DEMO_PRESET = "tiny"
DEMO_SEED = 0
DEMO_PRESET_N = "tiny8"  # the demo over 3 to 8 ranks: 8 KV heads


def demo_model_dir(ranks: int = 2) -> Path:
    """Built once with fixed random weights, then reused from the cache. More than two ranks
    take the same small llama with 8 KV heads (DEMO_PRESET_N): the demo's 2 cannot be cut in 3."""
    from .tiny_model import PRESETS, save_llama

    preset = DEMO_PRESET if PRESETS[DEMO_PRESET].kv_heads % ranks == 0 else DEMO_PRESET_N
    return cached_model(f"demo-llama-{preset}-seed{DEMO_SEED}", "the demo model",
                        lambda path: save_llama(path, preset, seed=DEMO_SEED))


def cached_model(name: str, what: str, save: Callable[[Path], object]) -> Path:
    """~/.cache/mlx_ds4tp/NAME (or under $XDG_CACHE_HOME), written by save(directory) once, then
    reused. Safe to call from both ranks at once (`ds4tp serve --model demo` twice): the first
    builds, under a lock, while the other waits, so neither reads a directory the other is
    replacing."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_ds4tp"
    path = root / name
    if _built(path):
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(path):
            log(f"building {what} (synthetic random weights) in {path}")
            tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
            save(tmp)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
    return path


def _built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
