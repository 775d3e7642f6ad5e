"""`ds4tp demo`: both ranks on 127.0.0.1 with a small synthetic model, checked
against the same model run unsplit in one process."""

from __future__ import annotations

from pathlib import Path
from typing import List

from ..testing.demo_model import demo_model_dir
from ..testing.local_run import run_local_pair


def single_process_tokens(path: Path, prompt_tokens: List[int], max_tokens: int) -> List[int]:
    """The same greedy generation, unsplit, in this process: the reference."""
    from mlx_lm.utils import load

    from ..lockstep.steps import greedy_generate

    model, tokenizer = load(str(path))
    eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or [])
    return greedy_generate(model, prompt_tokens, max_tokens, eos).tokens


def demo(args) -> int:
    path = demo_model_dir()
    print("ds4tp demo: a small llama-family model with SYNTHETIC random weights (the text is "
          "noise), split 50/50 across two local processes.", flush=True)
    print(f"prompt: {args.prompt!r}\n--- leader output ---", flush=True)
    result = run_local_pair(path, args.prompt, args.max_tokens, args.transport, args.rdma_device,
                            timeout=600.0)
    if result is None:
        print("ds4tp demo: FAILED (see the ranks' errors above)", flush=True)
        return 1
    reference = single_process_tokens(path, result["prompt_tokens"], args.max_tokens)
    match = reference == result["tokens"]
    print("--- summary ---")
    print(f"tokens (pair):   {result['tokens']}")
    print(f"tokens (single): {reference}")
    print(f"transport {result['transport']} | decode {result['decode_tok_s']:.1f} tok/s | gate p50 "
          f"{result['gate_p50_us']:.1f} us p99 {result['gate_p99_us']:.1f} us")
    print(f"match with the unsplit model in one process: {match}")
    print("\nOn two Macs joined by Thunderbolt (see README 'Two Macs'):\n"
          "  mac1$ ds4tp run --model PATH --prompt 'Hello' --role leader --listen 10.99.0.1 9911\n"
          "  mac2$ ds4tp run --model PATH --role worker --coordinator 10.99.0.1 9911")
    return 0 if match else 2
