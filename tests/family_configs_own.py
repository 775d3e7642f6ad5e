"""Tiny configs of the families split by our own plans (split/plans.py), for tests/test_split_families.py."""

CONFIGS: dict[str, tuple[dict, dict | None]] = {
    # Gated delta-net layers (cut by key head) beside a gated full-attention layer, MoE blocks
    # with a gated shared expert beside a dense MLP layer.
    "qwen3_next": (
        {"model_type": "qwen3_next", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
         "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 4,
         "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
         "mlp_only_layers": [1], "moe_intermediate_size": 64, "rms_norm_eps": 1e-5, "vocab_size": 512,
         "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 2048,
         "norm_topk_prob": True, "tie_word_embeddings": False, "full_attention_interval": 4},
        None,
    ),
    # Llama 4's text model: MoE layers (routed experts and a shared expert) interleaved with
    # dense ones, chunked attention, rope-less layers.
    "llama4": (
        {"model_type": "llama4", "vocab_size": 512, "text_config": {
            "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 8, "head_dim": 32,
            "hidden_size": 128, "interleave_moe_layer_step": 2, "intermediate_size": 64,
            "intermediate_size_mlp": 256, "max_position_embeddings": 2048, "num_attention_heads": 4,
            "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2,
            "num_local_experts": 4, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0,
            "use_qk_norm": True, "vocab_size": 512}},
        None,
    ),
    # Every block a mixture of experts (mixtral has no shared experts).
    "mixtral": (
        {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 2048, "tie_word_embeddings": False, "num_hidden_layers": 2,
         "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
        None,
    ),
    # A dense layer, then MoE blocks (grouped sigmoid routing, a shared expert); per-head q/k norms.
    "dots1": (
        {"model_type": "dots1", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 3,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "first_k_dense_replace": 1,
         "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
         "num_experts_per_tok": 2, "rope_theta": 10000.0, "routed_scaling_factor": 2.5,
         "scoring_func": "noaux_tc", "n_group": 2, "topk_group": 1, "tie_word_embeddings": False},
        None,
    ),
    # Dense layers around MoE blocks with a shared expert; biases on every projection (use_bias).
    "ernie4_5_moe": (
        {"model_type": "ernie4_5_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "max_position_embeddings": 2048, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_hidden_layers": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "use_bias": True, "tie_word_embeddings": False, "moe_num_experts": 4, "moe_layer_start_index": 1,
         "moe_layer_end_index": 2, "moe_intermediate_size": 64, "moe_k": 2, "moe_layer_interval": 1,
         "moe_num_shared_experts": 1},
        None,
    ),
    # Cross-layer attention (odd layers reuse the even one's k/v), q/k norms, attention biases, MoE with a shared MLP.
    "hunyuan": (
        {"model_type": "hunyuan", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4,
         "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "attention_bias": True, "moe_topk": 2, "num_experts": 4, "num_shared_expert": 1,
         "use_mixed_mlp_moe": True, "use_qk_norm": True, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "use_cla": True, "cla_share_factor": 2, "moe_intermediate_size": 64,
         "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}, "tie_word_embeddings": True},
        None,
    ),
    # Fused query_key_value (with bias), q/k norms; a dense layer, then MoE with expert bias and a shared expert.
    "bailing_moe": (
        {"model_type": "bailing_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "max_position_embeddings": 2048, "moe_intermediate_size": 64, "num_experts": 8,
         "num_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
         "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "first_k_dense_replace": 1, "use_qkv_bias": True, "use_qk_norm": True,
         "partial_rotary_factor": 0.5, "moe_router_enable_expert_bias": True, "score_function": "sigmoid",
         "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "tie_word_embeddings": False},
        None,
    ),
    # Qwen3-VL MoE's language model (a qwen3_moe): a dense layer (mlp_only_layers), then MoE blocks.
    "qwen3_vl_moe": (
        {"model_type": "qwen3_vl_moe", "vocab_size": 512, "text_config": {
            "model_type": "qwen3_vl_moe_text", "hidden_size": 128, "num_hidden_layers": 3,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
            "moe_intermediate_size": 64, "rms_norm_eps": 1e-5, "vocab_size": 512, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "max_position_embeddings": 2048, "norm_topk_prob": True}},
        None,
    ),
    # Sliding-window (own heads, window 8) beside full layers, per-head sinks; a dense layer, then MoE + shared.
    "mimo_v2_flash": (
        {"model_type": "mimo_v2_flash", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4,
         "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts_per_tok": 2,
         "hybrid_layer_pattern": [0, 1, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
         "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": True,
         "sliding_window_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
         "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 2.5,
         "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2,
         "topk_group": 1, "max_position_embeddings": 2048, "layernorm_epsilon": 1e-5,
         "rope_theta": 10000.0, "swa_rope_theta": 5000.0, "swa_num_attention_heads": 8,
         "swa_num_key_value_heads": 4, "head_dim": 32, "v_head_dim": 16, "swa_head_dim": 16,
         "swa_v_head_dim": 16, "partial_rotary_factor": 0.5, "attention_value_scale": 0.7},
        None,
    ),
    # Kimi delta-attention layers beside MLA layers; a dense layer, then MoE blocks with a shared expert.
    "kimi_linear": (
        {"model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256, "head_dim": 32,
         "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "model_max_length": 2048,
         "linear_attn_config": {"kda_layers": [1, 3], "num_heads": 4, "head_dim": 32,
                                "short_conv_kernel_size": 4},
         "num_experts": 4, "moe_intermediate_size": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
         "qk_rope_head_dim": 16, "v_head_dim": 32, "num_experts_per_token": 2, "num_shared_experts": 1,
         "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "moe_layer_freq": 1,
         "num_expert_group": 2, "topk_group": 1, "tie_word_embeddings": False},
        None,
    ),
}
