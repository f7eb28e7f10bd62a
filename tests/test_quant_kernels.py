"""The int8 / int4 C kernels (kernels/quant.c via kernels/quant.py) against the torch reference.

The reference is the format's own dequantization followed by ``F.linear``. The kernels add in a
different order (16 lanes, two accumulators, a tree at the end), so results agree to fp32
accumulation error, bounded per output by ``n * 2^-24 * sum_i |x_i w_i|`` for each of the two.
Shapes are odd on purpose: row counts that are not a multiple of the 16-row tile, input widths
with a 16-column tail (int8), batches that are not a multiple of the 8-row pass.
"""

import ctypes
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from minserve.kernels import build as kernel_build
from minserve.kernels import quant as qk
from minserve.kernels.quant import int4_linear, int8_linear
from minserve.models import gemm
from minserve.quant.formats import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the quantized kernels cannot be built")

PREFILL = qk.PREFILL_MIN_ROWS   # "auto" takes the dequantize-a-tile + torch path from here on
BATCHES = [1, 3, 16, 40, PREFILL]   # 40: five passes of 8 rows in the fused loop


@pytest.fixture(autouse=True)
def float32_tiles(monkeypatch):
    """These tests check the C dequantization to fp32 accuracy, so the prefill tiles stay float32
    here; test_bf16_tiles_round_only_as_bf16_does checks the bfloat16 tiles separately."""
    monkeypatch.setattr(qk, "prefill_tile_dtype", lambda: torch.float32)


def assert_matches(y, x, w, bias):
    ref = F.linear(x, w, bias)
    bound = 2 * (x.shape[-1] + 4) * 2.0 ** -24 * (x.abs() @ w.abs().T + (0 if bias is None else bias.abs()))
    assert y.shape == ref.shape and y.dtype == torch.float32
    worst = ((y - ref).abs() - bound).max()
    assert worst <= 0, f"off the reference by {worst:.3g} beyond the fp32 bound"


def _case(out, inn, batch, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inn, generator=g) * 0.05, torch.randn(batch, inn, generator=g),
            torch.randn(out, generator=g))


@pytest.mark.parametrize("out", [7, 33, 129])
@pytest.mark.parametrize("inn", [64, 96, 576, 37, 100])   # 37, 100: 16- and 32-column tails
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_matches_reference(out, inn, with_bias):
    for batch in BATCHES:
        w, x, bias = _case(out, inn, batch, seed=out * inn + batch)
        bias = bias if with_bias else None
        codes, scales = quantize_int8(w)
        ref_w = dequantize_int8(codes, scales)
        for path in ("auto", "fused", "dequant"):
            assert_matches(int8_linear(x, codes, scales, bias, path=path), x, ref_w, bias)


@pytest.mark.parametrize("out,inn,group_size", [
    (o, i, g) for o in (7, 33, 129) for i in (64, 96, 576, 256) for g in (32, 64, 128) if i % g == 0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_matches_reference(out, inn, group_size, with_bias):
    for batch in BATCHES:
        w, x, bias = _case(out, inn, batch, seed=out * inn + batch + group_size)
        bias = bias if with_bias else None
        packed, scales, mins = quantize_int4(w, group_size)
        ref_w = dequantize_int4(packed, scales, mins, group_size)
        for path in ("auto", "fused", "dequant"):
            assert_matches(int4_linear(x, packed, scales, mins, group_size, bias, path=path), x, ref_w, bias)


def test_leading_dimensions_empty_batch_and_non_contiguous_input():
    w, x, bias = _case(33, 64, 6, seed=3)
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, 32)
    x3 = x.reshape(2, 3, 64)
    assert int8_linear(x3, codes, scales, bias).shape == (2, 3, 33)
    assert torch.equal(int8_linear(x3, codes, scales, bias).reshape(6, 33), int8_linear(x, codes, scales, bias))
    assert int4_linear(x3, packed, s4, m4, 32).shape == (2, 3, 33)
    assert int8_linear(x[:0], codes, scales).shape == (0, 33)
    assert int4_linear(x[:0], packed, s4, m4, 32).shape == (0, 33)
    # a transposed view: copied to contiguous, not misread
    xt = torch.randn(64, 5, generator=torch.Generator().manual_seed(87)).T
    assert_matches(int4_linear(xt, packed, s4, m4, 32), xt, dequantize_int4(packed, s4, m4, 32), None)


@pytest.mark.parametrize("tile_rows", [16, 33, 64])   # 33 = 16 + 16 + 1; one tile, exact and roomy
def test_tiled_path_covers_every_row(monkeypatch, tile_rows):
    monkeypatch.setattr(qk, "TILE_BYTES", tile_rows * 4 * 96)
    w, x, bias = _case(33, 96, 5, seed=8)
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, 32)
    assert_matches(int8_linear(x, codes, scales, bias, path="dequant"), x, dequantize_int8(codes, scales), bias)
    assert_matches(int4_linear(x, packed, s4, m4, 32, bias, path="dequant"), x,
                   dequantize_int4(packed, s4, m4, 32), bias)


def test_c_accumulate_flag_adds_to_y():
    # For the fused decode step (residual adds): y += x @ W^T + bias, called on the C API directly.
    lib = qk._lib()
    w, x, bias = _case(33, 96, 3, seed=9)
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, 32)
    y0 = torch.randn(3, 33, generator=torch.Generator().manual_seed(107))
    y8, y4, xs = y0.clone(), y0.clone(), torch.empty_like(x)
    assert lib.ms_int8_linear(codes.data_ptr(), scales.data_ptr(), bias.data_ptr(), x.data_ptr(),
                              y8.data_ptr(), 3, 96, 33, 1, 0) >= 1
    assert lib.ms_int4_linear(packed.data_ptr(), s4.data_ptr(), m4.data_ptr(), 32, bias.data_ptr(),
                              x.data_ptr(), xs.data_ptr(), y4.data_ptr(), 3, 96, 33, 1, 0) >= 1
    assert_matches(y8 - y0, x, dequantize_int8(codes, scales), bias)
    assert_matches(y4 - y0, x, dequantize_int4(packed, s4, m4, 32), bias)


def test_results_do_not_depend_on_the_thread_count():
    # Each output row is one thread's sequential sum, whatever the team size: bit-identical.
    w, x, bias = _case(129, 576, 16, seed=4)
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, 64)
    for fn in (lambda n: int8_linear(x, codes, scales, bias, num_threads=n, path="fused"),
               lambda n: int4_linear(x, packed, s4, m4, 64, bias, num_threads=n, path="fused")):
        assert torch.equal(fn(1), fn(2)) and torch.equal(fn(1), fn(0))


def test_batch_rows_are_independent():
    # A row's result must not change with its neighbours in the batch (several rows per pass).
    w, x, _ = _case(33, 96, 16, seed=5)
    packed, s4, m4 = quantize_int4(w, 32)
    codes, scales = quantize_int8(w)
    for fn in (lambda xx: int4_linear(xx, packed, s4, m4, 32, path="fused"),
               lambda xx: int8_linear(xx, codes, scales, path="fused")):
        full = fn(x)
        assert torch.equal(full[11:12], fn(x[11:12])) and torch.equal(full[3:6], fn(x[3:6]))


def test_input_checks_name_the_problem():
    w, x, bias = _case(33, 64, 2, seed=6)
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, 32)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        int8_linear(torch.randn(2, 63, generator=torch.Generator().manual_seed(143)), codes, scales)
    with pytest.raises(ValueError, match="x must be a float32 CPU tensor"):
        int4_linear(x.double(), packed, s4, m4, 32)
    with pytest.raises(ValueError, match=r"int8 codes must be int8 \[33, 64\], got int16"):
        int8_linear(x, codes.to(torch.int16), scales)
    with pytest.raises(ValueError, match=r"int8 scales must be float32 \[33\]"):
        int8_linear(x, codes, scales[:5])
    with pytest.raises(ValueError, match="int8 codes must be contiguous"):
        int8_linear(x[:, :32], torch.cat([codes, codes], 1)[:, ::2], scales)
    with pytest.raises(ValueError, match=r"int4 mins must be float32 \[33, 2\]"):
        int4_linear(x, packed, s4, m4.T.contiguous(), 32)
    with pytest.raises(ValueError, match=r"group_size 128 does not divide in_features 64"):
        int4_linear(x, packed, s4, m4, 128)
    with pytest.raises(ValueError, match=r"bias must be float32 \[33\]"):
        int4_linear(x, packed, s4, m4, 32, bias=bias.double())
    with pytest.raises(ValueError, match="num_threads must be an int >= 0"):
        int8_linear(x, codes, scales, num_threads=-1)
    with pytest.raises(ValueError, match="path must be one of"):
        int8_linear(x, codes, scales, path="gpu")


def test_this_cpu_gets_its_fastest_path():
    cpu_flags = kernel_build._cpu_signature().split()
    expected = "avx512" if "avx512f" in cpu_flags else "avx2" if "avx2" in cpu_flags else "portable"
    assert qk.kernel_isa() == expected


def test_without_the_c_kernels_the_torch_reference_answers(monkeypatch):
    monkeypatch.setattr(qk, "_lib", lambda: None)   # what _lib() returns when nothing compiles
    w, x, bias = _case(33, 64, 3, seed=7)
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, 32)
    assert torch.equal(int8_linear(x, codes, scales, bias), F.linear(x, dequantize_int8(codes, scales), bias))
    assert torch.equal(int4_linear(x, packed, s4, m4, 32, bias),
                       F.linear(x, dequantize_int4(packed, s4, m4, 32), bias))


@pytest.mark.parametrize("march,isa", [("x86-64-v3", "avx2"), ("x86-64-v2", "portable")])
def test_builds_without_avx512_compute_the_same(march, isa, tmp_path, monkeypatch):
    """quant.c must compile and compute the same on CPUs without AVX-512 (AVX2, or plain loops)."""
    if "avx2" not in kernel_build._cpu_signature().split():
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    flags = [f for f in kernel_build.FLAGS if not f.startswith("-march")] + [f"-march={march}"]
    so = tmp_path / f"libquant-{isa}.so"
    done = subprocess.run([kernel_build._compiler(), *flags, str(kernel_build.SOURCE_DIR / "quant.c"),
                           "-o", str(so), "-lm"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lib = qk.with_signatures(ctypes.CDLL(str(so)))
    assert lib.ms_quant_isa().decode() == isa
    monkeypatch.setattr(qk, "_lib", lambda: lib)
    for batch in (1, 3, 16):
        for inn, g in ((576, 64), (256, 128), (96, 32)):
            w, x, bias = _case(33, inn, batch, seed=batch + inn)
            packed, s4, m4 = quantize_int4(w, g)
            codes, scales = quantize_int8(w)
            assert_matches(int4_linear(x, packed, s4, m4, g, bias, path="fused"), x,
                           dequantize_int4(packed, s4, m4, g), bias)
            assert_matches(int8_linear(x, codes, scales, bias, path="fused"), x,
                           dequantize_int8(codes, scales), bias)


def test_bf16_tiles_round_only_as_bf16_does(monkeypatch):
    # x and each dequantized weight rounded to bfloat16 (relative 2^-9 each), the product summed
    # in float32 by oneDNN and its output rounded to bfloat16 (2^-9): 3 x 2^-9 of sum |x_i w_i|.
    monkeypatch.setattr(qk, "prefill_tile_dtype", lambda: torch.bfloat16)
    w, x, bias = _case(129, 576, PREFILL, seed=11)
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, 32)
    for y, ref_w in ((int8_linear(x, codes, scales, bias, path="dequant"), dequantize_int8(codes, scales)),
                     (int4_linear(x, packed, s4, m4, 32, bias, path="dequant"),
                      dequantize_int4(packed, s4, m4, 32))):
        ref = F.linear(x, ref_w, bias)
        mags = x.abs() @ ref_w.abs().T
        assert y.dtype == torch.float32 and y.shape == ref.shape
        assert ((y - ref).abs() <= 3 * 2.0 ** -9 * mags + 1e-6 * bias.abs()).all()
        assert not torch.equal(y, ref)      # it did run in bfloat16


def test_the_tile_dtype_is_chosen_once_and_can_be_forced(monkeypatch):
    monkeypatch.undo()
    qk.prefill_tile_dtype.cache_clear()
    try:
        monkeypatch.setenv("MINSERVE_PREFILL_TILE_DTYPE", "float32")
        assert qk.prefill_tile_dtype() is torch.float32
        qk.prefill_tile_dtype.cache_clear()
        monkeypatch.setenv("MINSERVE_PREFILL_TILE_DTYPE", "int8")
        with pytest.raises(ValueError, match="MINSERVE_PREFILL_TILE_DTYPE must be one of bfloat16, float32"):
            qk.prefill_tile_dtype()
        qk.prefill_tile_dtype.cache_clear()
        monkeypatch.delenv("MINSERVE_PREFILL_TILE_DTYPE")
        assert qk.prefill_tile_dtype() is (torch.bfloat16 if gemm.native_bf16() else torch.float32)
    finally:
        qk.prefill_tile_dtype.cache_clear()
