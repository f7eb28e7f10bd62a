"""A tiny, deterministic, random-weight Llama for fast tests and quick experiments.

Weights come from a seeded generator, so every machine builds the same model. The vocabulary is
SmolLM2's real tokenizer, so prompts, chat templates and stop strings behave as with a real model.
Weights are scaled so next-token distributions are peaked: greedy decoding then rarely meets a
near-tie, which keeps token-for-token comparisons meaningful.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}


def tiny_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rand(*shape, std):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], hidden, std=1.0),
         "model.norm.weight": 1.0 + rand(hidden, std=0.1)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(cfg["vocab_size"], hidden, std=1.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, out, inp in (("self_attn.q_proj", q_out, hidden), ("self_attn.k_proj", kv_out, hidden),
                               ("self_attn.v_proj", kv_out, hidden), ("self_attn.o_proj", hidden, q_out),
                               ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden),
                               ("mlp.down_proj", hidden, inter)):
            w[p + name + ".weight"] = rand(out, inp, std=inp ** -0.5)
        if cfg.get("attention_bias"):
            for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                w[p + f"self_attn.{name}.bias"] = rand(out, std=0.1)
        w[p + "input_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
    return w


def write_tiny_model(out: Path, seed: int, tokenizer_dir: Path, overrides: dict | None = None) -> Path:
    """Write a Hugging Face style directory (config, safetensors, tokenizer) for a tiny model."""
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY_CONFIG, **(overrides or {})}
    save_file(tiny_weights(cfg, seed), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in Path(tokenizer_dir).iterdir():
        if not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    return out
