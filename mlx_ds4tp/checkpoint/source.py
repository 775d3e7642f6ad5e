"""`--model`: a local mlx-lm model directory or a Hugging Face repo id.

A repo id is resolved with mlx-lm's own helper (`hf_repo_to_path`, the Hugging Face cache,
local files only). Only a leader downloads one it lacks (checkpoint/hub.py): its workers either
hold the same files already or, started without --model, receive their parts from it.
"""

from __future__ import annotations

from pathlib import Path


def resolve_model(model: str, download: bool = False) -> Path:
    """The directory holding `model`'s config.json; FileNotFoundError naming it and the fix.
    download: a repo id not in the cache is downloaded (the leader's)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"--model {model} is a file; give an mlx-lm model directory or a "
                                "Hugging Face repo id")
    looks_like_repo = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise FileNotFoundError(f"--model {model}: no such directory (a Hugging Face repo id is "
                                "written OWNER/NAME, e.g. mlx-community/Qwen3-0.6B-4bit)")
    try:
        from mlx_lm.utils import hf_repo_to_path

        resolved = hf_repo_to_path(model)
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises several kinds; all mean "not here"
        if download:
            from .hub import download_model

            return _checked(model, download_model(model))
        raise FileNotFoundError(
            f"--model {model}: not a local directory and not in the Hugging Face cache of this "
            f"machine ({type(exc).__name__}); only a leader downloads: fetch it first here "
            f"(`hf download {model}`), give the directory, or start this worker without --model "
            "to receive its part from the leader") from None
    return _checked(model, resolved)


def _checked(model: str, resolved: Path) -> Path:
    if not (resolved / "config.json").is_file():
        raise FileNotFoundError(f"--model {model} resolved to {resolved}, which has no config.json; "
                                "download the whole repo on both machines")
    return resolved


def resolve_model_arg(model: str, download: bool = False) -> Path:
    """resolve_model for a command line: the error becomes the command's one-line exit."""
    try:
        return resolve_model(model, download)
    except FileNotFoundError as exc:
        raise SystemExit(f"ds4tp: {exc}") from None
