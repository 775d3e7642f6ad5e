"""Tiny configs of mlx-lm families split by their own Model.shard() plans (set A).

CONFIGS maps a test name to (mlx-lm config.json dict, quantization or None). Each model is a
few hundred KB to a few MB float32 (hidden 64, 2-3 layers, vocabulary 512), and every count
mlx-lm's plan divides across two ranks is even: attention heads, KV heads, linear-attention key
and value heads, expert / shared-expert / dense MLP widths, output groups, vocabulary. No
head_dim is below 16. The wrapped families (qwen3_5*, kimi_k25) nest the language model's
config under "text_config" as their checkpoints do; vocab_size is repeated at the top level for
the tokenizer writer.
"""

from __future__ import annotations

_BASE = {"vocab_size": 512, "hidden_size": 64, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}

# Qwen3.5's text model: 3 layers, full_attention_interval=2 gives gated delta-net layers 0 and
# 2 beside the gated full-attention layer 1, with partial rotary.
_QWEN3_5_TEXT = {
    **_BASE, "model_type": "qwen3_5_text", "num_hidden_layers": 3, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2]},
}

_MLA = {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32}

_DEEPSEEK_V3_TEXT = {
    **_BASE, **_MLA, "model_type": "kimi_k2", "num_hidden_layers": 3, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2,
    "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
}

CONFIGS: dict[str, tuple[dict, dict | None]] = {
    # qwen3_5 (vision wrapper, nested text_config): gated delta-net linear attention (conv1d and fused q/k/v cut by segments, per-head dt_bias/A_log) beside gated full attention with q/k norms and partial rotary, dense MLP, tied embedding.
    "qwen3_5": (
        {"model_type": "qwen3_5", "vocab_size": 512, "tie_word_embeddings": True,
         "text_config": {**_QWEN3_5_TEXT, "tie_word_embeddings": True}},
        None,
    ),
    # qwen3_5_moe (nested text_config): the same linear/full attention layout with every MLP a mixture of 4 experts plus a sigmoid-gated shared expert, untied lm_head cut by mlx-lm's plan.
    "qwen3_5_moe": (
        {"model_type": "qwen3_5_moe", "vocab_size": 512,
         "text_config": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 64, "norm_topk_prob": True}},
        None,
    ),
    # qwen3_5_moe 4-bit affine (group 32): quantized linear-attention projections, experts, shared expert and untied lm_head cut per rank, router and shared-expert gate at mlx-lm's 8-bit predicate; expert width 64 so each rank's down_proj input (32) is a whole quantization group.
    "qwen3_5_moe-q4": (
        {"model_type": "qwen3_5_moe", "vocab_size": 512,
         "text_config": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                         "shared_expert_intermediate_size": 64, "norm_topk_prob": True}},
        {"group_size": 32, "bits": 4},
    ),
    # glm4_moe_lite: MLA with low-rank q_a/q_b queries and absorbed per-head embed_q/unembed_out, a dense first layer (first_k_dense_replace=1) beside MoE layers with a shared expert and a grouped noaux_tc router.
    "glm4_moe_lite": (
        {**_BASE, **_MLA, "model_type": "glm4_moe_lite", "num_hidden_layers": 3,
         "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
         "routed_scaling_factor": 1.8, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
         "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
         "moe_layer_freq": 1, "first_k_dense_replace": 1, "rope_theta": 10000.0,
         "rope_scaling": None, "attention_bias": False, "num_nextn_predict_layers": 0},
        None,
    ),
    # glm_moe_dsa (deepseek_v32's module): DSA sparse attention, an indexer (whole on each rank) picking the top 8 keys over MLA latents, a dense first layer beside MoE layers with a shared expert.
    "glm_moe_dsa": (
        {**_BASE, **_MLA, "model_type": "glm_moe_dsa", "num_hidden_layers": 3,
         "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 4, "index_head_dim": 32, "index_n_heads": 2, "index_topk": 8,
         "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
         "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
         "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
         "first_k_dense_replace": 1, "attention_bias": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
         "indexer_rope_interleave": True},
        None,
    ),
    # solar_open (glm4_moe's module): grouped-query attention with partial rotary and a dense first layer beside MoE layers with two shared experts and a grouped noaux_tc router.
    "solar_open": (
        {**_BASE, "model_type": "solar_open", "num_hidden_layers": 3, "intermediate_size": 128,
         "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "n_shared_experts": 2, "n_routed_experts": 8,
         "routed_scaling_factor": 1.0, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
         "norm_topk_prob": True, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
         "rope_scaling": None, "attention_bias": False, "use_qk_norm": False, "n_group": 2,
         "topk_group": 1},
        None,
    ),
    # deepseek_v2: un-absorbed MLA (kv_b_proj cut by head) with low-rank queries and YaRN rope, a dense first layer beside MoE layers with a shared expert and a group_limited_greedy softmax router.
    "deepseek_v2": (
        {**_BASE, **_MLA, "model_type": "deepseek_v2", "num_hidden_layers": 3,
         "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
         "routed_scaling_factor": 1.0, "topk_method": "group_limited_greedy", "n_group": 2,
         "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
         "first_k_dense_replace": 1, "rope_theta": 10000.0, "attention_bias": False,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                          "mscale_all_dim": 0.707}},
        None,
    ),
    # deepseek_v32: DSA sparse attention (indexer top-8 over the MLA latents, indexer whole), absorbed MLA heads, YaRN rope, a dense first layer beside MoE layers with a shared expert.
    "deepseek_v32": (
        {**_BASE, **_MLA, "model_type": "deepseek_v32", "num_hidden_layers": 3,
         "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 4, "index_head_dim": 32, "index_n_heads": 4, "index_topk": 8,
         "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
         "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
         "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
         "first_k_dense_replace": 1, "rope_theta": 10000.0, "attention_bias": False,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                          "mscale_all_dim": 1.0}},
        None,
    ),
    # deepseek_v41: sliding-window attention (window 8) with per-head sinks, a compressed-KV layer whose indexer picks the top 4 groups for itself and the next layer, grouped low-rank output (o_a_proj cut by group), hyper-connections, MoE with a shared expert in every layer.
    "deepseek_v41": (
        {**_BASE, "model_type": "deepseek_v41", "num_hidden_layers": 3,
         "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16,
         "o_groups": 2, "o_lora_rank": 32, "moe_intermediate_size": 32, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
         "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
         "sliding_window": 8, "compress_ratios": [0, 4, 4], "kv_source_layer_ids": [1],
         "index_source_layer_ids": [1], "compress_rope_theta": 160000.0,
         "candidate_source_layer_id": -1, "index_n_heads": 2, "index_head_dim": 32,
         "index_topk": 4, "rope_theta": 10000.0, "rope_scaling": None, "hc_mult": 2,
         "hc_sinkhorn_iters": 4},
        None,
    ),
    # kimi_k25 (vision wrapper, nested deepseek_v3 text_config): absorbed MLA with low-rank queries, a dense first layer beside MoE layers with a shared expert and a grouped noaux_tc router, lm_head under language_model.
    "kimi_k25": (
        {"model_type": "kimi_k25", "vocab_size": 512, "text_config": dict(_DEEPSEEK_V3_TEXT)},
        None,
    ),
}
