"""Random-weight mlx-lm models on disk (dense llama, qwen3_moe), for the demo, the benchmark and the tests.

A machine without a model hub still needs a real mlx-lm model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) to exercise the split end to end.
These builders make one with mlx-lm's own model classes, a fixed seed and a byte-level BPE
tokenizer built from scratch, so every machine writes the same model for the same sizes.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx

# Special tokens sit at fixed ids so config.json can name them without reading the tokenizer.
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
_N_SPECIAL = 3
_N_BYTES = 256
MIN_VOCAB = _N_SPECIAL + _N_BYTES


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaSizes:
    """The shape of a llama-family model: everything the random builder needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    # Untied by default: a tied random model mostly predicts its input token over and over,
    # an untied one says something different each step, which makes a livelier demo.
    tied: bool = False


PRESETS = {
    # Seconds to build, fast to run: the demo's default and the CI's model.
    "tiny": LlamaSizes(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512),
    # tiny with 8 KV heads: what the demo splits over 3 to 8 ranks (3:3:2 at three).
    "tiny8": LlamaSizes(layers=2, hidden=128, heads=8, kv_heads=8, intermediate=256, vocab=512),
    # About 160M float32 parameters (640 MB): big enough that a decode step costs something.
    "150m": LlamaSizes(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=32000),
}


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _filler_merges(count: int) -> list[tuple[str, str]]:
    """`count` merges over lowercase letters and space, shortest strings first.

    Deterministic, and each merge's left part already exists when the merge is made, which is
    all BPE asks. The merges carry no meaning: the weights are random anyway.
    """
    # "Ġ" is byte-level BPE's stand-in for the space byte; letters stand for themselves.
    letters = list("Ġetaoinshrdlucmfwypvbgkjqxz")
    merges: list[tuple[str, str]] = []
    queue = deque(letters)
    while len(merges) < count:
        left = queue.popleft()
        for c in letters:
            merges.append((left, c))
            queue.append(left + c)
            if len(merges) == count:
                break
    return merges


def save_tokenizer(path: Union[str, Path], vocab_size: int) -> None:
    """Write tokenizer.json and tokenizer_config.json with exactly `vocab_size` tokens.

    Ids 0..2 are <s>, </s>, <pad>; 3..258 the 256 bytes; the rest filler merges, so every id
    the model can emit decodes to text and any prompt encodes (byte fallback is built in).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for the byte-level tokenizer; "
            f"use at least {MIN_VOCAB} (3 special tokens + 256 bytes)"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    vocab = {BOS: BOS_ID, EOS: EOS_ID, PAD: PAD_ID}
    # The 256 printable stand-ins byte-level BPE uses for the bytes: any prompt encodes.
    vocab.update({tok: _N_SPECIAL + i for i, tok in enumerate(sorted(ByteLevel.alphabet()))})
    merges = _filler_merges(vocab_size - MIN_VOCAB)
    for left, right in merges:
        vocab[left + right] = len(vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The specials are already in the vocab, so registering them keeps their ids 0..2 and
    # stops the BPE from splitting "<s>" into bytes.
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, PAD)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "add_bos_token": False,
                "model_max_length": 1 << 20,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def save_random_model(
    path: Union[str, Path],
    config: dict[str, Any],
    *,
    seed: int = 0,
    quantization: Optional[dict[str, Any]] = None,
    dtype: mx.Dtype = mx.float32,
) -> Path:
    """Build mlx-lm's model for `config` with seeded random weights and save it with a tokenizer.

    `config` is an mlx-lm config.json as a dict (model_type picks the family: llama, mistral,
    qwen2, qwen3, ...). `quantization` (e.g. {"group_size": 64, "bits": 4}) quantizes with
    mlx-lm's own quantize_model before saving, as `mlx_lm.convert -q` would.
    """
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    path = Path(path)
    config = dict(config)
    config.setdefault("bos_token_id", BOS_ID)
    config.setdefault("eos_token_id", EOS_ID)

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    # Norm weights start at exactly 1, attention sinks, expert biases and routers' correction
    # biases at exactly 0: jitter them so one split the wrong way would show.
    jittered = [
        (k, v + 0.1 * mx.random.normal(v.shape, dtype=v.dtype))
        for k, v in tree_flatten(model.parameters())
        if any(word in k.rsplit(".", 1)[-1] for word in ("norm", "sinks", "bias")) or "norm" in k
    ]
    model.load_weights(jittered, strict=False)
    mx.eval(model.parameters())

    if quantization is not None:
        model, config = quantize_model(
            model,
            config,
            group_size=quantization.get("group_size"),
            bits=quantization.get("bits"),
            mode=quantization.get("mode", "affine"),
        )
    save_model(path, model, donate_model=True)
    save_config(config, path / "config.json")
    save_tokenizer(path, config["vocab_size"])
    return path


def llama_config(sizes: LlamaSizes) -> dict[str, Any]:
    """mlx-lm's config.json for a llama with these sizes."""
    if sizes.kv_heads <= 0 or sizes.heads % sizes.kv_heads:
        raise ValueError(
            f"heads={sizes.heads} is not a multiple of kv_heads={sizes.kv_heads}; grouped-query "
            f"attention shares each KV head among a whole number of query heads"
        )
    if sizes.hidden % sizes.heads:
        raise ValueError(f"hidden={sizes.hidden} is not a multiple of heads={sizes.heads}")
    return {
        "model_type": "llama",
        "hidden_size": sizes.hidden,
        "num_hidden_layers": sizes.layers,
        "intermediate_size": sizes.intermediate,
        "num_attention_heads": sizes.heads,
        "num_key_value_heads": sizes.kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": sizes.vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": sizes.tied,
    }


def save_llama(path: Union[str, Path], sizes: Union[LlamaSizes, str] = "tiny", **options: Any) -> Path:
    """Write a llama-family model with fixed random weights and a byte-level tokenizer to `path`.

    `sizes` is a LlamaSizes or a preset name ("tiny", "150m"); `options`: save_random_model's
    (seed, quantization, dtype). Returns the directory, loadable with mlx_lm.load and with
    mlx_ds4tp.model_split.load_split.
    """
    return save_random_model(path, llama_config(_preset(sizes, PRESETS, "model")), **options)


def _preset(sizes: Any, presets: dict, what: str) -> Any:
    """`sizes` itself, or the preset it names; an unknown name raises naming it and the choices."""
    if not isinstance(sizes, str):
        return sizes
    if sizes not in presets:
        raise ValueError(f"unknown {what} preset {sizes!r}; choose one of {sorted(presets)}")
    return presets[sizes]


@dataclass(frozen=True)
class MoeSizes:
    """The shape of a qwen3_moe model (every layer a mixture of experts)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_per_token: int
    expert_intermediate: int
    vocab: int


MOE_PRESETS = {
    "moe-tiny": MoeSizes(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8,
                         experts_per_token=2, expert_intermediate=64, vocab=512),
    # About 250M float32 parameters (1 GB), 4 layers of 32 experts, top-2: the benchmark's
    # mixture of experts, where the experts are most of the bytes as in the released ones.
    "moe-1g": MoeSizes(layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=64, experts=32,
                       experts_per_token=2, expert_intermediate=512, vocab=16384),
}


def qwen3_moe_config(sizes: MoeSizes) -> dict[str, Any]:
    """mlx-lm's config.json for a qwen3_moe with these sizes."""
    if sizes.kv_heads <= 0 or sizes.heads % sizes.kv_heads:
        raise ValueError(f"heads={sizes.heads} is not a multiple of kv_heads={sizes.kv_heads}")
    if not 0 < sizes.experts_per_token <= sizes.experts:
        raise ValueError(f"experts_per_token={sizes.experts_per_token} must be in 1..experts={sizes.experts}")
    return {
        "model_type": "qwen3_moe",
        "hidden_size": sizes.hidden,
        "num_hidden_layers": sizes.layers,
        "intermediate_size": 4 * sizes.expert_intermediate,
        "num_attention_heads": sizes.heads,
        "num_key_value_heads": sizes.kv_heads,
        "head_dim": sizes.head_dim,
        "num_experts": sizes.experts,
        "num_experts_per_tok": sizes.experts_per_token,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": sizes.expert_intermediate,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": sizes.vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }


def save_qwen3_moe(path: Union[str, Path], sizes: Union[MoeSizes, str] = "moe-tiny", **options: Any) -> Path:
    """Write a qwen3_moe model with fixed random weights and a byte-level tokenizer to `path`.

    `sizes` is a MoeSizes or a preset name ("moe-tiny", "moe-1g"); `options`: save_random_model's
    (seed, quantization, dtype).
    """
    return save_random_model(path, qwen3_moe_config(_preset(sizes, MOE_PRESETS, "mixture-of-experts")), **options)
