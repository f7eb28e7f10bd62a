"""The int8 / int4 weight formats (minserve/quant/formats.py): layouts, round trips, clear errors.

These layouts are the contract the C, Triton and fused-decode kernels read, so the tests pin the
details a kernel depends on: which nibble holds which column, what a zero row or a flat group
becomes, and that weights born from GGUF Q4_1 blocks come back bit for bit with int4 g32.
"""

import pytest
import torch

from minserve.quant.formats import (check_group_size, dequantize_int4, dequantize_int8, pack_int4,
                                    quantize_int4, quantize_int8, reproduction, unpack_int4)


def _weights(out=33, inn=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inn, generator=g) * 0.05


def _q4_1_matrix(out=24, inn=128, seed=1):
    """What a Q4_1 GGUF dequantizes to: per 32 weights, q * d + m with d and m fp16 values, every
    block using codes 0 and 15 (llama.cpp sets d = (max - min) / 15 and m = min from the block)."""
    g = torch.Generator().manual_seed(seed)
    blocks = out * inn // 32
    q = torch.randint(0, 16, (blocks, 32), generator=g)
    q[:, 3], q[:, 17] = 0, 15
    d = (torch.rand(blocks, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(blocks, 1, generator=g) * 0.1).half().float()
    w = (q.float() * d + m).reshape(out, inn)   # float32 arithmetic, as gguf-py's dequantize does
    return w, q.reshape(out, inn), d.reshape(out, inn // 32), m.reshape(out, inn // 32)


def test_int8_layout_and_round_trip_error():
    w = _weights()
    w[5] = 0.0                                  # a zero row: nonzero scale, zero codes
    codes, scales = quantize_int8(w)
    assert codes.dtype == torch.int8 and codes.shape == w.shape and codes.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (w.shape[0],)
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    assert float(scales[5]) > 0 and not codes[5].any()
    w_hat = dequantize_int8(codes, scales)
    assert torch.allclose(w_hat, codes.float() * scales[:, None])
    # round to nearest: every weight within half a step of its row's grid
    assert ((w_hat - w).abs() <= scales[:, None] / 2 * (1 + 1e-5)).all()
    assert torch.equal(scales[torch.arange(33) != 5], w.abs().amax(1)[torch.arange(33) != 5] / 127)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_layout_and_round_trip_error(group_size):
    w = _weights(out=7, inn=256, seed=group_size)
    w[2, :group_size] = 0.25                    # a flat group: stored exactly (q = 0, w = min)
    packed, scales, mins = quantize_int4(w, group_size)
    groups = 256 // group_size
    assert packed.dtype == torch.uint8 and packed.shape == (7, 128) and packed.is_contiguous()
    assert scales.shape == mins.shape == (7, groups) and scales.dtype == mins.dtype == torch.float32
    wg = w.reshape(7, groups, group_size)
    assert torch.equal(mins, wg.amin(2))
    w_hat = dequantize_int4(packed, scales, mins, group_size)
    assert torch.equal(w_hat[2, :group_size], w[2, :group_size])
    err = (w_hat - w).reshape(7, groups, group_size).abs()
    assert (err <= scales[..., None] / 2 * (1 + 1e-5) + 1e-7).all()
    # each non-flat group hits both ends of its range
    q = unpack_int4(packed).reshape(7, groups, group_size)
    assert (q.amin(2) == 0).all() and (q.amax(2)[wg.amax(2) > wg.amin(2)] == 15).all()


def test_nibble_order_column_2i_low_2i_plus_1_high():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]])
    packed = pack_int4(q)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    # through the quantizer: a ramp over one group lands as codes 0..15 in column order
    w = torch.arange(32, dtype=torch.float32).div(2).floor().reshape(1, 32)   # 0,0,1,1,...,15,15
    w = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)                            # 0..15, 0..15
    packed, scales, mins = quantize_int4(w, 32)
    assert float(scales[0, 0]) == 1.0 and float(mins[0, 0]) == 0.0
    assert packed[0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


def test_q4_1_weights_come_back_bit_exact_with_g32():
    w, q, d, m = _q4_1_matrix()
    packed, scales, mins = quantize_int4(w, 32)
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    assert torch.equal(scales, d) and torch.equal(mins, m)
    assert torch.equal(dequantize_int4(packed, scales, mins, 32), w)
    r = reproduction(w, "int4", 32)
    assert r.format == "int4 g32" and r.exact_fraction == 1.0 and r.relative_error == 0.0


def test_reproduction_measures_other_formats():
    w, *_ = _q4_1_matrix()
    int8 = reproduction(w, "int8")
    g64 = reproduction(w, "int4", 64)
    assert int8.format == "int8" and g64.format == "int4 g64"
    assert 0 <= int8.exact_fraction < 0.5 and 0 < int8.relative_error < 0.05
    assert g64.exact_fraction < 1.0 and g64.relative_error > int8.relative_error
    assert int8.max_abs_error > 0
    zero = reproduction(torch.zeros(4, 64), "int4", 32)
    assert zero.exact_fraction == 1.0 and zero.relative_error == 0.0
    with pytest.raises(ValueError, match="format must be 'int8' or 'int4'"):
        reproduction(w, "fp8")


def test_clear_errors():
    with pytest.raises(ValueError, match=r"group_size 128 does not divide in_features 576 "
                                         r".*\[1536 x 576\].*\[32, 64\]"):
        quantize_int4(torch.randn(1536, 576, generator=torch.Generator().manual_seed(107)), 128)
    with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128\), got 16"):
        quantize_int4(torch.randn(4, 64, generator=torch.Generator().manual_seed(109)), 16)
    with pytest.raises(ValueError, match="does not divide in_features 48"):
        check_group_size(32, 48)
    with pytest.raises(ValueError, match=r"2-D weight .* got \(64,\)"):
        quantize_int8(torch.randn(64, generator=torch.Generator().manual_seed(113)))
    with pytest.raises(ValueError, match="floating-point weights, got torch.int64"):
        quantize_int4(torch.ones(4, 64, dtype=torch.int64), 32)
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_int8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match=r"scales and mins must be \[4, 2\]"):
        dequantize_int4(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 1), 32)
    with pytest.raises(ValueError, match=r"int8 scales must be \[4\]"):
        dequantize_int8(torch.zeros(4, 8, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="codes must be in 0..15"):
        pack_int4(torch.tensor([[3, 16]]))
    with pytest.raises(ValueError, match="even column count"):
        pack_int4(torch.tensor([[3, 1, 2]]))


@pytest.mark.slow
def test_smollm2_linear_layers_are_q4_1_and_int4_g32_reproduces_them():
    """The default model's fp32 cache is its GGUF dequantized: Q4_1 for every linear layer."""
    from safetensors import safe_open
    from minserve.models.loader import resolve_model_dir
    path = resolve_model_dir("smollm2-135m") / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.29.self_attn.q_proj.weight"):
            assert reproduction(f.get_tensor(name).float(), "int4", 32).exact_fraction == 1.0
