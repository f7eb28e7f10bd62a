"""minserve/models/gemm.py: the dense product behind every Linear on a CPU.

float32 goes to oneDNN or MKL (the same product summed in another order); bfloat16 on a CPU without
bf16 dot products goes through float32 tiles of the weight, and on a CPU with AMX products of 16-384
rows go to its tiles (kernels/bf16_gemm.c). Each route is checked against float64
arithmetic, with the rounding each format allows, and the routing itself (which rows go where).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minserve.kernels import bf16_gemm
from minserve.models import gemm


def _inputs(rows: int, in_features: int, out: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    w = torch.randn(out, in_features, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype)
    return x, w, b


def _exact(x, w, b):
    """float64 product of the given (already rounded) values, and sum(|x| |w|) per output."""
    ref = x.double() @ w.double().T + b.double()
    return ref, x.double().abs() @ w.double().abs().T


@pytest.fixture
def emulated_bf16(monkeypatch):
    """This CPU treated as one without bf16 dot products (an AVX2-only host)."""
    monkeypatch.setattr(gemm, "native_bf16", lambda: False)


@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_float32_is_the_float64_product_up_to_float32_rounding(backend, monkeypatch):
    monkeypatch.setattr(gemm, "backend", lambda: backend)
    x, w, b = _inputs(33, 96, 70, torch.float32)
    y = gemm.linear(x, w, b)
    ref, mags = _exact(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (33, 70)
    # 96 terms: a float32 sum errs by at most ~96 * 2^-24 of the magnitudes, whatever the order
    assert ((y.double() - ref).abs() <= 96 * 2.0 ** -24 * mags + 1e-6).all()


def test_bf16_through_float32_tiles_rounds_the_exact_product_once(emulated_bf16, monkeypatch):
    in_features = 64
    # 16 weight rows per tile, 50 rows: three whole tiles and a last one of 2
    monkeypatch.setattr(gemm, "WIDEN_TILE_BYTES", 16 * 4 * in_features)
    x, w, b = _inputs(gemm.WIDEN_MIN_ROWS + 5, in_features, 50, torch.bfloat16)
    y = gemm.linear(x, w, b)
    ref, mags = _exact(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], 50)
    # one rounding to bf16 (half an ulp: 2^-8 relative, 7 stored mantissa bits) after float32 sums
    err = (y.double() - ref).abs()
    assert (err <= 2.0 ** -8 * ref.abs() + 64 * 2.0 ** -24 * mags + 1e-30).all()
    # and it is the bf16 GEMM's arithmetic: PyTorch's own bf16 product agrees to one bf16 ulp
    assert (err <= 2.0 ** -7 * ref.abs() + (F.linear(x, w, b).double() - ref).abs() + 1e-6).all()


def test_bf16_below_the_widening_rows_is_pytorchs_own_product(emulated_bf16):
    x, w, b = _inputs(gemm.WIDEN_MIN_ROWS - 1, 64, 40, torch.bfloat16)
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


def test_bf16_with_native_dot_products_is_pytorchs_own_product(monkeypatch):
    """Where the AMX kernel does not take the shape (40 outputs: not a multiple of 32)."""
    monkeypatch.setattr(gemm, "native_bf16", lambda: True)
    x, w, b = _inputs(gemm.WIDEN_MIN_ROWS + 8, 64, 40, torch.bfloat16)
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


needs_tiles = pytest.mark.skipif(not (bf16_gemm.available() and gemm.native_bf16()),
                                 reason="no AMX tiles on this CPU (or MINSERVE_AMX=off)")


@needs_tiles
@pytest.mark.parametrize("rows,in_features,out", [(16, 64, 32), (17, 96, 64), (33, 64, 96),
                                                  (bf16_gemm.MAX_ROWS, 128, 64),
                                                  (bf16_gemm.MAX_ROWS - 31, 4096, 512)])
def test_bf16_on_amx_tiles_rounds_the_float32_sum_once(rows, in_features, out, monkeypatch):
    """Token tails (17, 33: a block half padding), several weight blocks, the bias, and inputs wide
    enough for several chunks of tokens and three panels of weights, the last one short: each output
    is the float64 product rounded once to bf16, up to float32 summation error."""
    calls = []
    inner = bf16_gemm.linear
    monkeypatch.setattr(bf16_gemm, "linear", lambda *a: calls.append(a[0].shape) or inner(*a))
    x, w, b = _inputs(rows, in_features, out, torch.bfloat16, seed=rows)
    y = gemm.linear(x, w, b)
    assert calls == [(rows, in_features)] and y.dtype == torch.bfloat16 and y.shape == (rows, out)
    ref, mags = _exact(x, w, b.float().to(torch.bfloat16))
    err = (y.double() - ref).abs()
    assert (err <= 2.0 ** -8 * ref.abs() + in_features * 2.0 ** -24 * mags + 1e-30).all()


@needs_tiles
@pytest.mark.parametrize("rows", [bf16_gemm.MIN_ROWS - 1, bf16_gemm.MAX_ROWS + 1])
def test_bf16_outside_the_tiles_rows_is_pytorchs_own_product(rows):
    x, w, b = _inputs(rows, 64, 64, torch.bfloat16)
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


@needs_tiles
def test_mismatched_sizes_are_left_to_pytorch_s_error():
    x, w, _ = _inputs(32, 64, 64, torch.bfloat16)
    assert bf16_gemm.linear(x, w[:, :32].contiguous()) is None
    with pytest.raises(RuntimeError):
        gemm.linear(x, w[:, :32].contiguous())


@needs_tiles
def test_minserve_gemm_torch_keeps_bf16_off_the_tiles(monkeypatch):
    monkeypatch.setenv("MINSERVE_GEMM", "torch")
    gemm._requested.cache_clear()
    try:
        x, w, b = _inputs(32, 64, 64, torch.bfloat16)
        assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
    finally:
        gemm._requested.cache_clear()


def test_native_bf16_needs_the_cpus_bf16_instructions(monkeypatch):
    gemm.native_bf16.cache_clear()
    try:
        monkeypatch.setattr(gemm, "cpu_flags", lambda: {"avx2", "fma"})
        assert gemm.native_bf16() is False
        gemm.native_bf16.cache_clear()
        monkeypatch.setattr(gemm, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
        assert gemm.native_bf16() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    finally:
        gemm.native_bf16.cache_clear()
