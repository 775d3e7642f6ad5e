"""`ds4tp run`: one rank of a two-machine generation, one session of the lockstep protocol
(the leader: lockstep.generate.pair_generate; the worker: lockstep.sessions.serve_worker)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from .. import gate_ops
from .. import transport as tr
from ..link.config import PairAddress
from ..link.identity import model_identity
from ..split.progress import LoadingBar
from .generate import GenerationStats, bench_prompt, encode_prompt, pair_generate
from .sampling import SamplingOptions
from .sessions import LeaderSessions, serve_worker

# The bench's contenders all warm up on the prompt's first tokens before the timed
# generation (bench.model WARMUP_PROMPT_TOKENS); the pair does it in lockstep.
BENCH_WARMUP_TOKENS = 16


def run(args, address: PairAddress, sampling: SamplingOptions, *, tokens_out: Optional[str] = None,
        stop_at_eos: bool = True, prompt_tokens: int = 0, recorded_draft: Optional[str] = None) -> int:
    """One rank of `ds4tp run` (args as cli.run.add_args parses them; address and sampling
    as cli.run.check_args made them): run_rank with the flags' values."""
    return run_rank(address, args.model, transport=args.transport, rdma_device=args.rdma_device,
                    gid_index=args.rdma_gid_index, secret=args.secret, prompt=args.prompt or "",
                    max_tokens=args.max_tokens, chat=not args.no_chat_template, sampling=sampling,
                    debug_hash=args.debug_hash, tokens_out=tokens_out, stop_at_eos=stop_at_eos,
                    prompt_tokens=prompt_tokens, draft_model=getattr(args, "draft_model", None),
                    prompt_lookup=getattr(args, "prompt_lookup", 0),
                    num_draft_tokens=getattr(args, "num_draft_tokens", 3), recorded_draft=recorded_draft)


def run_rank(address: PairAddress, model_path: str, *, transport: str = "auto",
             rdma_device: Optional[str] = None, gid_index: Optional[int] = None,
             secret: Optional[str] = None, prompt: str = "", max_tokens: int = 128, chat: bool = True,
             sampling: SamplingOptions = SamplingOptions(), debug_hash: int = 0,
             tokens_out: Optional[str] = None, stop_at_eos: bool = True, prompt_tokens: int = 0,
             draft_model: Optional[str] = None, prompt_lookup: int = 0, num_draft_tokens: int = 3,
             recorded_draft: Optional[str] = None) -> int:
    """One rank of `ds4tp run`; returns the exit code. The leader streams the text on stdout,
    then the closing stats line (GenerationStats.line).

    tokens_out: the leader writes the prompt's and the generated tokens, the
    prompt and decode rates and the gate latency there as JSON (the local pair
    reads it). stop_at_eos=False decodes max_tokens whatever the model says
    (the bench). prompt_tokens > 0: the leader's prompt is the text's tokens
    repeated to that many (bench_prompt), without the chat template, after a
    warm-up generation on its first tokens. draft_model / prompt_lookup: the leader decodes
    speculatively (lockstep.speculative), num_draft_tokens a round; recorded_draft: a JSON
    file of tokens drafted as the known continuation (the bench's ceiling).
    """
    from ..model_split import load_split

    group = gate_ops.init(role=address.role, listen=address.listen, coordinator=address.coordinator,
                          transport=transport, rdma_device=rdma_device, gid_index=gid_index,
                          secret=secret, identity=model_identity(model_path))
    with group:
        t0 = time.perf_counter()
        model, tokenizer = load_split(model_path, group, progress=LoadingBar())
        tr.log(f"weights loaded in {time.perf_counter() - t0:.1f} s")
        if address.role != "leader":
            table = serve_worker(group, model)
            tr.log(f"worker done: served {table.ended} prompt(s), leader said stop")
            return 0
        sessions = LeaderSessions(group, model)
        try:
            if prompt_tokens > 0:
                prompt_ids = bench_prompt(tokenizer, prompt, prompt_tokens)
                pair_generate(sessions, prompt_ids[:BENCH_WARMUP_TOKENS], 4)
            else:
                prompt_ids = encode_prompt(tokenizer, prompt, chat=chat)
            drafting = _drafter(draft_model, prompt_lookup, prompt_ids, model, recorded_draft, sampling)
            stats = _stream(sessions, tokenizer, prompt_ids, max_tokens, sampling, debug_hash,
                            stop_at_eos, drafting, num_draft_tokens)
        finally:
            sessions.stop()
        print(stats.line(group), flush=True)
        if tokens_out:
            _write_tokens(tokens_out, group, prompt_ids, stats)
    return 0


def _drafter(draft_model: Optional[str], prompt_lookup: int, prompt_ids, target,
             recorded: Optional[str] = None, sampling: SamplingOptions = SamplingOptions()):
    """(the leader's drafter for speculative decoding, its rows sampler), or None."""
    from .speculative import greedy_rows, sampled

    if not (draft_model or prompt_lookup or recorded):
        return None
    rows, one = (greedy_rows, None) if sampling.greedy else sampled(sampling)
    drafter = _make_drafter(draft_model, prompt_lookup, prompt_ids, target, recorded, one)
    return None if drafter is None else (drafter, rows)


def _make_drafter(draft_model, prompt_lookup, prompt_ids, target, recorded, one):
    from .speculative import DraftModel, PromptLookup, Recorded

    if recorded:
        return Recorded(len(prompt_ids), json.loads(Path(recorded).read_text()))
    if prompt_lookup:
        return PromptLookup(prompt_lookup)
    if not draft_model:
        return None
    from mlx_lm.utils import load_model

    draft, _ = load_model(Path(draft_model))
    mine, theirs = (int(getattr(m, "args").vocab_size) for m in (target, draft))
    if mine != theirs:
        raise SystemExit(f"ds4tp run: the draft model {draft_model} has a vocabulary of {theirs} tokens, "
                         f"the model {mine}: a draft must share the model's tokenizer")
    return DraftModel(draft, prompt_ids, one)


def _stream(sessions: LeaderSessions, tokenizer, prompt_ids, max_tokens: int,
            sampling: SamplingOptions, debug_hash: int, stop_at_eos: bool, drafter=None,
            num_draft_tokens: int = 3) -> GenerationStats:
    """The generation, its text streamed to stdout as it is decoded."""
    detok = tokenizer.detokenizer
    detok.reset()

    def show(token: int) -> None:
        detok.add_token(token)
        sys.stdout.write(detok.last_segment)
        sys.stdout.flush()

    eos = set(getattr(tokenizer, "eos_token_ids", None) or []) if stop_at_eos else set()
    if drafter is not None:
        from .speculative import speculative_generate

        drafter, rows = drafter
        stats = speculative_generate(sessions, prompt_ids, max_tokens, rows, drafter, num_draft_tokens,
                                     on_token=show, eos=eos)
        tr.log(f"speculative: {stats.accepted} of {stats.drafted} drafted tokens accepted in "
               f"{stats.rounds} rounds ({len(stats.tokens) / max(stats.rounds, 1):.2f} tokens a round)")
    else:
        stats = pair_generate(sessions, prompt_ids, max_tokens, sampling, on_token=show, eos=eos, debug_hash=debug_hash)
    detok.finalize()
    sys.stdout.write(detok.last_segment + "\n")
    return stats


def _write_tokens(path: str, group: gate_ops.Group, prompt_ids, stats: GenerationStats) -> None:
    p50, p99 = group.gate_latency_us()
    Path(path).write_text(json.dumps({
        "prompt_tokens": prompt_ids, "tokens": stats.tokens, "transport": group.transport,
        "decode_tok_s": stats.decode_tokens / stats.decode_sec if stats.decode_sec else 0.0,
        "prompt_tok_s": stats.prompt_tokens / stats.prompt_sec if stats.prompt_sec else 0.0,
        "gate_p50_us": p50, "gate_p99_us": p99,
        "exchange_ms_per_token": stats.exchange_ms_per_token(),
        "drafted": getattr(stats, "drafted", 0), "accepted": getattr(stats, "accepted", 0),
        "rounds": getattr(stats, "rounds", 0),
    }))
