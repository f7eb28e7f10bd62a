"""Sizing the KV cache: bytes per token, the byte budget, the number of blocks, the tensors.

The one formula for what a token costs in the cache, :func:`kv_bytes_per_token` (2 for K and V x
layers x kv_heads x (head_dim x bytes per element + a scale's bytes)), lives here; the engine's
planner (:func:`plan_kv_cache`), the serving-budget planner (minserve/plan) and the labs'
capacity notes (minserve/lab/capacity.py) all count with it. The block pool that hands the blocks
out is engine/kv_cache.py.

What a layer's cache holds depends on ``kv_cache_dtype`` (vLLM's argument): ``"auto"`` stores K and V
in the model dtype, a pair ``(k, v)`` of ``[num_blocks, block_size, kv_heads, head_dim]`` tensors;
``"int8"`` stores them quantized on write, a 4-tuple ``(k_codes, v_codes, k_scales, v_scales)``:
int8 codes of that shape and float32 scales ``[num_blocks, block_size, kv_heads]``, one per token
slot and kv head, symmetric (``x = code * scale``, ``scale = max|x| / 127``; the layout and the
quantizer live in kernels/triton/reference.py, shared with the Triton and C kernels). A per-token
scale is set once when the token is written and never revisited. Blocks, tables, prefix caching
and preemption do not care which: a block is a block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minserve.config import KV_CACHE_DTYPES, EngineConfig
from minserve.engine.memory import DeviceMemory, check_kv_blocks_fit, device_kv_budget_bytes
from minserve.kernels.triton.reference import allocate_kv_int8
from minserve.models.registry import ModelConfig

log = logging.getLogger("minserve")


# One layer's cache: (k, v), or with kv_cache_dtype="int8" (k_codes, v_codes, k_scales, v_scales).
LayerKV = tuple[torch.Tensor, ...]

# An int8 KV entry carries one float32 scale per (token slot, kv head) beside its head_dim codes.
KV_SCALE_BYTES = 4


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                       scale_bytes: int = 0) -> int:
    """Bytes one token takes in the KV cache: 2 (K and V) x layers x kv_heads x (head_dim x
    dtype_bytes + scale_bytes). ``scale_bytes`` is 0 for a float cache; an int8 cache
    (``kv_cache_dtype="int8"``) stores 1-byte codes plus one float32 scale (4 bytes) per token and
    KV head, so SmolLM2-135M takes 2 x 30 x 3 x (64 + 4) = 12,240 bytes, not 2 x 30 x 3 x 64 x 1."""
    return int(2 * layers * kv_heads * (head_dim * dtype_bytes + scale_bytes))


def kv_cache_bytes_per_token(model: ModelConfig, kv_cache_dtype: str = "auto", dtype: str = "float32") -> int:
    """Bytes one token of ``model`` occupies in a cache of ``kv_cache_dtype`` (:func:`kv_bytes_per_token`
    of its shape): the engine's planner (:func:`plan_kv_cache`) and the serving-budget planner
    (minserve/plan) both size blocks with it.

    * ``"auto"`` (the model ``dtype``): 2 x layers x kv_heads x head_dim x bytes per element;
    * ``"int8"``: 2 x layers x kv_heads x (head_dim x 1 + 4): the codes and one float32 scale per
      head. Against fp32 that is 4 x head_dim / (head_dim + 4) times the tokens in the same memory:
      "4x, less the scales", 3.76x at head_dim 64, 3.2x at head_dim 16.
    """
    shape = (model.num_layers, model.num_kv_heads, model.head_dim)
    if kv_cache_dtype == "auto":
        return kv_bytes_per_token(*shape, getattr(torch, dtype).itemsize)
    if kv_cache_dtype == "int8":
        return kv_bytes_per_token(*shape, 1, KV_SCALE_BYTES)
    raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def kv_budget_within(memory_budget_bytes: int, resident_weight_bytes: int, weights: str = "the weights") -> int:
    """KV bytes a memory budget leaves beside the resident weights (the engine's ``memory_budget``
    and the planner, minserve/plan, both use this); ValueError naming ``memory_budget`` when
    nothing is left."""
    kv = memory_budget_bytes - resident_weight_bytes
    if kv <= 0:
        raise ValueError(f"memory_budget={memory_budget_bytes} bytes ({memory_budget_bytes / 2**20:.1f} MiB) does "
                         f"not hold {weights} ({resident_weight_bytes / 2**20:.1f} MiB resident), let alone a KV "
                         "cache; raise memory_budget or choose a smaller quantization")
    return kv


@dataclass
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    kv_cache_dtype: str = "auto"  # what allocate_kv_tensors lays out (see the module docstring)

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.max_tokens * self.bytes_per_token


def kv_budget_bytes(cfg: EngineConfig, memory: DeviceMemory | None = None) -> int:
    """Bytes for the KV pool (EngineConfig's precedence; ``num_kv_blocks`` is handled by the caller).

    On CPU: ``kv_cache_memory`` (1 GiB by default). On CUDA: :func:`device_kv_budget_bytes` of the
    engine's measurement ``memory`` (taken after the weights are placed and the largest step has run;
    see engine/memory.py). Planning for CUDA without one (outside an engine) counts no weights and
    no activations, only what is free now. An explicit ``kv_cache_memory`` is absolute on every
    device, so workshop participants sharing one GPU each take a fixed amount instead of a share of
    whatever the others left free."""
    if memory is None:
        if not str(cfg.device).startswith("cuda"):
            return cfg.kv_cache_memory_bytes
        free, total = torch.cuda.mem_get_info(torch.device(cfg.device))
        memory = DeviceMemory(free, total, free, 0, 0)
    return device_kv_budget_bytes(cfg, memory)


def plan_kv_cache(model: ModelConfig, cfg: EngineConfig, memory: DeviceMemory | None = None) -> KVCacheSpec:
    """Decide the number of blocks from ``num_kv_blocks`` or a byte budget (``kv_budget_bytes``).
    Whole blocks only: ``budget // (bytes_per_token * block_size)``, with ``bytes_per_token`` from
    :func:`kv_cache_bytes_per_token`; minserve.plan uses the same.
    ``memory``: the engine's device measurement on CUDA (None on CPU)."""
    per_token = kv_cache_bytes_per_token(model, cfg.kv_cache_dtype, cfg.dtype)
    if memory is not None:
        log.info("device memory: %.2f GiB free at start of %.2f GiB; weights %.2f GiB, engine %.2f GiB in all, "
                 "largest step (%d tokens) peaks %.2f GiB above the weights; %.2f GiB free now",
                 *(b / 2**30 for b in (memory.free_at_start_bytes, memory.total_bytes, memory.weights_bytes,
                                       memory.engine_bytes)), cfg.max_num_batched_tokens,
                 memory.activation_peak_bytes / 2**30, memory.free_bytes / 2**30)
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
        if memory is not None:
            check_kv_blocks_fit(cfg, memory, blocks * cfg.block_size * per_token)
    else:
        blocks = kv_budget_bytes(cfg, memory) // (per_token * cfg.block_size)
    if blocks < 1:
        raise ValueError(f"the KV cache budget holds no block of {cfg.block_size} tokens "
                         f"({per_token} bytes per token); raise kv_cache_memory or num_kv_blocks")
    spec = KVCacheSpec(blocks, cfg.block_size, per_token, cfg.kv_cache_dtype)
    entry = (f"{model.head_dim} x {getattr(torch, cfg.dtype).itemsize} bytes" if cfg.kv_cache_dtype == "auto"
             else f"{model.head_dim} int8 codes + a {KV_SCALE_BYTES}-byte scale")
    log.info("KV cache (kv_cache_dtype=%s): %d bytes per token (2 x %d layers x %d kv heads x (%s)), "
             "%d blocks of %d tokens = %d tokens, %.1f MiB", cfg.kv_cache_dtype, per_token, model.num_layers,
             model.num_kv_heads, entry, blocks, cfg.block_size, spec.max_tokens, spec.total_bytes / 2**20)
    return spec


def allocate_layer_kv(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: str | torch.device, kv_cache_dtype: str = "auto") -> LayerKV:
    """One layer's cache, zeroed: ``(k, v)`` in ``dtype``, or the int8 4-tuple (module docstring)."""
    if kv_cache_dtype == "int8":
        (k, k_scales), (v, v_scales) = (allocate_kv_int8(num_blocks, block_size, model.num_kv_heads,
                                                         model.head_dim, device) for _ in range(2))
        return k, v, k_scales, v_scales
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return zeros_on_demand(shape, dtype, device), zeros_on_demand(shape, dtype, device)


# Below this size torch.zeros is as cheap as anything; above it, writing the zeros costs real time.
_ON_DEMAND_MIN_BYTES = 1 << 20
_ALIGN = 64   # one cache line: what torch's own CPU allocator gives, and what AVX-512 loads like


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed tensor whose CPU pages the OS zeroes on first touch instead of now.

    ``torch.zeros`` writes every byte at allocation: 2 s for the CPU default's 1 GiB cache, paid by
    every engine start (and a notebook's first cell) even when a run touches a few blocks. A large
    ``calloc`` (numpy's zeros) maps pages the kernel hands out already zeroed, as they are first
    written, so the cost moves to the blocks actually used. The cache must be zeros, not garbage:
    attention reads whole blocks and masks the unused slots, and a NaN left in one would survive
    the mask (0 x NaN). Other devices, and small tensors, take ``torch.zeros``."""
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    if torch.device(device).type != "cpu" or nbytes < _ON_DEMAND_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return torch.from_numpy(raw[skip:skip + nbytes]).view(dtype).view(shape)


def allocate_kv_tensors(model: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype,
                        device: str) -> list[LayerKV]:
    """Every layer's cache for ``spec`` (``dtype``: the model's, used when kv_cache_dtype is auto)."""
    return [allocate_layer_kv(model, spec.num_blocks, spec.block_size, dtype, device, spec.kv_cache_dtype)
            for _ in range(model.num_layers)]


