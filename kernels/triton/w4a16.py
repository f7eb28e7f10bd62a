"""W4A16 matmul: ``x @ W.T`` with W packed two 4-bit codes per byte, scale and min per group (Q4_1).

Same reason to fuse as the W8 kernel (see w8a16.py), and more so: at 4 bits a weight costs a quarter
of its fp16 bytes, and a decode step is bound by those bytes. Dequantizing to fp16 in memory first
would move 4.5 bytes per weight instead of ~0.56. Here each tile is read once as packed bytes and
unpacked, scaled and offset in registers.

Layout (reference.py): ``packed`` uint8 [N, K/2], column 2i in the low nibble and 2i+1 in the high
nibble; ``scales``/``mins`` float32 [N, K/g] for groups of ``g`` input columns;
``w = q * scale + min``. A K tile spans whole groups (or lies inside one), so the group parameters
are loaded once per tile per row and broadcast over its columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOATS, check_devices, check_inner_contiguous, check_tensor, launch
from .reference import dequantize_w4, pack_int4, quantize_w4, unpack_int4, w4a16_matmul_reference

__all__ = ["w4a16_matmul", "w4a16_matmul_reference", "quantize_w4", "dequantize_w4", "pack_int4",
           "unpack_int4", "w4a16_blocks", "GROUP_SIZES"]

GROUP_SIZES = (32, 64, 128)


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K,
                  stride_xm, stride_xk, stride_wn, stride_sn, stride_om,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)  # packed bytes of one K tile
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :]  # [BLOCK_N, BLOCK_K // 2]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # K is a multiple of GROUP, so a partial last tile ends on a group (and byte) boundary.
        x = tl.load(x_ptrs, mask=m_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        packed = tl.load(w_ptrs, mask=n_ok[:, None] & (offs_b < (K - k0) // 2)[None, :], other=0)
        # join -> [BLOCK_N, BLOCK_K // 2, 2], row-major reshape interleaves lo, hi, lo, hi, ...
        q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
        if BLOCK_K <= GROUP:  # the whole tile lies in one group: one scale/min per row
            g_ptrs = offs_n * stride_sn + k0 // GROUP
            scale = tl.load(s_ptr + g_ptrs, mask=n_ok, other=0.0)[:, None]
            low = tl.load(z_ptr + g_ptrs, mask=n_ok, other=0.0)[:, None]
        else:  # BLOCK_K // GROUP groups: load each once, broadcast over its GROUP columns
            offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            g_ptrs = offs_n[:, None] * stride_sn + offs_g[None, :]
            g_ok = n_ok[:, None] & (offs_g < K // GROUP)[None, :]
            scale = tl.load(s_ptr + g_ptrs, mask=g_ok, other=0.0)
            low = tl.load(z_ptr + g_ptrs, mask=g_ok, other=0.0)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)),
                               (BLOCK_N, BLOCK_K))
            low = tl.reshape(tl.broadcast_to(low[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)),
                             (BLOCK_N, BLOCK_K))
        w = (q * scale + low).to(x.dtype)  # [BLOCK_N, BLOCK_K], never leaves registers
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K // 2
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w4a16_blocks(m: int, n: int, k: int, group_size: int) -> dict:
    """Like :func:`~.w8a16.w8a16_blocks`; a K tile is a power of two, so it either spans whole
    groups or lies inside one (group sizes are powers of two too)."""
    if m <= 16:
        return dict(block_m=16, block_n=32 if n >= 8192 else 16, block_k=max(group_size, 128 if k >= 128 else 32),
                    num_warps=4, num_stages=4)
    if m <= 64:
        return dict(block_m=max(16, min(64, 1 << (m - 1).bit_length())), block_n=64,
                    block_k=max(group_size, 64), num_warps=4, num_stages=3)
    return dict(block_m=64, block_n=64, block_k=max(group_size, 64), num_warps=4, num_stages=3)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """``x`` [M, K] (fp16/bf16/fp32) @ W.T + ``bias`` -> [M, N] in ``x.dtype``, with W given as
    ``packed`` uint8 [N, K/2], ``scales`` and ``mins`` float32 [N, K/group_size]. K must be a
    multiple of ``group_size`` (32, 64 or 128); M and N are free (partial tiles are masked)."""
    check_tensor("x", x, dtypes=FLOATS, ndim=2)
    m, k = x.shape
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}; got {group_size}")
    if k % group_size:
        raise ValueError(f"x: K={k} must be a multiple of group_size={group_size}")
    check_tensor("packed", packed, dtypes=(torch.uint8,), ndim=2)
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"packed must have shape (N, K/2) = (N, {k // 2}) for K={k} from x; "
                         f"got {tuple(packed.shape)}")
    check_tensor("scales", scales, dtypes=(torch.float32,), shape=(n, k // group_size))
    check_tensor("mins", mins, dtypes=(torch.float32,), shape=(n, k // group_size))
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOATS, shape=(n,))
    if m == 0 or n == 0 or k == 0:
        raise ValueError(f"x and packed must be non-empty; got M={m}, N={n}, K={k}")
    check_inner_contiguous("packed", packed)
    kernel = _w4a16_kernel
    device = check_devices(kernel, x=x, packed=packed, scales=scales, mins=mins, bias=bias)
    cfg = w4a16_blocks(m, n, k, group_size)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value is not None:
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16; got {value}")
            cfg[name] = value
    scales, mins = scales.contiguous(), mins.contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]))
    launch(kernel, grid, x, packed, scales, mins, bias if bias is not None else scales, out, m, n, k,
           x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), out.stride(0),
           GROUP=group_size, HAS_BIAS=bias is not None, BLOCK_M=cfg["block_m"],
           BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
           DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
