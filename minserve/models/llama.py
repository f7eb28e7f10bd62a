"""The Llama family (Llama 2/3, SmolLM2, Qwen2, Mistral; Qwen3 in qwen3.py) over a paged KV cache.

One forward pass takes a *flat* batch: the new tokens of every scheduled sequence laid end to end,
whatever mix of prefill chunks and decodes the scheduler chose. Each layer writes its K/V into the
paged cache and attends through the step's :class:`~minserve.attention.AttentionMetadata`.
Only the rows that will be sampled go through the LM head: a prefill chunk that does not end its
prompt needs no logits, and the head is the largest single matrix of a small model.
"""

from __future__ import annotations

import torch
from torch import nn

from minserve.attention import AttentionMetadata, TorchPagedAttention
from minserve.models.layers import Embedding, Linear, MergedLinear, RMSNorm, RotaryEmbedding, apply_rope, silu_mul
from minserve.models.registry import ModelConfig


# Checkpoint projections that we store stacked in one merged layer: one GEMM instead of several
# (vLLM's stacked_params_mapping). Checkpoint name -> (our module, shard of its output rows).
STACKED = {"self_attn.q_proj": ("self_attn.qkv_proj", "q"), "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
           "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
           "mlp.gate_proj": ("mlp.gate_up_proj", "gate"), "mlp.up_proj": ("mlp.gate_up_proj", "up")}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # Only q/k/v carry a bias (Qwen2); a checkpoint with an o_proj bias is refused at loading.
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     cfg.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, dtype, device)
        self.attn = TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj.forward(x)
        t = x.shape[0]
        # Queries and keys rotate together: one set of RoPE ops per layer instead of two.
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        # An int8 KV cache is (k, v, k_scales, v_scales) (engine/kv_cache.py): the scales follow.
        return self.o_proj.forward(self.attn(q, k, v, kv_cache[0], kv_cache[1], meta, *kv_cache[2:]))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": self.inter, "up": self.inter},
                                         False, dtype, device)
        self.down_proj = Linear(self.inter, cfg.hidden_size, False, dtype, device)

    def forward(self, x):
        return self.down_proj.forward(silu_mul(self.gate_up_proj.forward(x), self.inter))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention  # a variant's layer swaps its attention here (models/qwen3.py)

    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.self_attn, self.mlp = self.attention_cls(cfg, dtype, device), LlamaMLP(cfg, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, h, cos, sin, kv_cache, meta):
        # Submodules' forward is called directly: nn.Module.__call__ (hooks) costs microseconds
        # per call, and a decode step makes hundreds of calls for a few tens of milliseconds of work.
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, kv_cache, meta)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class LlamaForCausalLM(nn.Module):
    """Built from the config, then loaded from a Hugging Face state dict (:meth:`load_weights`).

    ``LlamaForCausalLM(cfg, weights, max_positions)`` does both: the layers are built on the
    ``meta`` device (no memory) and loading *adopts* the checkpoint tensors (in ``dtype``, by
    default the checkpoint's), so the model never holds a second full copy of its weights; only
    the merged q/k/v and gate/up layers are fresh tensors. ``LlamaForCausalLM(cfg)`` builds
    uninitialized parameters on ``device`` for a later :meth:`load_weights`, which copies into them.

    The LM head is tied to the embedding when the config says so, or when a checkpoint given here
    has no ``lm_head.weight`` (transformers ties by default). Tied means the *same* Parameter
    object: ``.to(dtype)`` converts each Parameter once, so a bf16 model keeps one table, not two.
    A quantization scheme may untie it (``minserve.quant``, the ``lm_head`` policy).

    A variant (registered in :data:`~minserve.models.registry.ModelRegistry`) subclasses it with its
    own ``decoder_layer_cls`` and the extra checkpoint tensors in :meth:`layer_checkpoint_layout`.
    """

    decoder_layer_cls = LlamaDecoderLayer
    # Why the fused C decode step (kernels/decode.c) cannot run this class, or None: it computes
    # exactly this forward pass (q/k/v biases included). Read from the class's own namespace, so a
    # subclass that does not set it decodes in PyTorch (engine/model_runner.py).
    fused_decode_unsupported: str | None = None

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor] | None = None,
                 max_positions: int | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.config = cfg
        if weights is not None:
            device = "meta"
            dtype = dtype or _checkpoint_dtype(weights)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList([self.decoder_layer_cls(cfg, dtype, device) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        if cfg.tie_word_embeddings or (weights is not None and "lm_head.weight" not in weights):
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        if weights is not None:
            self.load_weights(weights)

    def use_attention(self, backend) -> None:
        """Let every layer attend through a per-layer attention backend (attention/backend.py):
        the torch reference by default; a Triton backend on CUDA plugs in here."""
        for layer in self.layers:
            a = layer.self_attn
            a.attn = backend.layer_attention(a.num_heads, a.num_kv_heads, a.head_dim)

    @property
    def tied(self) -> bool:
        """Whether the LM head reads the embedding table itself (the same Parameter)."""
        return isinstance(self.lm_head, Linear) and self.lm_head.weight is self.embed_tokens.weight

    def checkpoint_layout(self) -> dict[str, tuple[nn.Module, str | None, str]]:
        """Hugging Face tensor name -> (our module, shard, "weight" | "bias"): every tensor we expect."""
        layout: dict[str, tuple[nn.Module, str | None, str]] = {
            "model.embed_tokens.weight": (self.embed_tokens, None, "weight"),
            "model.norm.weight": (self.norm, None, "weight")}
        if not self.tied:
            layout["lm_head.weight"] = (self.lm_head, None, "weight")
        for i, layer in enumerate(self.layers):
            layout.update(self.layer_checkpoint_layout(f"model.layers.{i}.", layer))
        return layout

    def layer_checkpoint_layout(self, p: str, layer: nn.Module) -> dict[str, tuple[nn.Module, str | None, str]]:
        """One decoder layer's tensors (names prefixed ``p``); a variant adds its own."""
        layout = {}
        for hf, (ours, shard) in STACKED.items():
            layout[f"{p}{hf}.weight"] = (layer.get_submodule(ours), shard, "weight")
            if hf.startswith("self_attn.") and self.config.attention_bias:
                layout[f"{p}{hf}.bias"] = (layer.get_submodule(ours), shard, "bias")
        for name in ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            layout[f"{p}{name}.weight"] = (layer.get_submodule(name), None, "weight")
        return layout

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict into the built layers.

        Every expected tensor must be there with its shape, and every tensor given must have a
        place: otherwise a ValueError names the tensors, before anything is loaded. Tensors are
        copied into real parameters, or adopted by ``meta`` ones (see ``weights.load_rows``)."""
        layout = self.checkpoint_layout()
        swapped = [n for n, (m, _, _) in layout.items() if not isinstance(m, (Linear, Embedding, RMSNorm))]
        if swapped:
            raise ValueError(f"cannot load {swapped[0]} into a {type(layout[swapped[0]][0]).__name__}: "
                             "a quantized model cannot load dense weights; load weights before quantize_()")
        ignored = {n for n in weights if n.endswith("rotary_emb.inv_freq")}  # older checkpoints' buffers
        if self.tied:
            ignored.add("lm_head.weight")  # some tied checkpoints store the head anyway; it is unused
        _check_names(layout, set(weights) - ignored)
        for name, (module, shard, param) in layout.items():
            expect = _expected_shape(module, shard, param)
            if tuple(weights[name].shape) != expect:
                raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, "
                                 f"the model config expects {expect}")
        for name, (module, shard, param) in layout.items():
            module.load(weights[name], shard, param)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Flat tokens [T] -> fp32 logits [len(logits_indices), vocab]."""
        h = self.hidden_states(input_ids, positions, kv_caches, meta)
        return self.compute_logits(h[logits_indices])

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata) -> torch.Tensor:
        """Flat tokens [T] -> the last layer's output [T, hidden], before the final norm. For
        callers that need more rows than the sampled ones (prompt logprobs, engine/model_runner.py)."""
        h = self.embed_tokens(input_ids)
        cos, sin = (t.to(h.dtype) for t in self.rotary(positions))  # tables are fp32; no-op in fp32
        for layer, kv in zip(self.layers, kv_caches):
            h = layer.forward(h, cos, sin, kv, meta)
        return h

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Rows of :meth:`hidden_states` -> fp32 logits (vLLM's name). RMSNorm is per row, so
        normalizing only the rows that need logits is exact."""
        return self.lm_head(self.norm(h)).float()

    def weight_bytes(self) -> int:
        """Bytes of weights read per forward pass: every linear layer as its descriptor counts it
        (dense or quantized: data, scales, zero points, bias), the norms, and the embedding rows
        (tiny, not counted); a tied LM head is counted once, as a matrix it streams whole."""
        # Any module with a descriptor() is a weight layer: a dense Linear or its quantized replacement.
        linear = sum(m.descriptor().nbytes for m in self.modules() if callable(getattr(m, "descriptor", None)))
        norms = sum(m.weight.numel() * m.weight.element_size() for m in self.modules() if isinstance(m, RMSNorm))
        return linear + norms


def _checkpoint_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    # The embedding's dtype stands for the checkpoint's: adopting tensors as they are avoids a copy.
    emb = weights.get("model.embed_tokens.weight")
    return emb.dtype if emb is not None and emb.is_floating_point() else torch.get_default_dtype()


def _expected_shape(module: nn.Module, shard: str | None, param: str) -> tuple[int, ...]:
    if isinstance(module, Linear):
        rows = module.shard_rows(shard)[1]
        return (rows, module.in_features) if param == "weight" else (rows,)
    return tuple(module.weight.shape)


def _check_names(layout: dict, given: set[str]) -> None:
    missing, unexpected = sorted(set(layout) - given), sorted(given - set(layout))
    if missing or unexpected:
        def show(names):
            return ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")
        parts = ([f"missing {len(missing)} tensor(s): {show(missing)}"] if missing else []) + (
            [f"unexpected {len(unexpected)} tensor(s), which this model has no place for "
             f"(an unsupported variant?): {show(unexpected)}"] if unexpected else [])
        raise ValueError("checkpoint does not match the model config: " + "; ".join(parts))
