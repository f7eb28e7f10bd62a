"""bfloat16 weights times several rows on AMX tiles (kernels/amx_bf16.h): the fused step's batched
bf16 products keep float32 inputs to 2^-17, and the tiles are used exactly where the CPU has them.

The reference is float64 arithmetic on the same bf16 weights and float32 inputs, not the vector loop
the tiles replace. Where the CPU has no AMX the tests of the tiles themselves skip; the dispatch test
runs everywhere.
"""

import ctypes
import shutil

import pytest
import torch

from minserve import LLM
from minserve.kernels.build import cpu_flags, load
from minserve.kernels.decode import WEIGHT_BF16, FusedDecoder, _Weight

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the fused decode kernel cannot be built"),
              pytest.mark.usefixtures("sdpa_reference")]   # conftest.py says why


def _lib():
    lib = load("decode")
    lib.ms_weight_matmul.restype = ctypes.c_int64
    return lib


@pytest.fixture
def amx():
    """The library with the tiles turned on; skips where they are not available. Leaves them on
    (the default) afterwards."""
    lib = _lib()
    if not lib.ms_amx(1):
        pytest.skip("this CPU (or build) has no AMX bf16 tiles")
    yield lib
    lib.ms_amx(1)
    lib.ms_bf16_dot(1)


def _matmul(lib, W, x, bias=None, y=None, accumulate=0):
    B, n_in = x.shape
    out = W.shape[0]
    y = torch.zeros(B, out) if y is None else y.clone()
    f32 = ctypes.POINTER(ctypes.c_float)
    w = _Weight(WEIGHT_BF16, ctypes.c_void_p(W.data_ptr()), None, None,
                None if bias is None else ctypes.cast(bias.data_ptr(), f32), 0, 0)
    xs = torch.empty(B * (n_in + 1))   # FusedDecoder's scratch: a row of each input, plus one float
    lib.ms_weight_matmul(ctypes.byref(w), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(xs.data_ptr()),
                         ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(B), ctypes.c_int64(n_in),
                         ctypes.c_int64(out), ctypes.c_int(accumulate))
    return y


def _compiler_has_amx() -> bool:
    """Whether the C compiler targets AMX for this CPU (gcc >= 11 with -march=native on one)."""
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    macros = subprocess.run([cc, "-march=native", "-dM", "-E", "-"], input="", capture_output=True,
                            text=True).stdout
    return "__AMX_BF16__" in macros and "__AMX_TILE__" in macros


def test_the_tiles_are_used_exactly_where_the_cpu_has_them():
    lib = _lib()
    expected = {"amx_bf16", "amx_tile"} <= cpu_flags() and _compiler_has_amx()
    assert bool(lib.ms_amx(1)) == expected
    assert lib.ms_amx(0) == 0          # off: the vector loop, whatever the CPU
    assert bool(lib.ms_amx(1)) == expected


# (rows, in, out): one tile of inputs, several 32-column blocks, a group of 16 rows plus a
# remainder (23), and output rows past the last whole 16-row tile (40) that take the plain loop.
SHAPES = [(2, 64, 32), (16, 576, 960), (5, 96, 40), (23, 128, 48), (16, 1536, 576)]


def assert_product_within(lib, rows, n_in, out, reference_input, input_bound):
    """One bf16 product of ``rows`` inputs against float64 on ``reference_input(x)`` (the inputs as
    the kernel multiplies them): bf16 x bf16 products are exact in float32 and the float32 sums
    round at most n_in times, so per output |error| <= (input_bound + n_in * 2^-24) * sum |x| |W|.
    With a bias, and again as the residual add (y += x @ W.T)."""
    g = torch.Generator().manual_seed(rows * 1000 + n_in)
    W = torch.randn(out, n_in, generator=g).to(torch.bfloat16)
    x, bias = torch.randn(rows, n_in, generator=g), torch.randn(out, generator=g)
    xr = reference_input(x).double()
    want = xr @ W.double().T
    bound = (input_bound + n_in * 2.0 ** -24) * (xr.abs() @ W.double().abs().T)
    got = _matmul(lib, W, x, bias=bias)
    assert ((got.double() - bias.double() - want).abs() <= bound + 2.0 ** -24 * bias.abs().double()).all()
    y0 = torch.randn(rows, out, generator=g)
    acc = _matmul(lib, W, x, y=y0, accumulate=1)
    assert ((acc.double() - y0.double() - want).abs() <= bound + 2.0 ** -24 * y0.abs().double() * 2).all()


@pytest.mark.parametrize("rows,n_in,out", SHAPES)
def test_tile_products_keep_float32_inputs(amx, rows, n_in, out):
    """x = hi + lo in bf16 keeps x to 2^-18 relative (two roundings to 8 bits)."""
    assert_product_within(amx, rows, n_in, out, lambda x: x, 2.0 ** -18)


def assert_rows_independent(lib):
    """With 2 or 23 rows beside it, a row's outputs are bit for bit the same."""
    g = torch.Generator().manual_seed(7)
    W = torch.randn(48, 128, generator=g).to(torch.bfloat16)
    x = torch.randn(23, 128, generator=g)
    together = _matmul(lib, W, x)
    assert torch.equal(_matmul(lib, W, x[[3, 20]]), together[[3, 20]])
    assert torch.equal(_matmul(lib, W, x[:16]), together[:16])


def test_a_rows_tile_results_do_not_depend_on_the_other_rows(amx):
    """Each input row is its own column of the tile product."""
    assert_rows_independent(amx)


def test_a_bfloat16_batch_on_tiles_matches_the_vector_loop(amx):
    """A whole bf16 model step of 12 rows (tiny-llama: every width a multiple of 32), with and
    without the tiles: the inputs differ by at most 2^-18 relative, so the logits by a small
    fraction of one bf16 step of the largest, and the greedy tokens not at all."""
    def before(fused):
        assert fused.uses_amx
    tiles, vector = bf16_step_twice(before, lambda: (amx.ms_amx(0), amx.ms_bf16_dot(0)))
    torch.testing.assert_close(tiles, vector, rtol=0, atol=2 ** -10 * vector.abs().max().item())
    assert torch.equal(tiles.argmax(-1), vector.argmax(-1))


def bf16_step_twice(before, between):
    """A whole bf16 model step of 12 rows (tiny-llama: every width a multiple of 32), run twice from
    the same KV cache: ``before(fused)`` once the step is built (it turns the tiles on where the CPU
    has them), ``between()`` between the two runs; returns both steps' logits."""
    llm = LLM("tiny-llama", num_kv_blocks=16, dtype="bfloat16", fused_decode=True, device="cpu")
    runner = llm.llm_engine.runner
    fused = FusedDecoder(runner.model, runner.kv_caches, max_rows=12)
    before(fused)
    ids = torch.arange(300, 312)
    pos = torch.tensor([3, 20, 5, 7, 1, 0, 9, 30, 2, 4, 11, 6])
    tables = torch.arange(12).remainder(8).mul(2).unsqueeze(1).repeat(1, 2)
    tables[:, 1] += 1
    rows = torch.arange(12)
    snapshot = [tuple(t.clone() for t in kv) for kv in runner.kv_caches]
    first = fused(ids, pos, tables, rows)
    for kv, saved in zip(runner.kv_caches, snapshot):   # the same cache before the second step
        for t, s in zip(kv, saved):
            t.copy_(s)
    between()
    return first, fused(ids, pos, tables, rows)


def test_the_roofline_benchmark_times_the_real_products():
    """benchmarks/bench_roofline.py's bf16 columns time these products (so their GFLOP/s are
    honest), and leave the tiles and the dot products at their default (on) afterwards."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_roofline import _c_bf16_matmul
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 64, generator=g), torch.randn(48, 64, generator=g).bfloat16()
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    tiled, dotted = _c_bf16_matmul("tiles"), _c_bf16_matmul("dot")
    for fn in (_c_bf16_matmul("widened"), tiled):
        if fn is not None:
            assert ((fn(x, w).double() - want).abs() <= (2.0 ** -18 + 64 * 2.0 ** -24) * scale).all()
    if dotted is not None:   # each input rounded to bf16 first: against that rounding
        xb = x.bfloat16().double()
        err = (dotted(x, w).double() - xb @ w.double().T).abs()
        assert (err <= 64 * 2.0 ** -24 * (xb.abs() @ w.double().abs().T)).all()
    assert bool(_lib().ms_amx(1)) == (tiled is not None)
    assert bool(_lib().ms_bf16_dot(1)) == (dotted is not None)


def test_the_environment_switch_turns_the_tiles_off(monkeypatch):
    llm = LLM("tiny-llama", num_kv_blocks=8, dtype="bfloat16", fused_decode=True, device="cpu")
    runner = llm.llm_engine.runner
    monkeypatch.setenv("MINSERVE_AMX", "off")
    assert FusedDecoder(runner.model, runner.kv_caches, max_rows=4).uses_amx is False
    monkeypatch.setenv("MINSERVE_AMX", "fast")
    with pytest.raises(ValueError, match="MINSERVE_AMX must be one of auto, off"):
        FusedDecoder(runner.model, runner.kv_caches, max_rows=4)
    monkeypatch.delenv("MINSERVE_AMX")
    expected = {"amx_bf16", "amx_tile"} <= cpu_flags() and _compiler_has_amx()
    assert FusedDecoder(runner.model, runner.kv_caches, max_rows=4).uses_amx is expected
