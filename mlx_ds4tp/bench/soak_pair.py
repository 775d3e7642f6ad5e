"""The processes around `ds4tp bench --serve --soak` (mlx_ds4tp.bench.soak): the resident memory
of a process, the pair behind a running server's port, mlx_lm.server for the client-count
comparison, and the references. The pair it starts on loopback: bench.served_pair."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..base.log import log
from .served_pair import wait_healthy
from .soak_client import json_headers


def get_json(base: str, path: str, api_key: Optional[str]) -> Optional[dict]:
    """A GET's JSON body, or None when it fails."""
    req = urllib.request.Request(base + path, headers=json_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read())
        except ValueError:
            return None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def rss_kib(pid: Optional[int]) -> Optional[int]:
    """The process's resident memory in KiB; None when it is gone (or pid is None)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return None
    except FileNotFoundError:
        if Path("/proc/self/status").exists():
            return None  # Linux, and the process is gone
    except OSError:
        return None
    try:  # macOS: no /proc
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        return int(out) if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _flag(args: List[str], name: str, count: int = 1) -> Optional[List[str]]:
    if name in args:
        i = args.index(name)
        return args[i + 1:i + 1 + count] if len(args) >= i + 1 + count else None
    return None


def find_pair_pids(http_port: int) -> Tuple[Optional[int], Optional[int]]:
    """The pids of the `ds4tp serve` leader serving http_port here and of its worker, read off
    the command lines `ps` shows (None for one not found)."""
    try:
        # -ww: whole command lines. Without it ps cuts them at $COLUMNS where that is set (pytest-xdist's
        # workers set 80), which drops the --port and --listen this matches on.
        lines = subprocess.run(["ps", "-ww", "-axo", "pid=,args="], capture_output=True, text=True,
                               timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    serving = []
    for line in lines:
        pid, _, cmd = line.strip().partition(" ")
        args = cmd.split()
        if "serve" in args and "ds4tp" in cmd and "--role" in args:
            serving.append((int(pid), args))
    leader, listen = None, None
    for pid, args in serving:
        port = _flag(args, "--port")
        if _flag(args, "--role") == ["leader"] and int(port[0] if port else 8080) == http_port:
            leader, listen = pid, _flag(args, "--listen", 2)
    worker = None
    for pid, args in serving:
        coordinator = _flag(args, "--coordinator", 2)
        if listen and _flag(args, "--role") == ["worker"] and coordinator and coordinator[1] == listen[1]:
            worker = pid
    return leader, worker


def mlx_lm_server(model: Path, concurrency: int) -> Tuple[subprocess.Popen, str]:
    """mlx_lm.server on 127.0.0.1 on the same model, healthy; (process, base URL)."""
    from ..onehost.localpair import child_env, free_port, reap

    port = free_port()
    # Its access log is a line per request: kept out of the way, shown when it fails to start.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                                 "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                 "WARNING", "--decode-concurrency", str(concurrency)],
                                env=child_env(), stdout=log, stderr=log)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, [proc], 300.0)
        except BaseException:
            reap(proc)
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
    return proc, base


def model_limits(model: Path) -> Tuple[int, int]:
    """(vocabulary size, context length) as the model's config states them (what the server
    computes them from)."""
    from ..serve.serving_rank import context_length

    config = json.loads((model / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(vocab), context_length(None, config)


def server_context(base: str, api_key: Optional[str]) -> Optional[int]:
    """The context length the server states, where it states one (/v1/models' context_length
    or max_model_len, /health's context_length); None otherwise."""
    models = get_json(base, "/v1/models", api_key) or {}
    for entry in models.get("data") or []:
        for key in ("context_length", "max_model_len"):
            if isinstance(entry.get(key), int):
                return entry[key]
    found = (get_json(base, "/health", None) or {}).get("context_length")
    return found if isinstance(found, int) else None


def references(model: Path, variants: Sequence[Tuple[List[int], int]]) -> List[str]:
    """mlx-lm's own greedy text for each (prompt ids, max_tokens), one process, the whole
    model; the model is freed afterwards (the soak's RSS figures are the server's, but this
    machine's memory is shared)."""
    import gc

    import mlx.core as mx
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    t0 = time.perf_counter()
    loaded, tokenizer = load(str(model))
    texts = [generate(loaded, tokenizer, prompt=list(ids), max_tokens=n, sampler=make_sampler(0.0))
             for ids, n in variants]
    del loaded, tokenizer
    gc.collect()
    mx.clear_cache()
    log(f"soak: {len(texts)} references from mlx-lm in {time.perf_counter() - t0:.1f} s")
    return texts


def loopback_host(url: str) -> Tuple[str, int]:
    """(host, port) of an http:// URL on this machine; ValueError for any other host."""
    import ipaddress
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--url {url}: give http://HOST:PORT")
    host = parts.hostname
    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    if not loop:
        raise ValueError(f"--url {url}: the soak runs against a server on this machine only "
                         "(127.0.0.1, ::1 or localhost): it reads the ranks' memory and its "
                         f"references are computed here; {host} is not a loopback address")
    return host, parts.port or 80

