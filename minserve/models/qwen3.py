"""Qwen3: the Llama layout with an RMSNorm over each query and key head, before RoPE.

Qwen3 drops Qwen2's q/k/v biases and normalizes every head of q and k on its own (``q_norm`` and
``k_norm``, one ``[head_dim]`` weight each, shared by the heads of a layer): attention logits then
stay bounded however large the projections grow, which is why the model trains stably without the
biases. Everything else (GQA, SwiGLU MLP, RMSNorm, RoPE, tied or untied head) is
:class:`~minserve.models.llama.LlamaForCausalLM`'s, so this module adds one attention class and
the two checkpoint tensors per layer. The order of operations is transformers': project, view as
heads, normalize, rotate (tests/test_model_registry.py checks greedy tokens and logprobs).

The fused C decode step has no per-head norm, so a Qwen3 engine decodes in PyTorch
(``fused_decode_unsupported``; the runner logs the reason). ``attention_bias=True`` (not used by
the released checkpoints) puts a bias on q, k, v and o, as transformers does.
"""

from __future__ import annotations

import torch

from minserve.models.layers import Linear, RMSNorm, apply_rope
from minserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from minserve.models.registry import ModelConfig


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__(cfg, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        if cfg.attention_bias:  # transformers' Qwen3 puts it on the output projection too
            self.o_proj = Linear(self.q_size, cfg.hidden_size, True, dtype, device)

    def forward(self, x, cos, sin, kv_cache, meta):
        qkv = self.qkv_proj.forward(x)
        t = x.shape[0]
        heads = qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim)
        q = self.q_norm.forward(heads[:, :self.num_heads])
        k = self.k_norm.forward(heads[:, self.num_heads:])
        qk = apply_rope(torch.cat((q, k), dim=1), cos, sin)  # one set of RoPE ops for both
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj.forward(self.attn(q, k, v, kv_cache[0], kv_cache[1], meta, *kv_cache[2:]))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
    fused_decode_unsupported = ("Qwen3ForCausalLM normalizes each q and k head (q_norm, k_norm), "
                                "which the fused C decode step does not implement")

    def layer_checkpoint_layout(self, p, layer):
        layout = super().layer_checkpoint_layout(p, layer)
        attn = layer.self_attn
        layout[f"{p}self_attn.q_norm.weight"] = (attn.q_norm, None, "weight")
        layout[f"{p}self_attn.k_norm.weight"] = (attn.k_norm, None, "weight")
        if self.config.attention_bias:
            layout[f"{p}self_attn.o_proj.bias"] = (attn.o_proj, None, "bias")
        return layout
