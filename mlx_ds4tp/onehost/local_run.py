"""Every rank of `ds4tp run` on 127.0.0.1, one process each (two: a pair; --ranks N: N)."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from ..base.log import log
from . import localpair as _localpair


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """What every rank of a local `ds4tp run` generates: the flags they share."""

    model: Path
    prompt: str
    max_tokens: int
    transport: str = "tcp"
    rdma_device: Optional[str] = None  # "ucsim", or None: the transport's own choice
    stop_at_eos: bool = True
    prompt_tokens: int = 0  # > 0: the prompt's tokens repeated to that many (see run)
    extra: Sequence[str] = ()  # more `ds4tp run` flags for every rank (--draft-model ..., --prompt-lookup N)
    ranks: int = 2  # the ranks of the group, each its own process (--ranks N)

    def command(self) -> list:
        """The `ds4tp run` command line every rank shares (pair_commands adds each one's role)."""
        base = _localpair.rank_command(
            "run", "--model", str(self.model), "--transport", self.transport, "--max-tokens",
            str(self.max_tokens), "--no-chat-template", "--prompt", self.prompt)
        if self.rdma_device:
            base += ["--rdma-device", self.rdma_device]
        if not self.stop_at_eos:
            base += ["--no-eos"]
        if self.prompt_tokens > 0:
            base += ["--prompt-tokens", str(self.prompt_tokens)]
        return base + list(self.extra)


def run_local_pair(run: LocalRun, quiet: bool = False, timeout: float = 1200.0,
                   placement: _localpair.Placement = _localpair.ANYWHERE) -> Optional[dict]:
    """Every rank of `ds4tp run` on 127.0.0.1, one process each (run.ranks of them); returns
    the leader's tokens record (see run's tokens_out) with the first worker's peak resident
    memory (worker_peak_rss_bytes) and every worker's (workers_peak_rss_bytes, rank order of
    their starts), or None when a rank failed (all are killed on any failure, the reason is
    logged). placement: each rank's CPUs and environment (localpair.SLOW_WORKER)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    commands = _localpair.pair_commands(run.command(), _localpair.free_port(), run.ranks)
    worker_paths = [f"{out_path}.worker{i}" for i in range(1, run.ranks)]
    commands[0] += ["--tokens-out", out_path]
    for command, path in zip(commands[1:], worker_paths):
        command += ["--tokens-out", path]
    try:
        env = _localpair.child_env(dict(placement.env))
        _localpair.run_ranks(commands, [env] * run.ranks, timeout=timeout,
                             stdout="discard" if quiet else "inherit", cpus=placement.cpus)
        record = json.loads(Path(out_path).read_text())
        peaks = [json.loads(Path(p).read_text())["peak_rss_bytes"] for p in worker_paths]
        record["worker_peak_rss_bytes"], record["workers_peak_rss_bytes"] = peaks[0], peaks
        return record
    except RuntimeError as exc:
        log(f"the local ranks failed: {exc}")
        return None
    finally:
        for path in [out_path, *worker_paths]:
            if os.path.exists(path):
                os.unlink(path)
