"""A leader's `--model OWNER/NAME` not yet on its machine, downloaded from the Hugging Face Hub as
mlx-lm does (huggingface_hub's snapshot_download, mlx-lm's file patterns, its progress bars), so
a cluster downloads each model once: its workers started without --model receive their parts.
huggingface_hub reads HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE itself."""

from __future__ import annotations

from pathlib import Path

from ..base.log import log


def download_model(repo: str) -> Path:
    """The local snapshot of `repo`, downloaded now where the cache lacks it; FileNotFoundError
    naming the repo, the cause and the fix when it cannot be."""
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    log(f"--model {repo}: not on this machine; downloading it from the Hugging Face Hub (once: "
        "the workers started without --model receive their parts from here)")
    try:
        path = Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises many kinds; each means "not fetched"
        raise FileNotFoundError(
            f"--model {repo}: not in this machine's Hugging Face cache and the download failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); check the "
            "repo id, the network, HF_TOKEN for a gated repo and HF_HUB_OFFLINE, or give a directory") from None
    log(f"--model {repo}: downloaded to {path}")
    return path


__all__ = ["download_model"]
