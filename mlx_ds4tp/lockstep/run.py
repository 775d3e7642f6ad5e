"""`ds4tp run` (one rank of a two-machine generation) and `ds4tp demo` (both
ranks on 127.0.0.1 with a small synthetic model, checked against the same
model run unsplit in one process)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

from .. import gate_ops
from .. import transport as tr
from .steps import Leader, Worker, make_sampler


def model_identity(path: str) -> tr.ModelIdentity:
    """What the hello compares: the shape from config.json and the model's
    fingerprint (safetensors headers and small samples), read before anything
    loads, so a pair with different models stops before either spends time
    loading. FileNotFoundError without config.json, ValueError when the
    directory holds no model*.safetensors."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is not an mlx-lm model directory (no config.json); give the same model "
            "directory on both machines"
        ) from None
    layers = int(config.get("num_hidden_layers", 0))
    quant = config.get("quantization") or {}
    return tr.ModelIdentity(
        layers=layers,
        hidden=int(config.get("hidden_size", 0)),
        vocab=int(config.get("vocab_size", 0)),
        quant_bits=int(quant.get("bits", 0)),
        # Embedding gate, attention and MLP gates per block, logits gather.
        gates_per_token=2 * layers + 2,
        fingerprint=tr.model_fingerprint(path),
    )


class LoadingBar:
    """Weights-loading progress on stderr: redrawn in place on a terminal,
    a line per quarter otherwise (logs stay readable)."""

    WIDTH = 30

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last_quarter = -1

    def __call__(self, done: int, total: int, where: str) -> None:
        frac = done / total if total else 1.0
        if self.tty:
            filled = int(frac * self.WIDTH)
            sys.stderr.write(f"\rds4-tp: loading weights [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                             f"{done}/{total} {where[:40]:<40}")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif int(frac * 4) > self.last_quarter:
            self.last_quarter = int(frac * 4)
            tr.log(f"loading weights: {done}/{total} tensors cut ({frac:.0%})")


def bench_prompt(tokenizer, text: str, count: int) -> List[int]:
    """`text`'s tokens repeated (and cut) to exactly `count` tokens: a prompt of a chosen
    length that every contender of the model bench feeds alike."""
    if count < 1:
        raise ValueError(f"a prompt of {count} tokens: give at least 1")
    base = list(tokenizer.encode(text)) or [0]
    return (base * (count // len(base) + 1))[:count]


def run(args, address: Tuple[str, int], *, tokens_out: Optional[str] = None,
        stop_at_eos: bool = True, prompt_tokens: int = 0) -> int:
    """One rank of `ds4tp run` (args as cli.add_run_args parses them).

    tokens_out: the leader writes the prompt's and the generated tokens, the
    prompt and decode rates and the gate latency there as JSON (the local pair
    reads it). stop_at_eos=False decodes max_tokens whatever the model says
    (the bench). prompt_tokens > 0: the leader's prompt is the text's tokens
    repeated to that many (bench_prompt), without the chat template.
    """
    from ..model_split import load_split
    from .sampling import options_from_args, run_sampler

    identity = model_identity(args.model)
    leader = args.role == "leader"
    group = gate_ops.init(
        role=args.role,
        listen=address if leader else None,
        coordinator=None if leader else address,
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

            sampler = run_sampler(options_from_args(args), prompt_ids)
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


# ============================================================================
# Demo
# ============================================================================

DEMO_PRESET = "tiny"
DEMO_SEED = 0


def demo_model_dir() -> Path:
    """Built once with fixed random weights, then reused from the cache."""
    from ..testing.tiny_model import save_llama

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx_ds4tp"
    path = root / f"demo-llama-{DEMO_PRESET}-seed{DEMO_SEED}"
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        tr.log(f"building the demo model (synthetic random weights) in {path}")
        tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=root if root.exists() else None))
        save_llama(tmp, DEMO_PRESET, seed=DEMO_SEED)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)
    return path


def single_process_tokens(path: Path, prompt_tokens: List[int], max_tokens: int) -> List[int]:
    """The same greedy generation, unsplit, in this process: the reference."""
    from mlx_lm.utils import load

    from .steps import greedy_generate

    model, tokenizer = load(str(path))
    eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or [])
    return greedy_generate(model, prompt_tokens, max_tokens, eos).tokens


def run_local_pair(model: Path, prompt: str, max_tokens: int, transport: str,
                   rdma_device: Optional[str], stop_at_eos: bool = True, quiet: bool = False,
                   timeout: float = 1200.0, prompt_tokens: int = 0) -> Optional[dict]:
    """Both ranks of `ds4tp run` on 127.0.0.1 as two processes; returns the
    leader's tokens record (see run's tokens_out), or None when either rank
    failed (both are killed on any failure, the reason is logged).
    prompt_tokens > 0: the prompt's tokens repeated to that many (see run)."""
    from ..testing import localpair as _localpair

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    base = _localpair.rank_command(
        "run", "--model", str(model), "--transport", transport, "--max-tokens", str(max_tokens),
        "--no-chat-template", "--prompt", prompt)
    if rdma_device:
        base += ["--rdma-device", rdma_device]
    if not stop_at_eos:
        base += ["--no-eos"]
    if prompt_tokens > 0:
        base += ["--prompt-tokens", str(prompt_tokens)]
    leader, worker = _localpair.pair_commands(base, _localpair.free_port())
    leader += ["--tokens-out", out_path]
    try:
        _localpair.run_ranks([leader, worker], timeout=timeout,
                             stdout="discard" if quiet else "inherit")
        return json.loads(Path(out_path).read_text())
    except RuntimeError as exc:
        tr.log(f"the local pair failed: {exc}")
        return None
    finally:
        os.unlink(out_path)


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
