"""Tiny configs of more mlx-lm families whose Model.shard() plan the split runs.

CONFIGS maps a test name to (an mlx-lm config.json dict, quantization or None). Each model is a
few hundred kilobytes to a few megabytes of float32, and every count the split divides (attention
heads, KV heads, index heads, linear-attention heads, MLP and expert intermediate sizes,
vocabulary) is even. Vision wrappers carry their language model in "text_config" and repeat
vocab_size at the top, where the tiny-model writer reads it for the tokenizer.
"""

from __future__ import annotations

_BASE = {"vocab_size": 512, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
         "tie_word_embeddings": False}

CONFIGS: dict[str, tuple[dict, dict | None]] = {
    # KDA linear attn (layers 0, 2) beside gated MLA, dense layer 0, MoE + shared expert, attn-res.
    "kimi_k3": (
        {**_BASE, "model_type": "kimi_k3", "hidden_size": 128, "num_hidden_layers": 3,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
         "linear_attn_config": {"kda_layers": [1, 3], "num_heads": 4, "head_dim": 32,
                                "short_conv_kernel_size": 4},
         "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
         "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True,
         "mla_use_output_gate": True, "num_experts": 8, "num_experts_per_token": 2,
         "num_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
         "moe_layer_freq": 1, "num_expert_group": 2, "topk_group": 1,
         "routed_scaling_factor": 2.0, "attn_res_block_size": 2},
        None,
    ),
    # Sigmoid-routed MoE in every layer, GQA, whole-width q/k norms the plan shards, partial RoPE.
    "minimax": (
        {**_BASE, "model_type": "minimax", "hidden_size": 128, "num_hidden_layers": 2,
         "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "rotary_dim": 16, "num_experts_per_tok": 2, "num_local_experts": 4,
         "shared_intermediate_size": 0, "rope_theta": 10000.0, "use_qk_norm": True},
        None,
    ),
    # text_config wrapper: dense layer beside MoE + shared experts, a block-sparse indexer layer.
    "minimax_m3_vl": (
        {"model_type": "minimax_m3_vl", "vocab_size": 512,
         "text_config": {**_BASE, "model_type": "minimax_m3", "hidden_size": 128,
                         "num_hidden_layers": 3, "intermediate_size": 64,
                         "dense_intermediate_size": 128, "shared_intermediate_size": 64,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                         "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                         "num_local_experts": 4, "num_experts_per_tok": 2,
                         "routed_scaling_factor": 2.0, "use_qk_norm": True,
                         "use_gemma_norm": True,
                         "mlp_layer_types": ["dense", "sparse", "sparse"],
                         "layer_types": ["full_attention", "minimax_m3_sparse", "full_attention"],
                         "index_n_heads": 2, "index_head_dim": 32, "index_block_size": 8,
                         "index_topk_blocks": 2, "index_local_blocks": 1}},
        None,
    ),
    # MLA (q_lora, yarn, llama-4 position scale), dense layer 0, grouped MoE + shared expert.
    "mistral4": (
        {**_BASE, "model_type": "mistral4", "hidden_size": 128, "num_hidden_layers": 3,
         "intermediate_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
         "routed_scaling_factor": 1.0, "kv_lora_rank": 64, "q_lora_rank": 64,
         "norm_topk_prob": True, "topk_group": 1, "n_group": 2, "num_experts_per_tok": 2,
         "first_k_dense_replace": 1, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
         "v_head_dim": 32,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "llama_4_scaling_beta": 0.1}},
        None,
    ),
    # Dense GQA, sliding-window layers beside a full one, llama-4 position scale, tied embedding.
    "ministral3": (
        {**_BASE, "model_type": "ministral3", "hidden_size": 128, "num_hidden_layers": 3,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "tie_word_embeddings": True, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0, "llama_4_scaling_beta": 0.1}},
        None,
    ),
    # Dense layer 0, MoE + shared expert, sliding layers with own head counts, head-wise gates.
    "step3p5": (
        {**_BASE, "model_type": "step3p5", "hidden_size": 128, "num_hidden_layers": 3,
         "intermediate_size": 128, "num_attention_heads": 4, "num_attention_groups": 2,
         "head_dim": 32, "rope_theta": 10000.0, "sliding_window": 8,
         "layer_types": ["full_attention", "sliding_attention", "full_attention"],
         "attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 4},
         "partial_rotary_factors": [0.5, 1.0, 0.5], "use_head_wise_attn_gate": True,
         "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 64,
         "share_expert_dim": 64, "moe_layers_enum": "1,2", "moe_router_scaling_factor": 2.0,
         "swiglu_limits": [0.0, 7.0, 7.0], "swiglu_limits_shared": [0.0, 0.0, 16.0]},
        None,
    ),
    # Two MLA + two dense MLP sublayers a layer, shortcut MoE with identity (zero) experts.
    "longcat_flash": (
        {**_BASE, "model_type": "longcat_flash", "attention_method": "MLA",
         "zero_expert_type": "identity", "hidden_size": 128, "ffn_hidden_size": 128,
         "moe_topk": 2, "expert_ffn_hidden_size": 64, "n_routed_experts": 4,
         "zero_expert_num": 2, "num_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 64,
         "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
         "routed_scaling_factor": 2.0, "rope_theta": 10000.0, "mla_scale_q_lora": True,
         "mla_scale_kv_lora": True, "attention_bias": False},
        None,
    ),
    # LongCat-Flash layers behind the n-gram embedding (hashed n-gram embedders kept whole).
    "longcat_flash_ngram": (
        {**_BASE, "model_type": "longcat_flash_ngram", "hidden_size": 128,
         "ffn_hidden_size": 128, "moe_topk": 2, "expert_ffn_hidden_size": 64,
         "n_routed_experts": 4, "zero_expert_num": 2, "num_layers": 2,
         "num_attention_heads": 4, "kv_lora_rank": 64, "q_lora_rank": 64,
         "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
         "routed_scaling_factor": 2.0, "rope_theta": 10000.0, "mla_scale_q_lora": True,
         "mla_scale_kv_lora": True, "ngram_vocab_size_ratio": 2, "emb_neighbor_num": 3,
         "emb_split_num": 2},
        None,
    ),
    # Dense layer 0, grouped MoE + shared expert, RoPE sliding layers beside a NoPE global one.
    "exaone_moe": (
        {**_BASE, "model_type": "exaone_moe", "hidden_size": 128, "num_hidden_layers": 3,
         "intermediate_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
         "num_shared_experts": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
         "rope_theta": 10000.0, "sliding_window": 8,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
         "is_moe_layer": [False, True, True]},
        None,
    ),
    # Two loops mixing global and sliding-window attention by per-head gates; q/k/v/o/MLP biases.
    "iquestloopcoder": (
        {**_BASE, "model_type": "iquestloopcoder", "hidden_size": 128, "num_hidden_layers": 2,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "rope_theta": 10000.0, "attention_bias": True, "mlp_bias": True,
         "loop_num": 2, "loop_window_size": 8},
        None,
    ),
    # text_config wrapper: fused qkvg cut by segments, NoPE + sliding layers, latent MoE.
    "muse_spark": (
        {"model_type": "muse_spark", "vocab_size": 512,
         # transformers' config (read for the tokenizer) checks the audio width against hidden.
         "audio_config": {"out_hidden_size": 128},
         "text_config": {"hidden_size": 128, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 3,
                         "vocab_size": 512, "rms_norm_eps": 1e-5, "post_norm_eps": 1e-5,
                         "rope_parameters": {"rope_theta": 10000.0},
                         "layer_rope_theta": [10000.0, 10000.0, 0.0],
                         "layer_types": ["sliding_attention", "full_attention",
                                         "full_attention"],
                         "sliding_window": 8, "final_logit_softcapping": 30.0,
                         "output_multiplier": 1.0, "num_local_experts": 4,
                         "num_experts_per_tok": 2, "moe_hidden_size": 64,
                         "moe_intermediate_size": 64}},
        None,
    ),
}
