"""`ds4tp serve`, both ranks: join the pair, load this rank's half of the model, then run the
worker's command loop (worker) or the engine and the HTTP server (leader)."""

from __future__ import annotations

import json
import signal
import threading
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


def make_speculation(args, model: Any):
    """The server's drafting (serve.speculation.Speculation) as the flags ask, or None;
    SystemExit naming why when this model or draft cannot speculate."""
    draft_path, lookup = getattr(args, "draft_model", None), getattr(args, "prompt_lookup", 0)
    if not (draft_path or lookup):
        return None
    from ..lockstep.batch_verify import speculation_blocker
    from ..lockstep.compute import make_cache
    from .speculation import Speculation

    blocker = speculation_blocker(make_cache(model))
    if blocker:
        raise SystemExit(f"ds4tp serve: {blocker}")
    draft = None
    if draft_path:
        from ..lockstep.speculative import load_draft

        draft = load_draft(draft_path, model)
        tr.log(f"serve: drafting with {draft_path}, {args.num_draft_tokens} tokens a round")
    else:
        tr.log(f"serve: drafting by prompt lookup ({lookup}-grams), {args.num_draft_tokens} tokens a round")
    return Speculation(args.num_draft_tokens, lookup, draft)


def check_kv_quantization(model: Any, bits: int, group_size: int) -> None:
    """Refuse --kv-bits for a model it would fail on at its first request (SystemExit naming
    why), and log the layers it leaves in float."""
    from ..lockstep.compute import make_cache
    from ..lockstep.quantized_cache import describe_unquantizable, quantize_session_cache

    cache = make_cache(model)
    quantized = quantize_session_cache(cache, bits, group_size)
    if all(q is c for q, c in zip(quantized, cache)):
        raise SystemExit(f"ds4tp serve: --kv-bits {bits}: this model has no plain KV cache layer "
                         "to quantize; serve it without --kv-bits")
    note = describe_unquantizable(cache)
    if note:
        tr.log(f"serve: {note}")
    # mlx-lm's quantized attention has no attention sinks (gpt-oss), and mx.quantize needs the
    # head size to be a multiple of the group: both would fail a request, not the start.
    if any("sinks" in m for _, m in model.named_modules()):
        raise SystemExit(f"ds4tp serve: --kv-bits {bits}: this model's attention uses sinks, "
                         "which mlx-lm's quantized attention does not support; serve it without --kv-bits")
    margs = getattr(model, "args", None)
    dims = {getattr(margs, name, None) for name in ("head_dim", "v_head_dim")} - {None}
    if not dims and getattr(margs, "num_attention_heads", 0):
        dims = {margs.hidden_size // margs.num_attention_heads}
    fits = [g for g in (32, 64, 128) if all(d % g == 0 for d in dims)]
    if group_size not in fits:
        advice = (f"give --kv-group-size {fits[-1]}" if fits else "no group size fits it") + \
            " or serve without --kv-bits"
        raise SystemExit(f"ds4tp serve: --kv-group-size {group_size}: the model's head size "
                         f"{sorted(dims)} is not a multiple of it; {advice}")


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
    from ..lockstep.sessions import LeaderSessions

    leader = server is not None
    # The same arguments join the pair again when the peer comes back (gate_ops.reconnect).
    join = dict(role=address.role, listen=address.listen, coordinator=address.coordinator,
                transport=args.transport, rdma_device=args.rdma_device,
                gid_index=args.rdma_gid_index, secret=args.secret, identity=identity)
    rejoin = getattr(args, "rejoin", False)
    group = _join_first(join) if rejoin else gate_ops.init(**join)
    with group:
        t0 = time.perf_counter()
        model, tokenizer = load_split(str(model_path), group, progress=LoadingBar())
        tr.log(f"weights loaded in {time.perf_counter() - t0:.1f} s")
        if not leader:
            return _worker(group, model, join, rejoin=rejoin)
        config = json.loads((model_path / "config.json").read_text())
        if args.kv_bits:
            check_kv_quantization(model, args.kv_bits, args.kv_group_size)
        speculation = make_speculation(args, model)
        if args.mixed_prefill:
            from ..lockstep.batch_verify import speculation_blocker
            from ..lockstep.compute import make_cache

            # A mixed step's rows differ in length: the same per-row cut as a verify's.
            blocker = speculation_blocker(make_cache(model), "--mixed-prefill")
            if blocker:
                raise SystemExit(f"ds4tp serve: {blocker}")
        budget = args.max_kv_tokens
        if budget is None:
            from .memory import default_kv_budget

            budget, how = default_kv_budget(model, args.kv_bits, args.kv_group_size)
            tr.log(f"serve: {how}")
        engine = Engine(LeaderSessions(group, model), tokenizer,
                        prompt_cache_size=args.prompt_cache_size,
                        prefill_step=args.prefill_step_size, max_batch=args.max_batch,
                        debug_hash=args.debug_hash, kv_budget=budget,
                        max_queued=args.max_queued, prompt_concurrency=args.prompt_concurrency,
                        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                        prompt_cache_bytes=args.prompt_cache_bytes, speculation=speculation,
                        mixed_prefill=args.mixed_prefill, mixed_when=args.mixed_prefill_when)
        # Requests may name the short id, or the model as --model gave it (or its directory).
        state = ServeState(engine, tokenizer, args.served_model_name, api_key=args.api_key,
                           aliases=(args.model, str(model_path)),
                           context_length=context_length(model, config),
                           vocab_size=engine.sessions.table.vocab or int(config["vocab_size"]),
                           default_max_tokens=args.max_tokens, defaults=sampling,
                           keepalive_sec=args.keepalive_sec)
        server.RequestHandlerClass.state = state
        engine.sessions.wait_ready()  # /health says 200 once the worker serves, not before
        engine.start()
        threading.Thread(target=_take_back_workers, args=(engine, group, model, join),
                         name="ds4tp-rejoin", daemon=True).start()
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


def _take_back_workers(engine, group: gate_ops.Group, model, join: Dict[str, Any]) -> None:
    """The leader's side of a worker that comes back: whenever the pair goes down (the worker
    died, the link dropped), keep serving HTTP (503 and /health 503 meanwhile), listen again on
    the pair's address, and resume serving once a worker with the same model fingerprint and
    secret has joined. A daemon thread: Ctrl-C on the leader ends it with the process."""
    from ..lockstep.sessions import LeaderSessions

    host, port = join["listen"]
    while True:
        while not engine.wait_down(1.0):
            pass
        tr.log(f"serve: HTTP answers 503 until a worker joins again on {host}:{port} (start "
               "`ds4tp serve --role worker` again, with the same --model and secret)")
        while True:
            try:
                gate_ops.reconnect(group, **join)
                break
            except tr.TransportTimeoutError:
                continue  # nobody came within the connect timeout: keep listening
            except Exception as exc:  # noqa: BLE001 - a wrong or broken worker; wait for the right one
                tr.log(f"serve: a worker could not rejoin: {type(exc).__name__}: {exc}")
                time.sleep(0.5)
        sessions = LeaderSessions(group, model)
        try:
            sessions.wait_ready()  # the worker loads its weights after joining
        except Exception as exc:  # noqa: BLE001 - it died loading: listen again
            tr.log(f"serve: the worker joined but failed before serving: {exc}")
            group.close()
            continue
        engine.resume(sessions)
        tr.log(f"serve: a worker rejoined (transport {group.transport}); serving again")


def _join_first(join: Dict[str, Any]) -> gate_ops.Group:
    """A --rejoin worker's first join: it waits for its leader however long that takes (a
    supervisor may start it first), as it does for every later one."""
    while True:
        try:
            return gate_ops.init(**join)
        except (tr.HelloMismatchError, tr.AuthenticationError):
            raise
        except tr.TransportError as exc:
            tr.log(f"serve: no leader yet ({exc}); still waiting (--rejoin)")
            time.sleep(0.5)


def _worker(group: gate_ops.Group, model, join: Dict[str, Any], rejoin: bool) -> int:
    """The worker's command loop; with --rejoin it outlives its leader: when the leader stops or
    dies it waits for a leader on the same address and serves it (the same checks as a first
    join). Without it, a leader gone is this process's end: an error naming it, never a hang."""
    from ..lockstep.sessions import drain_failed_work, serve_worker
    from ..lockstep.table import release_memory

    host, port = join["coordinator"]
    while True:
        try:
            table = serve_worker(group, model)  # tells the leader why if it fails
            tr.log(f"worker done after {table.step_count} decode steps: the leader said stop")
            if not rejoin:
                return 0
        except Exception as exc:  # noqa: BLE001 - the pair failed; report it or rejoin
            if not rejoin:
                raise tr.TransportError(f"{exc}; the worker stops (run it with --rejoin to wait "
                                        "for a leader instead)") from None
            tr.log(f"serve: the pair is down: {type(exc).__name__}: {exc}")
        group.close()
        drain_failed_work()
        release_memory()  # the failed pair's table, its caches and its failed steps
        tr.log(f"serve: waiting for a leader at {host}:{port} (--rejoin) ...")
        while True:
            try:
                gate_ops.reconnect(group, **join)
                break
            except (tr.HelloMismatchError, tr.AuthenticationError):
                raise  # another model or another secret: waiting would not change it
            except tr.TransportError:
                time.sleep(0.5)  # no leader yet (or one that went away during the join)
        tr.log(f"serve: joined a leader again (transport {group.transport})")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
