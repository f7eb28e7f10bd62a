"""W8A16 matmul: ``x @ W.T`` with W stored as int8 codes and one float32 scale per output channel.

Why fuse the dequantization: a decode step multiplies a handful of activation rows by every weight,
so it is bound by how fast the weights stream out of memory, not by arithmetic. Dequantizing W to
fp16 first would write and re-read 2 bytes per weight (a round trip through memory that costs more
than the int8 read it was meant to save); here each int8 tile is loaded once, widened to the
activation dtype in registers (exact: |code| <= 127), multiplied on the tensor cores with float32
accumulation, and the per-channel scale is applied once per output element in the epilogue, since
``sum_k x[m, k] * code[n, k] * s[n] = s[n] * sum_k x[m, k] * code[n, k]``.

The torch reference (:func:`w8a16_matmul_reference`) sits in ``reference.py`` beside this file.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOATS, check_devices, check_inner_contiguous, check_tensor, launch
from .reference import dequantize_w8, quantize_w8, w8a16_matmul_reference

__all__ = ["w8a16_matmul", "w8a16_matmul_reference", "quantize_w8", "dequantize_w8", "w8a16_blocks"]


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
                  stride_xm, stride_xk, stride_wn, stride_om,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Program (m, n) computes one [BLOCK_M, BLOCK_N] output tile. m varies fastest, so the few
    # programs that share a weight tile run side by side and re-read it from L2, not DRAM.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of W.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        codes = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(x, codes.to(x.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a16_blocks(m: int, n: int, k: int) -> dict:
    """Tile sizes by batch: small M is a weight-streaming GEMV, so use narrow N tiles (more programs
    to keep every SM loading) and long K tiles (more bytes in flight per program); larger M reuses
    each weight tile across more rows, so square-ish tiles. tl.dot needs every dim >= 16."""
    if m <= 16:
        return dict(block_m=16, block_n=32 if n >= 8192 else 16, block_k=256 if k >= 256 else 64,
                    num_warps=4, num_stages=4)
    if m <= 64:
        return dict(block_m=max(16, min(64, 1 << (m - 1).bit_length())), block_n=64, block_k=128,
                    num_warps=4, num_stages=4)
    return dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)


def w8a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, *, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """``x`` [M, K] (fp16/bf16/fp32) @ (``codes`` int8 [N, K] * ``scales`` float32 [N]).T + ``bias`` [N]
    -> [M, N] in ``x.dtype``, float32 accumulation. Block sizes default to :func:`w8a16_blocks`;
    any M, N and K work (partial tiles are masked)."""
    check_tensor("x", x, dtypes=FLOATS, ndim=2)
    m, k = x.shape
    check_tensor("codes", codes, dtypes=(torch.int8,), ndim=2)
    n = codes.shape[0]
    if codes.shape[1] != k:
        raise ValueError(f"codes must have shape (N, K) with K={k} from x; got {tuple(codes.shape)}")
    check_tensor("scales", scales, dtypes=(torch.float32,), shape=(n,))
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOATS, shape=(n,))
    if m == 0 or n == 0 or k == 0:
        raise ValueError(f"x and codes must be non-empty; got M={m}, N={n}, K={k}")
    check_inner_contiguous("codes", codes)
    kernel = _w8a16_kernel
    device = check_devices(kernel, x=x, codes=codes, scales=scales, bias=bias)
    cfg = w8a16_blocks(m, n, k)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value is not None:
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16; got {value}")
            cfg[name] = value
    scales = scales.contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]))
    launch(kernel, grid, x, codes, scales, bias if bias is not None else scales, out, m, n, k,
           x.stride(0), x.stride(1), codes.stride(0), out.stride(0),
           HAS_BIAS=bias is not None, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
           BLOCK_K=cfg["block_k"], DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
