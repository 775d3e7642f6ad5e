"""Both ranks of `ds4tp run` on 127.0.0.1, as two processes."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from ..base.log import log
from . import localpair as _localpair


def run_local_pair(model: Path, prompt: str, max_tokens: int, transport: str,
                   rdma_device: Optional[str], stop_at_eos: bool = True, quiet: bool = False,
                   timeout: float = 1200.0, prompt_tokens: int = 0, extra=(),
                   placement: _localpair.Placement = _localpair.ANYWHERE) -> Optional[dict]:
    """Both ranks of `ds4tp run` on 127.0.0.1 as two processes; returns the leader's tokens
    record (see run's tokens_out) with the worker's peak resident memory (worker_peak_rss_bytes),
    or None when either rank failed (both are killed on any failure, the reason is logged).
    prompt_tokens > 0: the prompt's tokens repeated to that many (see run). extra: more
    `ds4tp run` flags for both ranks (--draft-model ..., --prompt-lookup N). placement: each
    rank's CPUs and environment (localpair.SLOW_WORKER)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    base = _localpair.rank_command(
        "run", "--model", str(model), "--transport", transport, "--max-tokens", str(max_tokens),
        "--no-chat-template", "--prompt", prompt)
    if rdma_device:
        base += ["--rdma-device", rdma_device]
    if not stop_at_eos:
        base += ["--no-eos"]
    if prompt_tokens > 0:
        base += ["--prompt-tokens", str(prompt_tokens)]
    base += list(extra)
    leader, worker = _localpair.pair_commands(base, _localpair.free_port())
    worker_path = out_path + ".worker"
    leader += ["--tokens-out", out_path]
    worker += ["--tokens-out", worker_path]
    try:
        env = _localpair.child_env(dict(placement.env))
        _localpair.run_ranks([leader, worker], [env, env], timeout=timeout,
                             stdout="discard" if quiet else "inherit", cpus=placement.cpus)
        record = json.loads(Path(out_path).read_text())
        record["worker_peak_rss_bytes"] = json.loads(Path(worker_path).read_text())["peak_rss_bytes"]
        return record
    except RuntimeError as exc:
        log(f"the local pair failed: {exc}")
        return None
    finally:
        for path in (out_path, worker_path):
            if os.path.exists(path):
                os.unlink(path)
