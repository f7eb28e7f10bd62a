"""Plain-PyTorch references for the Triton kernels, and the quantized layouts they read.

This module imports only torch, so the engine (and a CPU without Triton) can reuse the layouts:
quantize a weight or a KV entry here, run the Triton kernel on a GPU, and check one against the
other. Every reference computes in float32 and casts once at the end: it is the "true" answer the
kernels are measured against, not a model of their rounding.

Layouts
-------
W8 (per output channel, symmetric): ``codes`` int8 [N, K], ``scales`` float32 [N];
``w[n, k] = codes[n, k] * scales[n]``.

W4 (GGUF Q4_1's form: per group of ``g`` input columns, asymmetric): ``packed`` uint8 [N, K/2] with
column 2i in the low nibble and 2i+1 in the high nibble of byte i; ``scales`` and ``mins`` float32
[N, K/g]; ``w[n, k] = q[n, k] * scales[n, k // g] + mins[n, k // g]`` with ``q`` in 0..15.

Int8 KV cache: ``codes`` int8 [num_blocks, block_size, num_kv_heads, head_dim] plus ``scales``
float32 [num_blocks, block_size, num_kv_heads], one per (token slot, kv head), symmetric:
``k = code * scale`` with ``scale = max|k| / 127`` taken when the token is written. A per-token scale
lets each token be quantized once, on write, and never touched again (a per-block scale would have
to be re-derived as the block fills).
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------- weights


def quantize_w8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes int8 [N, K], scales float32 [N]); symmetric per output channel."""
    w = w.float()
    scales = w.abs().amax(dim=1) / 127.0
    codes = torch.round(w / scales.clamp_min(1e-12)[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_w8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integer codes in 0..15 -> uint8 [N, K/2]: column 2i low nibble, 2i+1 high nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K] in 0..15 (inverse of :func:`pack_int4`)."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def quantize_w4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed uint8 [N, K/2], scales [N, K/g], mins [N, K/g]); GGUF Q4_1's form:
    each group of ``g`` columns maps [min, max] onto 0..15."""
    n, k = w.shape
    if k % group_size or k % 2:
        raise ValueError(f"w: K={k} must be a multiple of group_size={group_size} (and even)")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    scales = (hi - lo) / 15.0
    q = torch.round((groups - lo[..., None]) / scales.clamp_min(1e-12)[..., None]).clamp_(0, 15)
    return pack_int4(q.reshape(n, k)), scales, lo


def dequantize_w4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    q = unpack_int4(packed).float()
    n, k = q.shape
    w = q.reshape(n, k // group_size, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(n, k)


def w8a16_matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (codes * scales[:, None]).T + bias`` in float32, returned in ``x.dtype``."""
    out = x.float() @ dequantize_w8(codes, scales).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def w4a16_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor, group_size: int,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize_w4(...).T + bias`` in float32, returned in ``x.dtype``."""
    out = x.float() @ dequantize_w4(packed, scales, mins, group_size).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------- int8 KV cache


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float -> (codes int8 [..., head_dim], scales float32 [...]).

    Symmetric, one scale per vector (a token's key or value for one kv head): scale = max|x|/127.
    An all-zero vector gets scale 0 and codes 0, which dequantize back to zeros."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / 127.0
    codes = torch.round(x / scales.clamp_min(1e-30)[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_kv_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[..., None]


def write_kv_int8(cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor,
                  x: torch.Tensor) -> None:
    """Quantize-on-write: store new tokens ``x`` [T, Hkv, D] into flat ``slot_mapping`` [T] slots of
    an int8 ``cache`` [num_blocks, block_size, Hkv, D] and its ``scales`` [num_blocks, block_size, Hkv],
    the way the torch backend ``index_copy_``s float K/V (minserve/attention/torch_paged.py)."""
    codes, s = quantize_kv_int8(x)
    hkv, d = cache.shape[2], cache.shape[3]
    cache.view(-1, hkv, d).index_copy_(0, slot_mapping, codes)
    scales.view(-1, hkv).index_copy_(0, slot_mapping, s)


def allocate_kv_int8(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's int8 cache (K or V): codes and their per-(slot, head) scales."""
    codes = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8, device=device)
    scales = torch.zeros(num_blocks, block_size, num_kv_heads, dtype=torch.float32, device=device)
    return codes, scales


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One decode query per sequence over the paged cache; returns [B, H, D] in ``q.dtype``.

    q [B, H, D]; caches [num_blocks, block_size, Hkv, D] (float, or int8 with ``k_scale``/``v_scale``
    [num_blocks, block_size, Hkv]); block_tables [B, max_blocks]; sequence b sees keys
    0..context_lens[b]-1, stored at slot ``p % block_size`` of block ``block_tables[b, p // block_size]``.
    Grouped-query attention: query head h reads kv head ``h // (H // Hkv)``; scale = D ** -0.5."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    keys, values = k_cache[block_tables].flatten(1, 2), v_cache[block_tables].flatten(1, 2)  # [B, L, Hkv, D]
    if k_scale is not None:
        keys = dequantize_kv_int8(keys, k_scale[block_tables].flatten(1, 2))
    if v_scale is not None:
        values = dequantize_kv_int8(values, v_scale[block_tables].flatten(1, 2))
    length = keys.shape[1]
    qg = q.float().reshape(b, hkv, h // hkv, d)  # query heads grouped under their kv head
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys.float()) * d ** -0.5
    visible = torch.arange(length, device=q.device)[None, :] < context_lens.to(q.device)[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a sequence with no keys reads zeros
    out = torch.einsum("bkgl,blkd->bkgd", probs, values.float())
    return out.reshape(b, h, d).to(q.dtype)
