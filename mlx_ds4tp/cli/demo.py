"""`ds4tp demo`: both ranks (or --ranks N) on 127.0.0.1 with a small synthetic model, checked
against the same model run unsplit in one process."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import List

from ..link.config import SECRET_ENV
from ..onehost.local_run import LocalRun, run_local_pair
from ..synthetic.demo_model import demo_model_dir
from .pair_args import (
    LOCKSTEP_NEEDS_PAIR,
    add_ranks_arg,
    add_transport_args,
    check_at_least,
    ranks_from_args,
    refuse_mlx,
)

HELP = "both ranks (or --ranks N) on 127.0.0.1 with a small synthetic model, checked against the unsplit model"


def single_process_tokens(path: Path, prompt_tokens: List[int], max_tokens: int) -> List[int]:
    """The same greedy generation, unsplit, in this process: the reference."""
    from mlx_lm.utils import load

    from ..lockstep.generate import greedy_generate

    model, tokenizer = load(str(path))
    eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or [])
    return greedy_generate(model, prompt_tokens, max_tokens, eos).tokens


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ds4tp demo`."""
    add_transport_args(p, rdma_device_help="'ucsim' for the emulated Thunderbolt device, or a verbs device")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--prompt", default="The two machines agree that",
                   help="the prompt, fed as raw text (default %(default)r)")
    add_ranks_arg(p)


def main(args: argparse.Namespace) -> int:
    """Check the flags, then both ranks here on the demo model and the same generation unsplit;
    0 when they match."""
    check_at_least("demo", (("--max-tokens", args.max_tokens, 1),))
    refuse_mlx(args, "demo", f"its two ranks are a `ds4tp run` pair, and {LOCKSTEP_NEEDS_PAIR}")
    # The rest of the link flags, for both ranks' `ds4tp run`. A --secret reaches them in their
    # environment (child_env copies this one's), never on their command lines, where `ps` shows it.
    extra = [*(("--rdma-gid-index", str(args.rdma_gid_index)) if args.rdma_gid_index is not None else ())]
    if args.secret:
        os.environ[SECRET_ENV] = args.secret
    ranks = ranks_from_args(args, "demo")
    path = demo_model_dir(ranks)
    how = f"split across {ranks} local processes"
    print("ds4tp demo: a small llama-family model with SYNTHETIC random weights (the text is "
          f"noise), {how}.", flush=True)
    # Every rank writes here: the leader's text on stdout, every rank's `ds4-tp:` logs on stderr.
    print(f"prompt: {args.prompt!r}\n--- the {ranks} ranks (stdout: the leader's text; stderr: every "
          f"rank's logs) ---", flush=True)
    result = run_local_pair(LocalRun(path, args.prompt, args.max_tokens, args.transport, args.rdma_device,
                                     extra=extra, ranks=ranks), timeout=600.0)
    if result is None:
        print("ds4tp demo: FAILED (see the ranks' errors above)", flush=True)
        return 1
    reference = single_process_tokens(path, result["prompt_tokens"], args.max_tokens)
    match = reference == result["tokens"]
    print("--- summary ---")
    print(f"tokens ({ranks} ranks): {result['tokens']}")
    print(f"tokens (single): {reference}")
    gates = f" | gate p50 {result['gate_p50_us']:.1f} us p99 {result['gate_p99_us']:.1f} us"
    print(f"transport {result['transport']} | decode {result['decode_tok_s']:.1f} tok/s{gates}")
    print(f"match with the unsplit model in one process: {match}")
    print("\nServe this model here (an OpenAI-compatible API on http://127.0.0.1:8080/v1, "
          "model id 'demo'), both ranks on 127.0.0.1:\n"
          "  $ ds4tp serve --model demo --role worker --coordinator 127.0.0.1 9911 &\n"
          "  $ ds4tp serve --model demo --role leader --listen 127.0.0.1 9911\n"
          "On two Macs joined by Thunderbolt (see README 'Two Macs'):\n"
          "  mac1$ ds4tp run --model PATH --prompt 'Hello' --role leader --listen 10.99.0.1 9911\n"
          "  mac2$ ds4tp run --model PATH --role worker --coordinator 10.99.0.1 9911")
    return 0 if match else 2
