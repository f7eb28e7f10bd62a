"""fp32_matmul_precision="high": a float32 engine's products of many rows as three bf16 products on
AMX tiles (kernels/bf16_gemm.c's ms_bf16x3_gemm for the PyTorch path, amx_bf16.h's split weights
in the fused step), PyTorch's meaning of torch.set_float32_matmul_precision("high").

The reference is float64 arithmetic on the same float32 values: each operand keeps 16 of float32's
24 mantissa bits (x = hi + lo, each a bf16 rounding), so a product errs by at most ~3 * 2^-18 of
|x| |w| (the two representation errors and the dropped lo * lo term), and the float32 sums add
their own n_in * 2^-24. The engine-level tests run everywhere: without tiles "high" falls back to
the exact products, which the same checks accept.
"""

import ctypes
import shutil

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.config import EngineConfig
from minserve.kernels import bf16_gemm
from minserve.kernels.build import load
from minserve.kernels.decode import WEIGHT_F32, _Weight
from minserve.models import gemm
from minserve.models.layers import Linear

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the kernels cannot be built")
needs_tiles = pytest.mark.skipif(not bf16_gemm.available(), reason="no AMX tiles on this CPU (or MINSERVE_AMX=off)")

SPLIT_PRODUCT = 3 * 2.0 ** -18 * (1 + 2.0 ** -8)   # per product, relative to |x| |w|


def _inputs(rows: int, n_in: int, out: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n_in, generator=g), torch.randn(out, n_in, generator=g) * 0.05,
            torch.randn(out, generator=g))


def _within_split_rounding(y, x, w, bias=None):
    """Every output within the split's rounding of the float64 product (plus the bias's own)."""
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    mags = x.double().abs() @ w.double().abs().T
    bound = (SPLIT_PRODUCT + x.shape[1] * 2.0 ** -24) * mags + 2.0 ** -23 * want.abs()
    return bool(((y.double() - want).abs() <= bound).all())


@needs_tiles
@pytest.mark.parametrize("rows,n_in,out", [(16, 64, 32), (17, 96, 64), (33, 576, 960), (600, 1536, 96)])
def test_split_products_keep_16_mantissa_bits(rows, n_in, out):
    """Token tails (17, 33), several weight blocks, and 600 rows of 1536: four chunks of 160 tokens."""
    x, w, b = _inputs(rows, n_in, out, seed=rows)
    y = bf16_gemm.split_linear(x, bf16_gemm.split(w), b)
    assert y is not None and y.dtype == torch.float32 and y.shape == (rows, out)
    assert _within_split_rounding(y, x, w, b)
    # and it is more than one bf16 product: plain bf16 operands miss the same bound
    one_pass = (x.bfloat16().double() @ w.bfloat16().double().T + b.double()).float()
    assert not _within_split_rounding(one_pass, x, w, b)


@needs_tiles
def test_a_split_layer_takes_many_rows_to_the_tiles_and_few_to_the_exact_product(monkeypatch):
    x, w, _ = _inputs(bf16_gemm.MIN_ROWS, 64, 64, seed=1)
    layer = Linear.from_weight(w.clone())
    layer.split_weight()
    calls = []
    inner = bf16_gemm.split_linear
    monkeypatch.setattr(bf16_gemm, "split_linear", lambda *a: calls.append(a[0].shape[0]) or inner(*a))
    assert _within_split_rounding(layer(x), x, w) and calls == [bf16_gemm.MIN_ROWS]
    few = x[: bf16_gemm.MIN_ROWS - 1]
    assert torch.equal(layer(few), gemm.linear(few, w)) and calls == [bf16_gemm.MIN_ROWS]
    # loading a new weight makes new halves: the product follows the weight, not the old halves
    layer.load(-w)
    assert _within_split_rounding(layer(x), x, -w)
    # MINSERVE_GEMM=torch keeps every product in F.linear, the halves' too
    monkeypatch.setattr(gemm, "_requested", lambda: "torch")
    assert torch.equal(layer(x), torch.nn.functional.linear(x, -w)) and calls == [bf16_gemm.MIN_ROWS] * 2


@pytest.fixture
def amx():
    lib = load("decode")
    lib.ms_weight_matmul.restype = ctypes.c_int64
    if not lib.ms_amx(1):
        pytest.skip("this CPU (or build) has no AMX bf16 tiles")
    yield lib
    lib.ms_amx(1)


def _fused_matmul(lib, w, x, halves):
    """decode.c's matmul for a float32 Weight with (or without) its split halves."""
    B, n_in = x.shape
    y, xs = torch.zeros(B, w.shape[0]), torch.empty(B * (n_in + 1))
    bf = ctypes.POINTER(ctypes.c_uint16)
    split = [ctypes.cast(h.data_ptr(), bf) for h in halves] if halves else [None, None]
    weight = _Weight(WEIGHT_F32, ctypes.c_void_p(w.data_ptr()), None, None, None, 0, 0, *split)
    lib.ms_weight_matmul(ctypes.byref(weight), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(xs.data_ptr()),
                         ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(B), ctypes.c_int64(n_in),
                         ctypes.c_int64(w.shape[0]), ctypes.c_int(0))
    return y


@needs_tiles
@pytest.mark.parametrize("rows,n_in,out", [(2, 64, 32), (16, 576, 960), (23, 128, 48), (5, 96, 40)])
def test_the_fused_step_multiplies_split_weights_on_the_tiles(amx, rows, n_in, out):
    """Two or more rows: the halves on the tiles (23 rows: a group of 16 and one of 7; 48 outputs:
    a pair of 16-row tiles and a lone one; 40: the 8 rows past the last whole tile go the plain
    loop over the same halves). One row, or the tiles off: the float32 weight itself, exactly as
    without halves."""
    x, w, _ = _inputs(rows, n_in, out, seed=rows + n_in)
    halves = bf16_gemm.split(w)
    tiles = _fused_matmul(amx, w, x, halves)
    exact = _fused_matmul(amx, w, x, None)
    assert _within_split_rounding(tiles, x, w) and not torch.equal(tiles, exact)
    assert torch.equal(_fused_matmul(amx, w, x[:1], halves), _fused_matmul(amx, w, x[:1], None))
    amx.ms_amx(0)
    assert torch.equal(_fused_matmul(amx, w, x, halves), exact)


def test_the_setting_is_checked_and_defaults_to_pytorchs():
    with pytest.raises(ValueError, match="fp32_matmul_precision must be one of \\['highest', 'high'\\]"):
        EngineConfig(model="tiny-llama", fp32_matmul_precision="medium")
    assert EngineConfig(model="tiny-llama").fp32_matmul_precision == "highest"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert EngineConfig(model="tiny-llama").fp32_matmul_precision == "high"
        assert EngineConfig(model="tiny-llama", fp32_matmul_precision="highest").fp32_matmul_precision == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_engine_at_high_matches_the_exact_engine_to_its_rounding():
    """tiny-llama (every width a multiple of 32): a prompt of 40 tokens (its products on the
    tiles where there are some) then 12 greedy decode steps of 3 sequences (the fused step's
    tiles). Prompt logprobs agree to a small fraction of a nat and the greedy tokens exactly; the
    layers keep halves exactly where tiles exist, and counted as resident weights; and blocks
    cached by one engine are never offered to the other (their prefix-cache keys differ)."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 45 + i))} for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs, engines = {}, {}
    for precision in ("highest", "high"):
        llm = LLM("tiny-llama", num_kv_blocks=32, fp32_matmul_precision=precision, device="cpu")
        engines[precision] = llm.llm_engine
        outs[precision] = llm.generate(prompts, params, use_tqdm=False)
    high_layers = [m for m in engines["high"].runner.model.modules() if isinstance(m, Linear)]
    assert all((m.bf16_halves is not None) == bf16_gemm.available() for m in high_layers)
    halves = sum(h.numel() * h.element_size() for m in high_layers for h in m.bf16_halves or ())
    assert halves == (sum(m.weight.numel() * 4 for m in high_layers) if bf16_gemm.available() else 0)
    resident = {p: e.runner.weight_footprint().resident_bytes for p, e in engines.items()}
    assert resident["high"] == resident["highest"] + halves
    assert engines["high"].model_fingerprint != engines["highest"].model_fingerprint
    for prompt, exact, high in zip(prompts, outs["highest"], outs["high"]):
        assert high.outputs[0].token_ids == exact.outputs[0].token_ids
        for tok, a, b in zip(prompt["prompt_token_ids"][1:], exact.prompt_logprobs[1:], high.prompt_logprobs[1:]):
            assert abs(b[tok].logprob - a[tok].logprob) < 1e-3


def test_an_engine_says_when_high_changes_nothing(monkeypatch, caplog):
    """No tiles (or a bf16 engine): no halves, and the log says why rather than nothing."""
    monkeypatch.setattr(bf16_gemm, "available", lambda: False)
    with caplog.at_level("INFO", logger="minserve"):
        llm = LLM("tiny-llama", num_kv_blocks=16, fp32_matmul_precision="high", device="cpu")
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.bf16_halves is None for m in layers)
    assert "fp32_matmul_precision=high changes nothing: no AMX tiles" in caplog.text
