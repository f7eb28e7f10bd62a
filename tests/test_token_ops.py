"""kernels/token_ops.py: SwiGLU and RoPE in C against their float64 formulas and PyTorch's."""

import pytest
import torch
import torch.nn.functional as F

from minserve.kernels import token_ops as to
from minserve.models.layers import apply_rope, silu_mul

pytestmark = pytest.mark.skipif(to._library() is None, reason="no C compiler: the kernels fall back")


def _tables(positions: torch.Tensor, D: int, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = positions[:, None].double() * inv[None]
    cos = torch.cat((f, f), -1).cos()
    sin = torch.cat((-f.sin(), f.sin()), -1)
    return cos[:, None].to(dtype), sin[:, None].to(dtype)


@pytest.mark.parametrize("inter", [1536, 72, 37])   # vector body, and tails of 8 and 5
def test_silu_mul_matches_the_formula_in_float32(inter):
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(40, 2 * inter, generator=g) * 4
    out = to.silu_mul(gu, inter)
    gate, up = gu.double().split(inter, dim=-1)
    expected = gate / (1 + torch.exp(-gate)) * up
    # exp's polynomial is good to ~1e-6 relative; a few float32 roundings on top.
    torch.testing.assert_close(out.double(), expected, rtol=4e-6, atol=1e-6)


def test_silu_mul_in_bfloat16_rounds_the_float32_result_once():
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(32, 2 * 96, generator=g) * 3).to(torch.bfloat16)
    out = to.silu_mul(gu, 96)
    assert out.dtype == torch.bfloat16
    gate, up = gu.float().split(96, dim=-1)
    expected = (F.silu(gate) * up).to(torch.bfloat16)
    # One rounding each, of float32 values ~1e-6 apart: at most one bf16 step (2^-8 relative).
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("D", [64, 128, 10])        # vectorized halves, and the scalar loop
def test_rope_rotates_in_place_as_the_pytorch_formula(D):
    g = torch.Generator().manual_seed(3)
    T, heads = 24, 5
    qkv = torch.randn(T, heads * D + 7, generator=g)   # a column slice with a longer row stride
    x = qkv[:, :heads * D].view(T, heads, D)
    cos, sin = _tables(torch.randint(0, 4096, (T,), generator=g), D, torch.float32)
    expected = x * cos + torch.roll(x, D // 2, dims=-1) * sin
    tail = qkv[:, heads * D:].clone()
    out = to.rope_(x, cos, sin)
    assert out is x                                      # in place, in qkv's own storage
    torch.testing.assert_close(qkv[:, :heads * D].view(T, heads, D), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * D:], tail)         # columns past the heads untouched


def test_rope_in_bfloat16_is_within_one_rounding():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 3, 64, generator=g).to(torch.bfloat16)
    cos, sin = _tables(torch.arange(20), 64, torch.bfloat16)
    expected = (x.float() * cos.float() + torch.roll(x.float(), 32, dims=-1) * sin.float()).to(torch.bfloat16)
    out = to.rope_(x.clone(), cos, sin)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("case", ["no_rows", "float16", "strided_columns", "table_dtype", "switch"])
def test_what_the_kernels_do_not_take_returns_none(case, monkeypatch):
    T = 0 if case == "no_rows" else 32
    dtype = torch.float16 if case == "float16" else torch.float32
    x = torch.randn(T, 2, 64).to(dtype)
    if case == "strided_columns":
        x = torch.randn(T, 2, 128)[..., ::2]
    cos, sin = _tables(torch.arange(T), 64, torch.bfloat16 if case == "table_dtype" else dtype)
    if case == "switch":
        monkeypatch.setenv("MINSERVE_TOKEN_OPS", "torch")
    before = x.clone()
    assert to.rope_(x, cos, sin) is None
    assert torch.equal(x, before)
    if case != "table_dtype":
        assert to.silu_mul(x.reshape(T, 128) if case != "strided_columns" else x[:, 0], 64) is None


@pytest.mark.parametrize("rows", [1, 5, 15])
def test_a_few_rows_take_the_kernels_too(rows):
    """One formula at every size: below 16 rows PyTorch's took over until 2026-12-07, so a short
    prompt alone and the same prompt beside another were rounded differently."""
    if to._library() is None or to.choice() != "c":
        pytest.skip("no C kernels here")
    x = torch.randn(rows, 2, 64)
    cos, sin = _tables(torch.arange(rows), 64, torch.float32)
    assert to.rope_(x.clone(), cos, sin) is not None
    assert to.silu_mul(torch.randn(rows, 128), 64) is not None


def test_an_unknown_switch_value_names_the_choices(monkeypatch):
    monkeypatch.setenv("MINSERVE_TOKEN_OPS", "fast")
    with pytest.raises(ValueError, match="MINSERVE_TOKEN_OPS must be one of c, torch"):
        to.choice()


def test_the_model_helpers_agree_with_or_without_the_kernels(monkeypatch):
    """layers.apply_rope / silu_mul give the same values on both paths (the switch picks one)."""
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(64, 2 * 48, generator=g)
    x = torch.randn(64, 4, 64, generator=g)
    cos, sin = _tables(torch.arange(64), 64, torch.float32)
    with_c = silu_mul(gu, 48), apply_rope(x.clone(), cos, sin)
    monkeypatch.setenv("MINSERVE_TOKEN_OPS", "torch")
    without = silu_mul(gu, 48), apply_rope(x.clone(), cos, sin)
    for a, b in zip(with_c, without):
        torch.testing.assert_close(a, b, rtol=4e-6, atol=1e-6)


def test_bfloat16_rms_norm_rounds_as_the_pytorch_formula():
    from minserve.models.layers import RMSNorm
    g = torch.Generator().manual_seed(6)
    norm = RMSNorm(72, 1e-5, dtype=torch.bfloat16)
    norm.weight.data.copy_((torch.rand(72, generator=g) + 0.5).to(torch.bfloat16))
    x = (torch.randn(40, 72, generator=g) * 3).to(torch.bfloat16)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    expected = norm.weight * h.to(torch.bfloat16)
    out = norm.forward(x)
    # The mean of squares summed in another order: a value on a rounding boundary may land one
    # bf16 step away, after either rounding.
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-6)
    assert (out != expected).float().mean() < 0.02
