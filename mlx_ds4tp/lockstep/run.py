"""`ds4tp run`: one rank of a two-machine generation, one session of the lockstep protocol
(the leader: lockstep.generate.pair_generate, a batch of one through lockstep.batch, drafting
when asked; the worker: lockstep.protocol.sessions.serve_worker). cli.run resolves the flags into the
settings objects it takes (lockstep.settings, link.config.LinkSettings)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

from .. import gate_ops
from ..base.log import log
from ..errors import TransportError
from ..link.config import LinkSettings
from ..link.hello import PART_RECEIVER
from ..link.identity import model_identity
from .errors import GrammarError
from .generate import GenerationStats, bench_prompt, encode_prompt, pair_generate
from .join_and_load import BringUp, bring_up
from .protocol.sessions import LeaderSessions, leader_word, serve_worker
from .sampling.grammar import Grammars
from .settings import RunSettings

# The bench's contenders all warm up on the prompt's first tokens before the timed
# generation (bench.model WARMUP_PROMPT_TOKENS); the pair does it in lockstep.
BENCH_WARMUP_TOKENS = 16
TEMPLATE_TOKENS = 256
# How long a worker whose group watches its cables (link/cable_watch.py) waits, once its step
# failed, for the leader's word on why: a cable out between two other ranks is named there.
CABLE_WORD_SEC = 3.0


def run_rank(link: LinkSettings, model_path: Optional[str], settings: RunSettings) -> int:
    """One rank of `ds4tp run` (of link.size ranks); returns the exit code. The leader streams
    the text on stdout, then the closing stats line (GenerationStats.line)."""
    # A token is at least one character of the prompt; the chat template adds its own.
    kv_tokens = len(settings.prompt) + TEMPLATE_TOKENS + settings.prompt_tokens + settings.max_tokens
    identity = PART_RECEIVER if model_path is None else model_identity(model_path)  # None: receives its part
    joined = bring_up(BringUp(link, None if model_path is None else Path(model_path), identity, settings.split,
                              kv_tokens, parts=settings.parts))
    group, model, tokenizer, share = joined.group, joined.model, joined.tokenizer, joined.share
    with group:
        if not joined.leads:  # the role named, or the one discovery elected
            try:
                table = serve_worker(group, model, Grammars(tokenizer))
            except RuntimeError as exc:  # a gate's failure out of MLX's evaluation, or a TransportError
                # A cable out between two other ranks fails this rank's gates too: the
                # leader's word names the cable (its own, or a worker's report).
                watched = group.watches_cables and group.cable_fault() is None  # else it named its own
                said = leader_word(group, CABLE_WORD_SEC) if watched else None
                if said:
                    raise TransportError(f"{exc}; the leader said: {said}") from exc
                raise
            log(f"rank {group.rank()} done: served {table.ended} prompt(s), leader said stop")
            if settings.tokens_out:
                Path(settings.tokens_out).write_text(json.dumps({"split": str(share), "peak_rss_bytes": peak_rss()}))
            return 0
        grammars = Grammars(tokenizer)
        if settings.sampling.grammar:
            try:
                grammars.compile(settings.sampling.grammar)  # a schema it refuses fails here, named
            except GrammarError as exc:
                raise SystemExit(f"ds4tp run: --json-schema cannot be enforced: {exc}") from None
        sessions = LeaderSessions(group, model, grammars)
        try:
            if settings.prompt_tokens > 0:
                prompt_ids = bench_prompt(tokenizer, settings.prompt, settings.prompt_tokens)
                pair_generate(sessions, prompt_ids[:BENCH_WARMUP_TOKENS], 4)
            else:
                prompt_ids = encode_prompt(tokenizer, settings.prompt, chat=settings.chat)
            stats = _stream(sessions, tokenizer, prompt_ids, settings)
        except Exception as exc:
            # A failed generation (a worker died, a gate broke) is not a clean end: a STOP here
            # would let a worker that had not reached the failing step yet (the leader's send to
            # a dead rank fails before it reaches the ranks after it) return 0 as if all went
            # well. The workers still there hear why, and end with it.
            sessions.abort(str(exc) or type(exc).__name__)
            raise
        except BaseException:
            sessions.stop()  # Ctrl-C or an exit: the workers return, as after a generation
            raise
        sessions.stop()
        print(stats.line(group), flush=True)
        if settings.tokens_out:
            _write_tokens(settings.tokens_out, group, prompt_ids, stats, share)
    return 0


def _stream(sessions: LeaderSessions, tokenizer, prompt_ids: List[int], settings: RunSettings) -> GenerationStats:
    """The generation, its text streamed to stdout as it is decoded."""
    detok = tokenizer.detokenizer
    detok.reset()

    def show(token: int) -> None:
        detok.add_token(token)
        sys.stdout.write(detok.last_segment)
        sys.stdout.flush()

    eos = set(getattr(tokenizer, "eos_token_ids", None) or []) if settings.stop_at_eos else set()
    if settings.draft.drafts:
        stats = _speculate(sessions, prompt_ids, settings, show, eos)
    else:
        stats = pair_generate(sessions, prompt_ids, settings.max_tokens, settings.sampling, on_token=show,
                              eos=eos, debug_hash=settings.debug_hash)
    detok.finalize()
    sys.stdout.write(detok.last_segment + "\n")
    return stats


def _speculate(sessions: LeaderSessions, prompt_ids: List[int], settings: RunSettings, show, eos) -> GenerationStats:
    """The speculative generation: a batch of one that drafts (lockstep.speculative)."""
    from .speculative import Speculation, load_draft

    draft = settings.draft
    if draft.recorded_draft:
        speculation = Speculation(draft, recorded=json.loads(Path(draft.recorded_draft).read_text()))
    elif draft.prompt_lookup:
        speculation = Speculation(draft)
    else:
        speculation = Speculation(draft, draft_model=load_draft(draft.draft_model, sessions.model))
    stats = pair_generate(sessions, prompt_ids, settings.max_tokens, settings.sampling, on_token=show, eos=eos,
                          debug_hash=settings.debug_hash, speculation=speculation)
    log(f"speculative: {stats.accepted} of {stats.drafted} drafted tokens accepted in "
        f"{stats.rounds} rounds ({len(stats.tokens) / max(stats.rounds, 1):.2f} tokens a round)")
    return stats


def peak_rss() -> int:
    """This process's peak resident memory in bytes (what a rank's share of the model costs it)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS counts bytes, Linux KiB


def _write_tokens(path: str, group: gate_ops.Group, prompt_ids, stats: GenerationStats, share) -> None:
    p50, p99 = group.gate_latency_us()
    Path(path).write_text(json.dumps({
        "split": str(share), "peak_rss_bytes": peak_rss(),
        "prompt_tokens": prompt_ids, "tokens": stats.tokens, "transport": group.transport,
        "decode_tok_s": stats.decode_tokens / stats.decode_sec if stats.decode_sec else 0.0,
        "prompt_tok_s": stats.prompt_tokens / stats.prompt_sec if stats.prompt_sec else 0.0,
        "gate_p50_us": p50, "gate_p99_us": p99,
        "exchange_ms_per_token": stats.exchange_ms_per_token(),
        "drafted": stats.drafted, "accepted": stats.accepted, "rounds": stats.rounds,
    }))
