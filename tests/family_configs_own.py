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
}
