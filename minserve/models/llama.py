"""The Llama family (Llama 2/3, SmolLM2, Qwen2, Mistral) over a paged KV cache.

One forward pass takes a *flat* batch: the new tokens of every scheduled sequence laid end to end,
whatever mix of prefill chunks and decodes the scheduler chose. Each layer writes its K/V into the
paged cache and attends through the step's :class:`~minserve.attention.AttentionMetadata`.
Only the rows that will be sampled go through the LM head: a prefill chunk that does not end its
prompt needs no logits, and the head is the largest single matrix of a small model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minserve.attention import AttentionMetadata, TorchPagedAttention
from minserve.models.layers import Linear, RMSNorm, RotaryEmbedding, apply_rope
from minserve.models.registry import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv: Linear, o_proj: Linear):
        super().__init__()
        self.qkv_proj, self.o_proj = qkv, o_proj  # q, k and v fused: one GEMM instead of three
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.attn = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj.forward(x)
        t = x.shape[0]
        # Queries and keys rotate together: one set of RoPE ops per layer instead of two.
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj.forward(self.attn(q, k, v, kv_cache[0], kv_cache[1], meta))


class LlamaMLP(nn.Module):
    def __init__(self, gate_up: Linear, down: Linear):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down  # gate and up fused: one GEMM
        self.inter = down.in_features

    def forward(self, x):
        gate, up = self.gate_up_proj.forward(x).split(self.inter, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, attn: LlamaAttention, mlp: LlamaMLP, ln1: RMSNorm, ln2: RMSNorm):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = ln1, ln2

    def forward(self, h, cos, sin, kv_cache, meta):
        # Submodules' forward is called directly: nn.Module.__call__ (hooks) costs microseconds
        # per call, and a decode step makes hundreds of calls for a few tens of milliseconds of work.
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, kv_cache, meta)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int):
        super().__init__()
        self.config = cfg
        w = weights.get
        self.embed_tokens = nn.Embedding.from_pretrained(weights["model.embed_tokens.weight"], freeze=True)
        self.layers = nn.ModuleList([self._layer(cfg, w, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps)
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = Linear(self.embed_tokens.weight.data)
            # The same Parameter object, not just the same storage: .to(dtype) converts each
            # Parameter once, so a bf16 model keeps one table instead of two.
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head = Linear(weights["lm_head.weight"])
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def _layer(cfg: ModelConfig, w, i: int) -> LlamaDecoderLayer:
        p = f"model.layers.{i}."
        qkv_w = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        qkv_b = (torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                 if w(p + "self_attn.q_proj.bias") is not None else None)
        attn = LlamaAttention(cfg, Linear(qkv_w, qkv_b), Linear(w(p + "self_attn.o_proj.weight")))
        gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
        mlp = LlamaMLP(Linear(gate_up), Linear(w(p + "mlp.down_proj.weight")))
        return LlamaDecoderLayer(attn, mlp, RMSNorm(w(p + "input_layernorm.weight"), cfg.rms_norm_eps),
                                 RMSNorm(w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Flat tokens [T] -> fp32 logits [len(logits_indices), vocab]."""
        h = self.embed_tokens(input_ids)
        cos, sin = (t.to(h.dtype) for t in self.rotary(positions))  # tables are fp32; no-op in fp32
        for layer, kv in zip(self.layers, kv_caches):
            h = layer.forward(h, cos, sin, kv, meta)
        h = self.norm(h[logits_indices])  # RMSNorm is per row: normalizing only sampled rows is exact
        return self.lm_head(h).float()

    def weight_bytes(self) -> int:
        """Bytes of weights read per forward pass: every linear layer, the norms and the
        embedding rows (tiny); the tied LM head is counted once, as a matrix it streams whole."""
        linear = sum(m.weight_bytes() for m in self.modules() if isinstance(m, Linear))
        norms = sum(m.weight.numel() * m.weight.element_size() for m in self.modules() if isinstance(m, RMSNorm))
        return linear + norms
