"""bfloat16 weights times two or more rows on AVX-512 BF16 dot products (decode.c's dp_block): each
input is rounded to bf16 once, as PyTorch's and vLLM's bf16 linear layers take their activations,
and every product is exact with float32 sums. One row keeps the float32 input (the widening loop).

The reference is float64 arithmetic on the same bf16 weights and the bf16-rounded inputs. Where the
CPU (or the compiler) has no AVX-512 BF16 the tests of the products skip; the dispatch test runs
everywhere.
"""

import shutil
import subprocess

import pytest
import torch

from minserve import LLM
from minserve.kernels.build import cpu_flags
from minserve.kernels.decode import FusedDecoder

from test_amx_bf16 import _lib, _matmul, assert_product_within, assert_rows_independent, bf16_step_twice

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the fused decode kernel cannot be built"),
              pytest.mark.usefixtures("sdpa_reference")]   # conftest.py says why


def _compiler_has_bf16_dot() -> bool:
    cc = shutil.which("cc") or shutil.which("gcc")
    macros = subprocess.run([cc, "-march=native", "-dM", "-E", "-"], input="", capture_output=True,
                            text=True).stdout
    return "__AVX512BF16__" in macros


@pytest.fixture
def dot():
    """The library with the dot products on and AMX tiles off (they come first where present);
    skips where there are no dot products. Leaves both at their defaults (on) afterwards."""
    lib = _lib()
    if not lib.ms_bf16_dot(1):
        pytest.skip("this CPU (or build) has no AVX-512 BF16 dot products")
    lib.ms_amx(0)
    yield lib
    lib.ms_amx(1)
    lib.ms_bf16_dot(1)


def test_the_dot_products_are_used_exactly_where_the_cpu_has_them():
    lib = _lib()
    expected = "avx512_bf16" in cpu_flags() and _compiler_has_bf16_dot()
    assert bool(lib.ms_bf16_dot(1)) == expected
    assert lib.ms_bf16_dot(0) == 0          # off: the widening loop, whatever the CPU
    assert bool(lib.ms_bf16_dot(1)) == expected


# (rows, in, out): two rows, SmolLM2's widths, an input width that is no multiple of 32 (a tail),
# more rows than one pass (23 = 6 + 6 + 6 + 5) and output rows a block of 4 leaves over (42).
SHAPES = [(2, 64, 32), (16, 576, 960), (5, 100, 42), (23, 128, 48), (16, 1536, 576)]


@pytest.mark.parametrize("rows,n_in,out", SHAPES)
def test_dot_products_round_each_input_once(dot, rows, n_in, out):
    """Against float64 on the bf16-rounded inputs: no error from the inputs beyond that rounding."""
    assert_product_within(dot, rows, n_in, out, lambda x: x.to(torch.bfloat16), 0.0)


def test_one_row_keeps_its_float32_input(dot):
    """Batch 1 is bound by the weights' bytes, not the multiply-adds: it stays on the widening loop,
    exact to float32 sums against the unrounded input."""
    g = torch.Generator().manual_seed(5)
    W = torch.randn(40, 96, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 96, generator=g)
    want = x.double() @ W.double().T
    bound = 96 * 2.0 ** -24 * (x.double().abs() @ W.double().abs().T)
    assert ((_matmul(dot, W, x).double() - want).abs() <= bound).all()


def test_a_rows_results_do_not_depend_on_the_other_rows(dot):
    """Each (weight row, input row) pair sums in the same order whatever the rows beside it."""
    assert_rows_independent(dot)


def test_a_bfloat16_batch_on_dot_products_stays_near_the_widening_loop(dot):
    """A whole bf16 model step of 12 rows, with the dot products (the tiles off: they come first
    where the CPU has them) and with the widening loop: each product's input differs by bf16's
    rounding (2^-9 relative), so the logits by a few bf16 steps of the largest, and the greedy
    tokens not at all."""
    dotted, widened = bf16_step_twice(lambda fused: dot.ms_amx(0), lambda: dot.ms_bf16_dot(0))
    assert not torch.equal(dotted, widened)   # the inputs were rounded
    torch.testing.assert_close(dotted, widened, rtol=0, atol=2 ** -6 * widened.abs().max().item())
    assert torch.equal(dotted.argmax(-1), widened.argmax(-1))


def test_the_environment_switch_turns_the_dot_products_off(monkeypatch):
    """MINSERVE_BF16_DOT=off: two rows keep their float32 inputs (the widening loop's bound, which
    the rounded inputs miss); a misspelt value is refused; unset, the dot products are used exactly
    where the CPU has them (the tiles off: they come first)."""
    llm = LLM("tiny-llama", num_kv_blocks=8, dtype="bfloat16", fused_decode=True, device="cpu")
    runner = llm.llm_engine.runner
    monkeypatch.setenv("MINSERVE_AMX", "off")
    try:
        monkeypatch.setenv("MINSERVE_BF16_DOT", "off")
        assert FusedDecoder(runner.model, runner.kv_caches, max_rows=4).uses_bf16_dot is False
        assert_product_within(_lib(), 2, 64, 32, lambda x: x, 0.0)
        monkeypatch.setenv("MINSERVE_BF16_DOT", "fast")
        with pytest.raises(ValueError, match="MINSERVE_BF16_DOT must be one of auto, off"):
            FusedDecoder(runner.model, runner.kv_caches, max_rows=4)
        monkeypatch.delenv("MINSERVE_BF16_DOT")
        expected = "avx512_bf16" in cpu_flags() and _compiler_has_bf16_dot()
        assert FusedDecoder(runner.model, runner.kv_caches, max_rows=4).uses_bf16_dot is expected
    finally:
        _lib().ms_amx(1)
        _lib().ms_bf16_dot(1)
