"""`ds4tp serve`, both ranks: join the pair, load this rank's half of the model, then run the
worker's command loop (worker) or the engine and the HTTP server (leader)."""

from __future__ import annotations

import json
import signal
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Optional

from .. import gate_ops
from .. import transport as tr
from ..link.config import PairAddress
from ..link.identity import model_identity
from ..lockstep.sampling import SamplingOptions
from ..split.progress import LoadingBar


def context_length(model: Any, config: Dict[str, Any]) -> int:
    """The model's context window as its config states it (mlx-lm configs' names)."""
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = config.get(key) or getattr(getattr(model, "args", None), key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 20


def run(args, address: PairAddress, model_path: Path, sampling: SamplingOptions) -> int:
    """One rank of `ds4tp serve` (cli.serve checked the flags and made address, model_path,
    sampling and args.served_model_name); returns the exit code."""
    from .http import make_server

    identity = model_identity(str(model_path))
    leader = address.role == "leader"
    server = make_server(args.host, args.port) if leader else None
    try:
        return _run_rank(args, address, model_path, sampling, identity, server)
    finally:
        if server is not None:
            server.server_close()


def _run_rank(args, address: PairAddress, model_path: Path, sampling: SamplingOptions,
              identity: tr.ModelIdentity, server: Optional[ThreadingHTTPServer]) -> int:
    from ..model_split import load_split
    from .http import ServeState
    from .engine import Engine
    from ..lockstep.sessions import LeaderSessions, serve_worker

    leader = server is not None
    group = gate_ops.init(role=address.role, listen=address.listen,
                          coordinator=address.coordinator, transport=args.transport,
                          rdma_device=args.rdma_device, gid_index=args.rdma_gid_index,
                          secret=args.secret, identity=identity)
    with group:
        t0 = time.perf_counter()
        model, tokenizer = load_split(str(model_path), group, progress=LoadingBar())
        tr.log(f"weights loaded in {time.perf_counter() - t0:.1f} s")
        if not leader:
            table = serve_worker(group, model)  # tells the leader why if it fails
            tr.log(f"worker done after {table.step_count} decode steps: the leader said stop")
            return 0
        config = json.loads((model_path / "config.json").read_text())
        engine = Engine(LeaderSessions(group, model), tokenizer,
                        prompt_cache_size=args.prompt_cache_size,
                        prefill_step=args.prefill_step_size, max_batch=args.max_batch,
                        debug_hash=args.debug_hash, kv_budget=args.max_kv_tokens,
                        max_queued=args.max_queued)
        # Requests may name the short id, or the model as --model gave it (or its directory).
        state = ServeState(engine, tokenizer, args.served_model_name, api_key=args.api_key,
                           aliases=(args.model, str(model_path)),
                           context_length=context_length(model, config),
                           vocab_size=engine.sessions.table.vocab or int(config["vocab_size"]),
                           default_max_tokens=args.max_tokens, defaults=sampling,
                           keepalive_sec=args.keepalive_sec)
        server.RequestHandlerClass.state = state
        engine.start()
        tr.log(f"serving {args.served_model_name} ({model_path}) on "
               f"http://{args.host}:{server.server_address[1]}/v1 (transport {group.transport})")
        # `kill` (SIGTERM) stops the pair as Ctrl-C does: the worker is told, not orphaned.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            server.serve_forever(poll_interval=0.5)
        except KeyboardInterrupt:
            tr.log("serve: stopping; the worker is told to stop too")
        finally:
            engine.stop()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
