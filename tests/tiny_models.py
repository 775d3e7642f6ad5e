"""Tiny random models of each supported family, and the greedy decode the split tests compare.

Shared by tests/test_model_split.py (the unsplit reference, in-process) and tests/split_child.py
(the two ranks, one process each), so both sides run exactly the same loop.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_ds4tp.synthetic.tiny_model import save_random_model

_COMMON = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}

# name -> (config, quantization). Between them they cover: tied and untied vocabulary
# projections, biases on column-parallel (qwen2 q/k/v) and row-parallel layers (llama o_proj
# and down_proj), grouped-query attention, qwen3's per-head q/k norms with a head_dim that is
# not hidden/heads, and 4- and 8-bit affine quantization (with a quantized tied embedding).
FAMILIES: dict[str, tuple[dict, dict | None]] = {
    "llama": (
        {**_COMMON, "model_type": "llama", "attention_bias": True, "mlp_bias": True,
         "tie_word_embeddings": True},
        None,
    ),
    "mistral": (
        {**_COMMON, "model_type": "mistral", "num_attention_heads": 8, "intermediate_size": 384,
         "tie_word_embeddings": False},
        None,
    ),
    "qwen2": ({**_COMMON, "model_type": "qwen2", "tie_word_embeddings": True}, None),
    "qwen3": (
        {**_COMMON, "model_type": "qwen3", "head_dim": 48, "tie_word_embeddings": False},
        None,
    ),
    "llama-q4": (
        {**_COMMON, "model_type": "llama", "tie_word_embeddings": False},
        {"group_size": 32, "bits": 4},
    ),
    "qwen2-q8": (
        {**_COMMON, "model_type": "qwen2", "tie_word_embeddings": True},
        {"group_size": 64, "bits": 8},
    ),
}

_MOE = {"vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": False}

# The mixture-of-experts and MLA families, float and quantized. Between them: dense layers beside
# MoE layers (qwen3_moe's mlp_only_layers, glm4_moe's and deepseek_v3's first_k_dense_replace),
# shared experts, grouped noaux_tc routers with a correction bias, MLA with and without the
# low-rank q_a/q_b queries, gpt-oss's sinks, biases, sliding-window layers and mxfp4 experts.
MOE_FAMILIES: dict[str, tuple[dict, dict | None]] = {
    "qwen3_moe": (
        {**_MOE, "model_type": "qwen3_moe", "num_hidden_layers": 3, "intermediate_size": 256,
         "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
         "mlp_only_layers": [1], "moe_intermediate_size": 64, "norm_topk_prob": True},
        None,
    ),
    "mixtral": (
        {**_MOE, "model_type": "mixtral", "num_hidden_layers": 2, "intermediate_size": 64,
         "num_local_experts": 4, "num_experts_per_tok": 2},
        None,
    ),
    "glm4_moe": (
        {**_MOE, "model_type": "glm4_moe", "num_hidden_layers": 3, "intermediate_size": 256,
         "moe_intermediate_size": 64, "norm_topk_prob": True, "head_dim": 32, "n_group": 2,
         "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 8,
         "routed_scaling_factor": 1.5, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
         "rope_scaling": None, "use_qk_norm": True, "attention_bias": True,
         "partial_rotary_factor": 0.5},
        None,
    ),
    "deepseek_v3": (
        {**_MOE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "intermediate_size": 256,
         "moe_intermediate_size": 64, "num_key_value_heads": 4, "n_shared_experts": 1,
         "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 64,
         "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32,
         "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1},
        None,
    ),
    "gpt_oss": (
        {**_MOE, "model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 4,
         "num_experts_per_tok": 2, "intermediate_size": 64, "head_dim": 32, "sliding_window": 8},
        None,
    ),
    "qwen3_moe-q4": (
        {**_MOE, "model_type": "qwen3_moe", "num_hidden_layers": 2, "intermediate_size": 256,
         "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "moe_intermediate_size": 64, "norm_topk_prob": True},
        {"group_size": 32, "bits": 4},
    ),
    "mixtral-q8": (
        {**_MOE, "model_type": "mixtral", "num_hidden_layers": 2, "intermediate_size": 64,
         "num_local_experts": 4, "num_experts_per_tok": 2},
        {"group_size": 32, "bits": 8},
    ),
    "glm4_moe-q4": (
        {**_MOE, "model_type": "glm4_moe", "num_hidden_layers": 2, "intermediate_size": 256,
         "moe_intermediate_size": 64, "norm_topk_prob": True, "head_dim": 32, "n_group": 1,
         "topk_group": 1, "n_shared_experts": 2, "n_routed_experts": 8,
         "routed_scaling_factor": 1.0, "num_experts_per_tok": 2, "first_k_dense_replace": 0,
         "rope_scaling": None, "use_qk_norm": False, "attention_bias": False,
         "partial_rotary_factor": 0.5},
        {"group_size": 32, "bits": 4},
    ),
    "deepseek_v3-q4": (
        {**_MOE, "model_type": "deepseek_v3", "num_hidden_layers": 2, "intermediate_size": 256,
         "moe_intermediate_size": 64, "num_key_value_heads": 4, "n_shared_experts": 1,
         "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 64,
         "q_lora_rank": None, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32,
         "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1},
        {"group_size": 32, "bits": 4},
    ),
    "gpt_oss-mxfp4": (
        {**_MOE, "model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 4,
         "num_experts_per_tok": 2, "intermediate_size": 64, "head_dim": 32, "sliding_window": 8},
        {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    ),
}

PROMPT = "the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 32


class RankOnly:
    """A group that only says who it is: enough to cut weights, which never calls a collective."""

    def __init__(self, rank: int, size: int = 2):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def build(name: str, directory: Path, seed: int = 0) -> Path:
    """Save family `name` with fixed random weights under directory/name."""
    config, quantization = FAMILIES[name] if name in FAMILIES else MOE_FAMILIES[name]
    return save_random_model(directory / name, config, seed=seed, quantization=quantization)


def greedy_decode(model, prompt_ids: list[int], max_tokens: int = MAX_TOKENS):
    """Greedy tokens and the logits each was chosen from ([max_tokens, vocab] float32)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)[0, -1]
    tokens, all_logits = [], []
    for _ in range(max_tokens):
        token = mx.argmax(logits)
        mx.eval(token, logits)
        tokens.append(token.item())
        all_logits.append(np.array(logits.astype(mx.float32)))
        logits = model(token.reshape(1, 1), cache=cache)[0, -1]
    return tokens, np.stack(all_logits)


def stream_tokens(model, tokenizer, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens through mlx-lm's own generator (prefill, async eval, its cache)."""
    from mlx_lm.generate import generation_stream, stream_generate
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=0.0)
    tokens = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens, sampler=sampler)]
    # generate_step evaluates one step ahead (async_eval) and leaves that last step running when
    # it stops. With MLX's ring backend that step's collectives are still in flight on the
    # generation stream: the next model's collectives on the default stream would pair up with
    # them across the ranks and mix the two models' partial sums.
    mx.synchronize(generation_stream)
    return tokens
