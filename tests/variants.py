"""Tiny random checkpoints of every architecture variant we support, as config overrides."""

VARIANTS = {
    "llama-tied": {"tie_word_embeddings": True},
    "llama3-rope-scaling": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "llama-linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "qwen2-qkv-bias": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True,
                       "use_sliding_window": False},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "mha-no-gqa": {"num_key_value_heads": 4},
    # Sizes that are not multiples of 16 floats: every vector loop of the fused kernel has a tail.
    "odd-sizes": {"hidden_size": 72, "intermediate_size": 100, "num_attention_heads": 3,
                  "num_key_value_heads": 1, "head_dim": 24},
    # Six query heads per kv head: the fused step's attention takes them in two passes (4 + 2), and
    # a head of 12 floats has a tail on every vector width.
    "gqa-six-per-kv": {"hidden_size": 72, "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 12},
}
