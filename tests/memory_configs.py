"""Checkpoints of three kinds for the peak-memory check: about 0.25 GB float32 a layer.

configs(4) are the ~1 GB checkpoints of the closing note's measurement; the suite uses 3 layers.
"""


def configs(layers: int = 4) -> dict[str, dict]:
    h = 1024
    return {
        # MLA + MoE (deepseek_v3): latent attention, routed + shared experts, one dense layer
        "deepseek_v3": {"model_type": "deepseek_v3", "vocab_size": 16384, "hidden_size": h,
            "num_hidden_layers": layers, "intermediate_size": 2048, "moe_intermediate_size": 512,
            "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 1,
            "n_routed_experts": 32, "routed_scaling_factor": 2.5, "kv_lora_rank": 256, "q_lora_rank": 512,
            "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False},
        # linear-attention hybrid (qwen3_next): gated delta-net layers beside full attention, MoE
        "qwen3_next": {"model_type": "qwen3_next", "hidden_size": h, "num_hidden_layers": layers,
            "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
            "linear_num_value_heads": 16, "linear_num_key_heads": 8, "linear_key_head_dim": 64,
            "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 32,
            "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 512,
            "mlp_only_layers": [], "moe_intermediate_size": 512, "rms_norm_eps": 1e-5, "vocab_size": 16384,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
            "norm_topk_prob": True, "tie_word_embeddings": False, "full_attention_interval": 4},
        # plain MoE (qwen3_moe)
        "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 16384, "hidden_size": h,
            "num_hidden_layers": layers, "intermediate_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 512,
            "norm_topk_prob": True, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": False},
    }
