"""The fused CPU decode step: every layer of a decode-only batch in one call into C.

:class:`FusedDecoder` binds a :class:`~minserve.models.llama.LlamaForCausalLM` and its paged KV
cache to ``ms_decode_step`` in ``decode.c`` (beside this file) once (pointers to every weight and
cache tensor), then runs each all-decode step with a single ctypes call instead of ~35 PyTorch
operations per layer. It computes what ``LlamaForCausalLM.forward`` computes, in the same order of
operations except for the summation order inside dot products, so greedy outputs stay token-exact
against transformers (tests/test_fused_decode.py checks both paths against each other and the reference).

Prefill chunks, speculative verification (several query tokens per sequence), half precision and
GPUs keep using the PyTorch path: the kernel is the CPU answer to one question, the cost of many
small operations when every step moves only one token per sequence.
"""

from __future__ import annotations

import ctypes

import torch

from minserve.kernels.build import KernelUnavailable, load

_f32p = ctypes.POINTER(ctypes.c_float)
_i64p = ctypes.POINTER(ctypes.c_int64)
_I64 = ctypes.c_int64


class _LayerPtrs(ctypes.Structure):
    _fields_ = [(n, _f32p) for n in ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm",
                                      "gate_up", "down", "k_cache", "v_cache")]


class _ModelPtrs(ctypes.Structure):
    _fields_ = ([(n, _I64) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate", "vocab", "block_size")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(n, _f32p) for n in ("embed", "final_norm", "lm_head", "cos", "sin_signed")]
                + [("layers", ctypes.POINTER(_LayerPtrs))])


class _Scratch(ctypes.Structure):
    _fields_ = ([(n, _f32p) for n in ("h", "x", "qkv", "attn", "gate_up", "act", "scores")]
                + [("scores_stride", _I64)])


def _ptr(t: torch.Tensor | None, kind=_f32p):
    return ctypes.cast(t.data_ptr(), kind) if t is not None else kind()


def unsupported_reason(model, kv_caches) -> str | None:
    """Why the fused kernel cannot run this model, or None when it can."""
    w = model.embed_tokens.weight
    if w.device.type != "cpu":
        return f"the model is on {w.device.type}, the fused decode kernel is CPU-only"
    if w.dtype != torch.float32:
        return f"the model is {w.dtype}, the fused decode kernel computes in float32"
    if model.config.head_dim % 2 or model.config.head_dim > 1024:
        return f"head_dim {model.config.head_dim} is odd or > 1024"
    tensors = [p for p in model.parameters()] + [t for kv in kv_caches for t in kv]
    if not all(t.is_contiguous() for t in tensors):
        return "a weight or KV tensor is not contiguous"
    return None


class FusedDecoder:
    """Runs decode-only steps (one new token per sequence) of a Llama model in C."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int):
        reason = unsupported_reason(model, kv_caches)
        if reason:
            raise KernelUnavailable(reason)
        self._lib = load("decode")
        self.library_name = self._lib._name
        self._lib.ms_decode_step.restype = _I64
        self.last_team_size = 0   # OpenMP threads that ran the last step (the kernel reports it)
        self.max_batch = max_batch
        # The C side holds raw pointers: keep every bound tensor alive. Replacing a weight tensor
        # later (model.to(), quantizing in place) needs a new FusedDecoder.
        self._keep = [model, kv_caches, model.rotary.cos, model.rotary.sin_signed]
        cfg = model.config
        self._layers = (_LayerPtrs * cfg.num_layers)(*[_layer_ptrs(layer, kv) for layer, kv
                                                       in zip(model.layers, kv_caches)])
        self._model = _ModelPtrs(
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, model.lm_head.weight.shape[0], kv_caches[0][0].shape[1],
            cfg.rms_norm_eps, cfg.head_dim ** -0.5,
            _ptr(model.embed_tokens.weight), _ptr(model.norm.weight), _ptr(model.lm_head.weight),
            _ptr(model.rotary.cos), _ptr(model.rotary.sin_signed), self._layers)
        e, qkv = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        sizes = dict(h=e, x=e, qkv=qkv, attn=cfg.num_heads * cfg.head_dim,
                     gate_up=2 * cfg.intermediate_size, act=cfg.intermediate_size)
        self._buffers = {n: torch.empty(max_batch, size) for n, size in sizes.items()}
        self._scores = torch.empty(0)
        self._scratch = _Scratch(*[_ptr(self._buffers[n]) for n in sizes], _ptr(self._scores), 0)

    def supports(self, query_lens: list[int]) -> bool:
        return 0 < len(query_lens) <= self.max_batch and all(q == 1 for q in query_lens)

    def _ensure_scores(self, context: int) -> None:
        # Softmax scratch, one row per (sequence, head); it grows with the longest context seen,
        # not with the model's maximum length (which may be 128k tokens).
        if self._scratch.scores_stride >= context:
            return
        stride = max(context, 2 * self._scratch.scores_stride, 256)
        self._scores = torch.empty(self.max_batch * self._model.num_heads * stride)
        self._scratch.scores, self._scratch.scores_stride = _ptr(self._scores), stride

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                 logits_indices: torch.Tensor, num_threads: int = 0) -> torch.Tensor:
        """Tokens [B] at positions [B] with block tables [B, n] (int64) -> logits [rows, vocab].

        ``num_threads``: the OpenMP team size of the step's parallel regions (0: PyTorch's current
        thread count); the engine lowers it when other processes take cores (engine/threads.py).
        """
        # Named locals: the C call reads raw pointers, so every tensor must outlive it.
        ids, pos = input_ids.contiguous(), positions.contiguous()
        tables, rows = block_tables.contiguous(), logits_indices.contiguous()
        self._check(ids, pos, tables, rows)
        self._ensure_scores(int(pos.max()) + 1)
        logits = torch.empty(rows.shape[0], self._model.vocab)
        self.last_team_size = self._lib.ms_decode_step(
            ctypes.byref(self._model), ctypes.byref(self._scratch), _I64(ids.shape[0]),
            _ptr(ids, _i64p), _ptr(pos, _i64p), _ptr(tables, _i64p), _I64(tables.shape[1]),
            _ptr(rows, _i64p), _I64(rows.shape[0]), _ptr(logits), _I64(max(0, int(num_threads))))
        return logits

    def _check(self, ids, pos, tables, rows) -> None:
        # C trusts every index it is given; a bad one would read or write outside the buffers.
        if any(t.dtype != torch.int64 for t in (ids, pos, tables, rows)):
            raise ValueError("token ids, positions, block tables and logit rows must be int64")
        batch = ids.shape[0]
        if not 1 <= batch <= self.max_batch or pos.shape != (batch,) or tables.shape[0] != batch:
            raise ValueError(f"batch must be in [1, {self.max_batch}] with one position and one "
                             f"block table per token, got {batch}, {tuple(pos.shape)}, {tuple(tables.shape)}")
        limit = min(tables.shape[1] * self._model.block_size, self._keep[2].shape[0])
        if int(pos.min()) < 0 or int(pos.max()) >= limit:
            raise ValueError(f"positions must be in [0, {limit}), got {pos.tolist()}")
        blocks = self._keep[1][0][0].shape[0]
        if int(tables.min()) < 0 or int(tables.max()) >= blocks:
            raise ValueError(f"block ids must be in [0, {blocks})")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= batch):
            raise ValueError(f"logit rows must be in [0, {batch}), got {rows.tolist()}")


def _layer_ptrs(layer, kv: tuple[torch.Tensor, torch.Tensor]) -> _LayerPtrs:
    attn, mlp = layer.self_attn, layer.mlp
    return _LayerPtrs(_ptr(layer.input_layernorm.weight), _ptr(attn.qkv_proj.weight),
                      _ptr(attn.qkv_proj.bias), _ptr(attn.o_proj.weight),
                      _ptr(layer.post_attention_layernorm.weight), _ptr(mlp.gate_up_proj.weight),
                      _ptr(mlp.down_proj.weight), _ptr(kv[0]), _ptr(kv[1]))
