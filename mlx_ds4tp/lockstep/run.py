"""`ds4tp run`: one rank of a two-machine generation."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

from .. import gate_ops
from .. import transport as tr
from ..link.config import PairAddress
from ..link.identity import model_identity
from ..split.progress import LoadingBar
from .sampling import SamplingOptions
from .steps import Leader, Worker, make_sampler


def bench_prompt(tokenizer, text: str, count: int) -> List[int]:
    """`text`'s tokens repeated (and cut) to exactly `count` tokens: a prompt of a chosen
    length that every contender of the model bench feeds alike."""
    if count < 1:
        raise ValueError(f"a prompt of {count} tokens: give at least 1")
    base = list(tokenizer.encode(text)) or [0]
    return (base * (count // len(base) + 1))[:count]


def run(args, address: PairAddress, sampling: SamplingOptions, *, tokens_out: Optional[str] = None,
        stop_at_eos: bool = True, prompt_tokens: int = 0) -> int:
    """One rank of `ds4tp run` (args as cli.run.add_args parses them; address and sampling
    as cli.run.check_args made them).

    tokens_out: the leader writes the prompt's and the generated tokens, the
    prompt and decode rates and the gate latency there as JSON (the local pair
    reads it). stop_at_eos=False decodes max_tokens whatever the model says
    (the bench). prompt_tokens > 0: the leader's prompt is the text's tokens
    repeated to that many (bench_prompt), without the chat template.
    """
    from ..model_split import load_split
    from .sampling import run_sampler

    identity = model_identity(args.model)
    leader = address.role == "leader"
    group = gate_ops.init(
        role=address.role,
        listen=address.listen,
        coordinator=address.coordinator,
        transport=args.transport,
        rdma_device=args.rdma_device,
        gid_index=args.rdma_gid_index,
        secret=args.secret,
        identity=identity,
    )
    with group:
        t0 = time.perf_counter()
        model, tokenizer = load_split(args.model, group, progress=LoadingBar())
        tr.log(f"weights loaded in {time.perf_counter() - t0:.1f} s")
        if not leader:
            try:
                served = Worker(group, model).serve()
            except Exception as exc:
                # Tell the leader why before the sockets close, so its error
                # names the cause, not just "peer closed".
                group.pair.control.send_error(f"{type(exc).__name__}: {exc}")
                raise
            tr.log(f"worker done: served {served} prompt(s), leader said stop")
            return 0
        driver = Leader(group, model, tokenizer, debug_hash=args.debug_hash)
        try:
            if prompt_tokens > 0:
                prompt_ids = bench_prompt(tokenizer, args.prompt, prompt_tokens)
            else:
                prompt_ids = driver.encode(args.prompt, chat=not args.no_chat_template)
            detok = tokenizer.detokenizer
            detok.reset()

            def stream(token: int) -> None:
                detok.add_token(token)
                sys.stdout.write(detok.last_segment)
                sys.stdout.flush()

            sampler = run_sampler(sampling, prompt_ids)
            if prompt_tokens > 0:
                # The bench's contenders all warm up on the prompt's first 16 tokens before the
                # timed generation (bench_model._generate); the pair does it in lockstep.
                driver.generate(prompt_ids[:16], 4, make_sampler(0.0), stop_at_eos=False)
            stats = driver.generate(prompt_ids, args.max_tokens, sampler, stream,
                                    stop_at_eos=stop_at_eos)
            detok.finalize()
            sys.stdout.write(detok.last_segment + "\n")
        finally:
            driver.stop()
        print(stats.line(group), flush=True)
        if tokens_out:
            p50, p99 = group.gate_latency_us()
            Path(tokens_out).write_text(json.dumps({
                "prompt_tokens": prompt_ids, "tokens": stats.tokens, "transport": group.transport,
                "decode_tok_s": stats.decode_tokens / stats.decode_sec if stats.decode_sec else 0.0,
                "prompt_tok_s": stats.prompt_tokens / stats.prompt_sec if stats.prompt_sec else 0.0,
                "gate_p50_us": p50, "gate_p99_us": p99,
                "exchange_ms_per_token": stats.exchange_ms_per_token(),
            }))
    return 0


