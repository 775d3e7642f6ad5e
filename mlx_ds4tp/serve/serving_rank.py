"""`ds4tp serve`, every rank: join the pair (or mesh), load this rank's part of the model, then
run the worker's command loop (worker) or the engine and the HTTP server (leader); taking a
worker back, and a worker joining again, are serve/rejoin.py's."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .. import gate_ops
from ..base.log import log
from ..base.stopping import shielded, stop_on_signals, stop_reason
from ..link.hello import PART_RECEIVER, ModelIdentity
from ..link.identity import model_identity
from ..lockstep.join_and_load import BringUp, bring_up
from ..lockstep.sampling.grammar import Grammars
from ..split.part_receive import stated_fingerprint
from ..split.share import SplitShare
from .rejoin import Quit, ServingSessions, fit_worker_room, serve_as_worker
from .settings import ServedModel, ServeSettings

if TYPE_CHECKING:
    from .http.server import HttpServer


def context_length(model: Any, config: Dict[str, Any]) -> int:
    """The model's context window as its config states it (mlx-lm configs' names)."""
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = config.get(key) or getattr(getattr(model, "args", None), key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 20


def make_speculation(served: ServedModel, model: Any):
    """The server's drafting (lockstep.speculative.Speculation) as `served` asks, or None;
    SystemExit naming why when this model or draft cannot speculate."""
    settings = served.draft
    draft_path, lookup, k = settings.draft_model, settings.prompt_lookup, settings.num_draft_tokens
    if not settings.drafts:
        return None
    from ..lockstep.batch_verify import speculation_blocker
    from ..lockstep.compute import make_cache
    from ..lockstep.speculative import Speculation

    blocker = speculation_blocker(make_cache(model))
    if blocker:
        raise SystemExit(f"ds4tp serve: {blocker}")
    draft = None
    if draft_path:
        from ..lockstep.speculative import load_draft

        try:
            draft = load_draft(draft_path, model)
        except ValueError as exc:
            raise SystemExit(f"ds4tp serve: {exc}") from None
        log(f"serve: drafting with {draft_path}, {k} tokens a round")
    else:
        log(f"serve: drafting by prompt lookup ({lookup}-grams), {k} tokens a round")
    return Speculation(settings, draft_model=draft)


def check_kv_quantization(model: Any, bits: int, group_size: int) -> None:
    """Refuse --kv-bits for a model it would fail on at its first request (SystemExit naming
    why), and log the layers it leaves in float."""
    from ..lockstep.caches.quantized_cache import describe_unquantizable, quantize_session_cache
    from ..lockstep.compute import make_cache

    cache = make_cache(model)
    quantized = quantize_session_cache(cache, bits, group_size)
    if all(q is c for q, c in zip(quantized, cache)):
        raise SystemExit(f"ds4tp serve: --kv-bits {bits}: this model has no plain KV cache layer "
                         "to quantize; serve it without --kv-bits")
    note = describe_unquantizable(cache)
    if note:
        log(f"serve: {note}")
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


def run(settings: ServeSettings) -> int:
    """One rank of `ds4tp serve`, as cli.serve resolved it; returns the exit code."""
    from ..lockstep.protocol.table import fix_heap_thresholds
    from .http.server import HttpServer

    fix_heap_thresholds()  # before the weights and the caches are allocated
    # Ctrl-C and `kill` (SIGTERM) stop either rank cleanly, whichever is stopped first: its
    # files written, its peer told, one line saying why, exit code 0.
    stop_on_signals()
    # A leader named on the command line takes its HTTP port before it waits for a worker; a
    # rank that discovery makes the leader takes it once it knows (_run_rank).
    servers = [HttpServer(settings.http)] if settings.link.address.role == "leader" else []
    try:
        path = settings.model.path
        return _run_rank(settings, PART_RECEIVER if path is None else model_identity(str(path)), servers)
    except KeyboardInterrupt:
        log(f"serve: stopped by {stop_reason()} before it served (joining the group or loading the weights)")
        return 0
    finally:
        for server in servers:
            server.close()


def _exit_if_stuck(engine) -> None:
    """The last resort of the leader's stop: an engine thread that did not end (Engine.stop
    waits for it twice, the pair closed between) may be inside MLX, and a thread inside native
    code when the interpreter shuts down aborts the process ("terminate called without an
    active exception": CPython ends such a thread as it takes the GIL back, unwinding through
    C++ that may not unwind). Everything of ours is written and closed by now: leave at once."""
    import os
    import sys

    if engine is not None and not engine.ended():
        log("serve: the engine thread is still inside a step; exiting without the interpreter's shutdown")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _run_rank(settings: ServeSettings, identity: ModelIdentity, servers: List["HttpServer"]) -> int:
    from .http.server import HttpServer

    def take_http_port(group) -> None:
        if not servers and group.rank() == 0:
            servers.append(HttpServer(settings.http))

    plan = BringUp(settings.link, settings.model.path, identity, settings.split, kv_tokens_needed(settings),
                   wait_for_leader=settings.rejoin, parts=settings.parts)
    joined = bring_up(plan, on_joined=take_http_port)
    group = joined.group
    disks = DiskCaches(settings, model_key(settings, identity, group))
    box = [joined]  # handed on, not kept here: a resize frees the part before the next loads
    del joined
    with group:
        server = servers[0] if servers else None
        engine = None
        try:
            if server is None:
                grammars = Grammars(box[0].tokenizer)
                how = serve_as_worker(box.pop(), settings, grammars, disks.make)
            else:
                joined = box.pop()
                engine = _leader_engine(settings, group, joined.model, joined.tokenizer,
                                        disks.make(joined.model, group, joined.share))
                how = _serve_http(settings, engine, [joined], server, disks)
                del joined
        finally:
            with shielded():
                written = _close_disk(disks.current)
    log(f"serve: {how}{written}")
    _exit_if_stuck(engine)
    return 0


class DiskCaches:
    """This rank's --prompt-cache-dir for the model and share it serves now: make() gives the
    one of a new part (after a resize, keyed by its own share, group size and rank, so no
    prompt cache is used across shares: an even split of two is not an even split of three),
    the last one's writer finished first; `current` is the one in use."""

    def __init__(self, settings: ServeSettings, key: str):
        self.settings, self.key, self.current = settings, key, None
        self.started_size: Optional[int] = None

    def make(self, model: Any, group: Any, share: SplitShare):
        if self.current is not None:
            self.current.close()
        size = group.size()
        self.started_size = self.started_size or size
        # The started group's files keep their names (a restart finds them); another size's own.
        label = str(share) if size == self.started_size else f"{share} of {size} ranks"
        self.current = make_disk_cache(self.settings, model, self.key, (label, group.rank()))
        return self.current


def _close_disk(disk) -> str:
    """Write what this rank's --prompt-cache-dir writer has left (DiskCache.close, bounded); how
    it ended, for the rank's last line."""
    if disk is None:
        return ""
    left = disk.close()
    if left:
        return f"; {left} prompt cache file(s) were not written in time to {disk.directory}"
    return f"; {len(disk)} prompt cache file(s) in {disk.directory}"


def model_key(settings: ServeSettings, identity: ModelIdentity, group: Any) -> str:
    """What names this rank's model in its prompt-cache files: the fingerprint's digest (on a
    worker without the model, the one its leader's hello states), else the served name."""
    if identity == PART_RECEIVER:
        return stated_fingerprint(group.link_to(0).peer_hello.fingerprint)
    return identity.fingerprint.digest.hex() if identity.fingerprint is not None else settings.model.name


def make_disk_cache(settings: ServeSettings, model: Any, fingerprint: str,
                    share_rank: Tuple[Any, int]):
    """This rank's --prompt-cache-dir (lockstep.caches.disk_cache.DiskCache) or None (share_rank:
    the split share, or its label naming the group's size, and the rank); SystemExit
    naming the model when its cache cannot be saved in mlx-lm's prompt-cache files."""
    limits = settings.limits
    if not limits.prompt_cache_dir:
        return None
    from ..lockstep.caches.cache_file import cache_blocker
    from ..lockstep.caches.disk_cache import DiskCache
    from ..lockstep.caches.disk_files import rank_key
    from ..lockstep.compute import make_cache

    blocker = cache_blocker(make_cache(model))
    if blocker:
        raise SystemExit(f"ds4tp serve: --prompt-cache-dir: {settings.model.name} ({type(model).__module__}): "
                         f"{blocker}; serve it without --prompt-cache-dir")
    share, rank = share_rank
    from ..lockstep.compute import trims_at_any_length

    try:
        return DiskCache(Path(limits.prompt_cache_dir), limits.prompt_cache_disk_bytes,
                         rank_key(fingerprint, str(share), rank), trimmable=trims_at_any_length(make_cache(model)))
    except OSError as exc:
        raise SystemExit(f"ds4tp serve: --prompt-cache-dir {limits.prompt_cache_dir}: {exc}; give a "
                         "directory this user may create and write") from None


def kv_tokens_needed(settings: ServeSettings) -> int:
    """The KV cache tokens the leader reserves room for when it picks a share: the budget
    given, else one full prefill chunk and answer (the budget from memory is sized after
    the load, from what the share leaves)."""
    limits = settings.limits
    return limits.kv_budget or limits.prefill_step + settings.http.default_max_tokens


def _leader_engine(settings: ServeSettings, group: gate_ops.Group, model, tokenizer, disk=None):
    """The engine over this pair, with the limits checked against the model loaded."""
    from .engine import Engine

    limits = settings.limits
    if limits.kv_bits:
        check_kv_quantization(model, limits.kv_bits, limits.kv_group_size)
    speculation = make_speculation(settings.model, model)
    if limits.mixed_prefill:
        from ..lockstep.batch_verify import speculation_blocker
        from ..lockstep.compute import make_cache

        # A mixed step's rows differ in length: the same per-row cut as a verify's.
        blocker = speculation_blocker(make_cache(model), "--mixed-prefill")
        if blocker:
            raise SystemExit(f"ds4tp serve: {blocker}")
    if settings.kv_budget_from_memory:
        from ..lockstep.caches.memory import default_kv_budget

        budget, how = default_kv_budget(model, limits.kv_bits, limits.kv_group_size)
        log(f"serve: on the leader, {how}")
        # A full machine's 0 is a budget of nothing, not "no budget" (0 to the admission).
        limits = dataclasses.replace(limits, kv_budget=0 if budget is None else max(budget, 1))
    return Engine(ServingSessions(group, model, Grammars(tokenizer), disk), tokenizer, limits,
                  speculation=speculation)


def _serve_http(settings: ServeSettings, engine, box: list, server: "HttpServer", disks: DiskCaches) -> str:
    """The leader's HTTP front over `engine` (box: the Joined it serves, handed on to the
    resizer), until Ctrl-C or SIGTERM; how it ended."""
    from .cluster import ClusterView
    from .resize import GroupResizer, Hooks
    from .state import ServeState

    joined = box.pop()
    group, model = joined.group, joined.model
    served = settings.model
    config = json.loads((served.path / "config.json").read_text())
    state = ServeState(engine, tokenizer=engine.tokenizer, served=served, http=settings.http,
                       context_length=context_length(model, config),
                       vocab_size=engine.sessions.vocab or int(config["vocab_size"]))
    state.cluster = ClusterView(engine, state.metrics, joined.share, model, state.model_ids[0])
    # The leader's own room, before the workers' is known (None: --max-kv-tokens decides).
    own_room = engine.admission.kv_budget if settings.kv_budget_from_memory else None
    engine.sessions.wait_ready()  # /health says 200 once the worker serves, not before
    fit_worker_room(engine, engine.sessions, settings, own_room)
    quit_ = Quit()
    resizer = GroupResizer(engine, joined, settings, Hooks(disks.make, lambda m: _own_room(settings, m),
                                                            state.cluster.regrouped), quit_)
    del joined, model
    state.resize = resizer.status
    resizer.count_in(state.metrics.registry)
    if settings.shrink_after > 0:
        engine.sessions.on_abort = resizer.hold
    how = "the HTTP server ended"
    try:
        engine.start()
        threading.Thread(target=resizer.run, name="ds4tp-resize", daemon=True).start()
        log(f"serving {served.name} ({served.path}) on "
            f"http://{settings.http.host}:{server.port}/v1 (transport {group.transport})")
        # The signal ends the answers under way at once (engine.begin_stop), so the HTTP
        # server's graceful stop has nothing left to cut.
        server.serve(state, on_stop=engine.begin_stop)
    except KeyboardInterrupt:
        how = f"stopped by {stop_reason()}"
    finally:
        with shielded():
            quit_.begin()
            told = engine.stop()
            resizer.close()
    return f"{how}: {told}"


def _own_room(settings: ServeSettings, model: Any) -> Optional[int]:
    """The leader's KV budget from its memory with `model` loaded (None: --max-kv-tokens gave it)."""
    if not settings.kv_budget_from_memory:
        return None
    from ..lockstep.caches.memory import default_kv_budget

    limits = settings.limits
    budget, how = default_kv_budget(model, limits.kv_bits, limits.kv_group_size)
    log(f"serve: on the leader, {how}")
    return 0 if budget is None else max(budget, 1)
