"""int8 activations (quantization_config "activations": "int8"): the W8A8 / W4A8 C loops of
kernels/quant_a8.h against the torch reference minserve/quant/activations.py, the layers and
schemes that use them, and the fused decode step against the PyTorch path of the same model.

The reference computes the integer dot products exactly (int64) and the float parts in float64;
the C loops compute the same integers and the float parts in float32, so results agree to float32
accumulation error, and a row's result never depends on the other rows or the thread count.
"""

import ctypes
import subprocess

import pytest
import torch

from minserve.config import EngineConfig
from minserve.kernels import build as kernel_build
from minserve.kernels import quant as qk
from minserve.kernels.decode import unsupported_reason
from minserve.models.layers import Linear
from minserve.quant import quantize_
from minserve.quant.activations import int4_linear_a8, int8_linear_a8, quantize_activations
from minserve.quant.formats import quantize_int4, quantize_int8
from minserve.quant.schemes import Int4Linear, Int8Linear, make_scheme
from test_fused_quant import STEPS, _assert_logits_close, _fill_cache, _run_both, _runner, model_dirs  # noqa: F401

pytestmark = pytest.mark.skipif(qk._lib() is None, reason="no C compiler: the C kernels cannot be built")


def _case(out, inn, batch, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inn, generator=g)
    x = torch.randn(batch, inn, generator=g) * 3
    if batch > 1:
        x[1, :32] = 0   # an all-zero block: d = 0, codes 0, contributes nothing
    return w, x, torch.randn(out, generator=g)


def _both(x, w, g, bias):
    """((C, reference) for int4 with group g, (C, reference) for int8)."""
    packed, s4, m4 = quantize_int4(w, g)
    codes, s8 = quantize_int8(w)
    return ((qk.linear_a8(x, 4, packed, s4, m4, g, bias), int4_linear_a8(x, packed, s4, m4, g, bias)),
            (qk.linear_a8(x, 8, codes, s8, None, 0, bias), int8_linear_a8(x, codes, s8, bias)))


def _assert_close(y, ref):
    scale = ref.abs().max().item() + 1
    assert (y - ref).abs().max().item() <= 2e-6 * scale * (y.shape[-1] ** 0.5 + 16), (y - ref).abs().max()


def test_the_quantizer_is_the_reference_in_each_order():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(52)) \
        * torch.tensor([0.01, 1, 100]).repeat_interleave(32)
    x[2, 32:64] = 0
    # Two float32 sums of one block in different orders differ by rounding relative to the block's
    # magnitudes, not to its (possibly cancelling) sum: each order's error is at most (n - 1) * u *
    # sum|x_i| (n = 32 terms, u = 2^-24 float32's unit roundoff), so the two differ by at most twice that.
    # (An unseeded run once differed by 1.5e-4 on a block of magnitudes ~100, where sum|x| ~ 32 * 80 and
    # the bound is ~9e-3: an absolute 1e-5 was the wrong scale, not a bug.)
    sum_tol = 2 * 31 * 2.0 ** -24 * x.abs().reshape(5, 3, 32).sum(2)
    want, d_ref, sums_ref = quantize_activations(x)
    lib = qk._lib()
    for int4_order in (0, 1):
        codes, d, sums, shift = torch.empty(5, 96, dtype=torch.int8), torch.empty(5, 3), torch.empty(5, 3), torch.empty(5)
        lib.ms_quantize_a8(x.data_ptr(), 5, 96, int4_order, codes.data_ptr(), d.data_ptr(), sums.data_ptr(),
                           shift.data_ptr())
        # int4 order: each 8 columns as their 4 even ones, then their 4 odd ones (nibble order)
        order = torch.arange(96).reshape(-1, 4, 2).transpose(1, 2).reshape(-1) if int4_order else torch.arange(96)
        assert torch.equal(codes, want[:, order])
        assert torch.equal(d, d_ref.float())
        assert ((sums - sums_ref).abs() <= sum_tol).all(), (sums - sums_ref).abs().max()
        torch.testing.assert_close(shift, (128 * d_ref * want.reshape(5, 3, 32).sum(2).float()).sum(1))
    assert torch.equal(d_ref[2, 1], torch.tensor(0.0)) and not want[2, 32:64].any()
    assert want.abs().max() == 127   # each block's largest magnitude maps to +-127


@pytest.mark.parametrize("out,inn,g", [(37, 64, 32), (100, 576, 64), (49, 256, 128), (16, 1536, 32),
                                       (1, 128, 128)])
@pytest.mark.parametrize("batch", [1, 3, 9, 17, 260])   # 260: a whole AVX2 pass of inputs and a tail
@pytest.mark.parametrize("with_bias", [False, True])
def test_c_loops_match_the_reference(out, inn, g, batch, with_bias):
    w, x, bias = _case(out, inn, batch, seed=out + inn + batch)
    for y, ref in _both(x, w, g, bias if with_bias else None):
        assert y.shape == (batch, out)
        _assert_close(y, ref)


def test_int8_activations_differ_from_float_ones_by_the_rounding_only():
    """A8 is another computation than W4A16 (so the reference is needed), but a close one."""
    w, x, _ = _case(64, 576, 4, seed=3)
    packed, s4, m4 = quantize_int4(w, 32)
    from minserve.kernels.quant import int4_linear
    a16, a8 = int4_linear(x, packed, s4, m4, 32), qk.linear_a8(x, 4, packed, s4, m4, 32)
    rel = ((a8 - a16).norm() / a16.norm()).item()
    assert 1e-4 < rel < 0.03, rel


@pytest.mark.parametrize("rows", [13, 45])   # 45: the packed tiles (>= 32 inputs, quant_a8_packed.h)
def test_rows_are_independent_and_threads_do_not_change_bits(rows):
    """A row's output does not depend on the others in the call: the same bits alone (one input:
    the per-pass transposes) as among 45 (the tile packed once, the inputs interleaved 12 to a
    pass, the last pass padded with copies of the last row: quant_a8_packed.h)."""
    w, x, bias = _case(300, 576, rows, seed=7)
    for bits in (4, 8):
        args = (4, *quantize_int4(w, 32), 32) if bits == 4 else (8, *quantize_int8(w), None, 0)
        whole = qk.linear_a8(x, *args, bias)
        alone = torch.cat([qk.linear_a8(x[i:i + 1], *args, bias) for i in range(rows)])
        assert torch.equal(whole, alone)
        assert torch.equal(whole, qk.linear_a8(x, *args, bias, num_threads=1))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_packed_tile_accumulates_like_the_passes(bits):
    """accumulate=1 through the packed tile (40 inputs at once) adds the same bits as 8 at a time."""
    w, x, bias = _case(40, 64, 40, seed=2)
    if bits == 4:
        weights = quantize_int4(w, 32)
        ptrs = (weights[0].data_ptr(), weights[1].data_ptr(), weights[2].data_ptr(), 32)
        ref = int4_linear_a8(x, *weights, 32, bias)
    else:
        weights = quantize_int8(w)
        ptrs = (weights[0].data_ptr(), weights[1].data_ptr(), None, 0)
        ref = int8_linear_a8(x, *weights, bias)
    base = torch.randn(40, 40, generator=torch.Generator().manual_seed(110))
    outs = []
    for chunk in (40, 8):
        y = base.clone()
        for i in range(0, 40, chunk):
            scratch, yc = torch.empty(chunk * 64 + chunk), y[i:i + chunk].clone()
            qk._lib().ms_linear_a8(bits, *ptrs, bias.data_ptr(), x[i:i + chunk].contiguous().data_ptr(),
                                   scratch.data_ptr(), yc.data_ptr(), chunk, 64, 40, 1, 0, None)
            y[i:i + chunk] = yc
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    _assert_close(outs[0], base + ref)


needs_vnni = pytest.mark.skipif(qk._lib() is None or qk.a8_isa() != "avx512-vnni",
                                reason="the load-time tiles (quant_a8_tiles.h) exist only with AVX-512 VNNI")


def _weights(bits, w, g):
    """(bits, codes, scales, mins, group size) as linear_a8 and a8_tiles take them."""
    return (4, *quantize_int4(w, g), g) if bits == 4 else (8, *quantize_int8(w), None, 0)


@needs_vnni
@pytest.mark.parametrize("bits,out,inn,g", [(4, 300, 576, 32), (4, 17, 128, 64), (4, 40, 256, 128), (4, 16, 64, 32),
                                            (8, 300, 576, 0), (8, 17, 128, 0)])
def test_tiles_give_the_bits_of_the_row_major_loops(bits, out, inn, g):
    """The weight laid out at load (a8_tiles) gives what the per-pass transposes (fewer than 32
    inputs) and the per-call packed tile (32 or more) give, bit for bit, at every pass size the
    tiles run (1, 2, 4, 8, 12 inputs and their remainders), with and without a bias, on one thread
    or the team; a last tile of fewer than 16 rows included (out = 300, 17, 40)."""
    w, _, bias = _case(out, inn, 1, seed=out + g)
    weights = _weights(bits, w, g)
    tiles = qk.a8_tiles(*weights)
    per_tile = 4 * inn // 32 + 2 * inn // g if bits == 4 else 8 * inn // 32
    assert tiles is not None and tiles.numel() == (out + 15) // 16 * per_tile * 64
    gen = torch.Generator().manual_seed(inn)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 25, 31, 32, 45):
        x = torch.randn(rows, inn, generator=gen) * 3
        for b in (None, bias):
            want = qk.linear_a8(x, *weights, b)
            assert torch.equal(qk.linear_a8(x, *weights, b, tiles=tiles), want), rows
            assert torch.equal(qk.linear_a8(x, *weights, b, tiles=tiles, num_threads=1), want)


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
def test_tiles_accumulate_and_refuse_another_weights_size(bits):
    w, x, bias = _case(40, 64, 20, seed=5)
    weights = _weights(bits, w, 32)
    tiles = qk.a8_tiles(*weights)
    base = torch.randn(20, 40, generator=torch.Generator().manual_seed(6))
    outs = []
    for t in (None, tiles):
        y, scratch = base.clone(), torch.empty(20 * 64 + 20)
        qk._lib().ms_linear_a8(bits, *(None if v is None else v.data_ptr() for v in weights[1:4]), weights[4],
                               bias.data_ptr(), x.data_ptr(), scratch.data_ptr(), y.data_ptr(), 20, 64, 40, 1, 0,
                               None if t is None else t.data_ptr())
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], base)
    other = qk.a8_tiles(*_weights(bits, w[:24], 32))   # 2 tiles, not 3
    with pytest.raises(ValueError, match=f"tiles must be .* {tiles.numel()} bytes"):
        qk.linear_a8(x, *weights, tiles=other)


def test_refuses_widths_that_do_not_divide_into_blocks():
    g = torch.Generator().manual_seed(117)
    codes, scales = quantize_int8(torch.randn(8, 48, generator=g))
    x = torch.randn(2, 48, generator=g)
    with pytest.raises(ValueError, match="divisible by 32"):
        qk.linear_a8(x, 8, codes, scales, None, 0)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        qk.linear_a8(x, 2, codes, scales, None, 0)


@pytest.mark.parametrize("march,isa", [("x86-64-v3", "avx2"), ("x86-64", "portable")])
def test_builds_without_vnni_compute_the_same(tmp_path, monkeypatch, march, isa):
    """The AVX2 loops (vpmaddubsw) and the plain ones (any other CPU) give the same results, for
    every input count the AVX2 tiles split differently (one chunk, a chunk and a tail, a tile
    with a partial second half of 8 rows)."""
    if "avx2" not in kernel_build._cpu_signature().split():
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    flags = [f for f in kernel_build.FLAGS if not f.startswith("-march")] + [f"-march={march}"]
    so = tmp_path / f"libquant-{march}.so"
    done = subprocess.run([kernel_build._compiler(), *flags, str(kernel_build.SOURCE_DIR / "quant.c"),
                           "-o", str(so), "-lm"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lib = qk.with_signatures(ctypes.CDLL(str(so)))
    assert lib.ms_a8_isa().decode() == isa
    monkeypatch.setattr(qk, "_lib", lambda: lib)
    assert qk.a8_tiles(4, *quantize_int4(torch.ones(16, 64), 32), 32) is None   # VNNI's layout only
    for out, batch in ((33, 5), (29, 300)):
        w, x, bias = _case(out, 256, batch, seed=11 + batch)
        for y, ref in _both(x, w, 64, bias):
            _assert_close(y, ref)


# ---- layers, schemes, config --------------------------------------------------------------------

def _linear(out, inn, seed=0):
    layer = Linear(inn, out, bias=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, inn, generator=g))
        layer.bias.copy_(torch.randn(out, generator=g))
    return layer


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_scheme_with_int8_activations_makes_layers_that_use_them(fmt):
    scheme = make_scheme(fmt, {"activations": "int8"})
    assert scheme.label().endswith("act=int8") and "act=" not in make_scheme(fmt).label()
    layer = scheme.convert("layers.0.mlp.down_proj", _linear(24, 64))
    assert isinstance(layer, Int8Linear if fmt == "int8" else Int4Linear)
    assert layer.activations == "int8" and layer.descriptor().activations == "int8"
    assert " a8 " in layer.descriptor().describe()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(160))
    y = layer(x)
    ref = (int8_linear_a8(x, layer.codes, layer.scales, layer.bias.data) if fmt == "int8" else
           int4_linear_a8(x, layer.packed, layer.scales, layer.mins, layer.group_size, layer.bias.data))
    _assert_close(y, ref)
    layer.kernel = "reference"   # the torch reference path computes the same thing
    _assert_close(layer(x), ref)
    # a width that does not divide into blocks of 32 keeps float activations
    assert make_scheme("int8", {"activations": "int8"}).convert("x", _linear(8, 48)).activations == "float"


def test_bad_activation_settings_name_the_key():
    with pytest.raises(ValueError, match=r"activations.*'float', 'int8'.*'int4'"):
        make_scheme("int4", {"activations": "int4"})
    with pytest.raises(ValueError, match="activations.*CPU only"):
        EngineConfig(model="smollm2-135m", quantization="int4", quantization_config={"activations": "int8"},
                     device="cuda")


# ---- the fused decode step ----------------------------------------------------------------------

def _restore(kv, snapshot) -> None:
    """Put every cache tensor back to its snapshot (a step writes its rows' K/V)."""
    for layer, old in zip(kv, snapshot):
        for t, t0 in zip(layer, old):
            t.copy_(t0)


def _relative(a, b):
    return ((a - b).abs().mean() / b.abs().mean()).item()


@pytest.mark.parametrize("fmt,config", [("int4", {"group_size": 64, "lm_head": "int8"}),
                                        ("int8", {"lm_head": "quantize"}), ("int4", {"lm_head": "keep"})])
def test_fused_step_runs_int8_activations_like_the_torch_path(fmt, config, model_dirs):  # noqa: F811
    """Rounding activations is not continuous: a last-bit difference upstream (the two paths sum
    attention and norms in other orders) moves an input across a rounding boundary now and then,
    and on this tiny random model one such flip moves the logits by about a percent (a nudge of
    the embeddings in their last bits does the same). So the paths agree to a few %, not to
    fp32's 1e-4, while the fused step with float activations would agree with neither A8 result
    to 1e-5, and misread codes or scales would be off by far more than 5 %."""
    runner = _runner(model_dirs["llama"])
    quantize_(runner.model, make_scheme(fmt, config | {"activations": "int8"}))
    assert runner.model.layers[0].mlp.down_proj.descriptor().activations == "int8"
    assert unsupported_reason(runner.model, runner.kv_caches) is None
    _fill_cache(runner.kv_caches, seed=2)
    snapshot = [tuple(t.clone() for t in layer) for layer in runner.kv_caches]
    for i, (contexts, query_lens) in enumerate(STEPS.values()):
        out, ref, _, _ = _run_both(runner, contexts, query_lens, seed=i)
        assert _relative(out, ref) < 0.05
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
        _restore(runner.kv_caches, snapshot)   # the same cache for the float run
        for m in runner.model.modules():
            if isinstance(m, (Int4Linear, Int8Linear)):
                m.activations = "float"
        float_out, float_ref, _, _ = _run_both(runner, contexts, query_lens, seed=i)
        for m in runner.model.modules():
            if isinstance(m, (Int4Linear, Int8Linear)):
                m.activations = "int8"
        _assert_logits_close(float_out, float_ref)           # the float paths agree to fp32 error
        assert (out - float_out).abs().max() > 1e-3            # and the A8 step is another computation
        _restore(runner.kv_caches, snapshot)


def test_fused_rows_do_not_depend_on_their_neighbours(model_dirs):  # noqa: F811
    from minserve.kernels.decode import FusedDecoder, rows_block_tables
    runner = _runner(model_dirs["llama"])
    quantize_(runner.model, make_scheme("int4", {"activations": "int8"}))
    _fill_cache(runner.kv_caches, seed=3)
    kv = runner.kv_caches
    fused = FusedDecoder(runner.model, kv, max_rows=4)
    snapshot = [tuple(t.clone() for t in layer) for layer in kv]
    ids, pos = torch.tensor([5, 77, 300, 9]), torch.tensor([40, 17, 63, 2])
    tables = rows_block_tables([1] * 4, [[3, 9, 4, 1], [7, 2], [11, 12, 13, 14], [20]])
    together = fused(ids, pos, tables, torch.arange(4))
    for r in range(4):
        _restore(kv, snapshot)
        alone = fused(ids[r:r + 1], pos[r:r + 1], tables[r:r + 1], torch.arange(1))
        assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fused_step_dispatches_int8_activations_to_the_same_loops(fmt):
    """decode.c's matmul on a bound A8 weight (its scratch included) gives kernels/quant.py's
    result bit for bit: the same loops, fed the same way."""
    from minserve.kernels.build import load
    from minserve.kernels.decode import _weight
    layer = make_scheme(fmt, {"activations": "int8"}).convert("layers.0.mlp.down_proj", _linear(70, 96))
    if qk.a8_isa() == "avx512-vnni":
        row_major = layer(torch.ones(2, 96))
        assert layer.tile_for_a8() and torch.equal(layer(torch.ones(2, 96)), row_major)   # the tiles bound
    w, keep = _weight("down_proj", layer, 70, 96, bias_ok=True)
    assert (w.a8_tiles is not None) == (layer.descriptor().a8_tiles is not None)
    lib = load("decode")
    lib.ms_weight_matmul.restype = ctypes.c_int64
    g = torch.Generator().manual_seed(251)
    x = torch.randn(5, 96, generator=g)
    for accumulate in (0, 1):
        y, xs = torch.randn(5, 70, generator=g), torch.empty(5 * 97)
        out = layer(x)
        want = y * accumulate + out
        # Accumulating adds y to the same products and bias, perhaps in another order: three float32
        # terms (y, products, bias) summed in two orders differ by at most 2 * 2 * u * the sum of their
        # magnitudes (u = 2^-24), and |products| = |out - bias| <= |out| + |bias|.
        terms = y.abs() + out.abs() + 2 * layer.bias.detach().abs()
        lib.ms_weight_matmul(ctypes.byref(w), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(xs.data_ptr()),
                             ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(5), ctypes.c_int64(96),
                             ctypes.c_int64(70), ctypes.c_int(accumulate))
        if accumulate:
            assert ((y - want).abs() <= 4 * 2.0 ** -24 * terms).all(), (y - want).abs().max()
        else:
            assert torch.equal(y, want)


@needs_vnni
def test_an_engine_with_int8_activations_keeps_tiles_and_the_same_tokens(model_dirs, monkeypatch):  # noqa: F811
    """The engine lays its layers out once (model_runner._tile_for_a8: the int4 layers and the int8
    head): the fused step and the prefill read the tiles, greedy tokens are those of the row-major
    loops (MINSERVE_A8_TILES=off), and the copy is counted in the resident weights."""
    from minserve import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [3 + i, 17, 99, 250 + 7 * i, 4]} for i in range(5)]
    runs = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv("MINSERVE_A8_TILES", setting)
        llm = LLM(str(model_dirs["llama"]), quantization="int4", quantization_config={"activations": "int8"},
                  num_kv_blocks=64, block_size=16, max_model_len=256, device="cpu", seed=0)
        runner = llm.llm_engine.runner
        layers = [m for m in runner.model.modules() if isinstance(m, (Int4Linear, Int8Linear)) and m.activations == "int8"]
        assert layers and all((m.a8_tiles is not None) == (setting == "auto") for m in layers)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
        runs[setting] = ([o.outputs[0].token_ids for o in outs], runner.weight_footprint().resident_bytes,
                         sum(m.a8_tiles.numel() for m in layers if m.a8_tiles is not None))
    assert runs["auto"][0] == runs["off"][0]
    assert runs["auto"][1] == runs["off"][1] + runs["auto"][2] > runs["off"][1]


def test_without_the_fused_step_a_request_gets_the_same_logits_in_any_batch(model_dirs):  # noqa: F811
    """docs/engine/sampling.md (batch-invariant runs): with fused_decode=False every step runs the
    PyTorch path, whose products and SwiGLU/RoPE per row do not depend on the rows beside it (C at
    every row count), so int8 activations round the same inputs into the same codes alone and in a
    crowd: a short prompt, never cut into chunks, gets its tokens and log-probabilities bit for bit
    the same. (Chunk cuts, prefix-cache hits and preemption also need the attention of
    batch_invariant=True: tests/test_batch_invariance.py.)"""
    from minserve import LLM, SamplingParams
    llm = LLM(str(model_dirs["llama"]), quantization="int4", quantization_config={"activations": "int8"},
              fused_decode=False, num_kv_blocks=64, block_size=16, max_model_len=256, device="cpu", seed=0,
              enable_prefix_caching=False)
    probe = {"prompt_token_ids": [3, 17, 99, 250, 4]}
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, logprobs=5, ignore_eos=True)
    alone = llm.generate([probe], seeded, use_tqdm=False)[0].outputs[0]
    crowd = [{"prompt_token_ids": [(7 * i) % 500 + 1 for i in range(n)]} for n in (90, 3, 40)]
    others = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 20, 6)]
    outs = llm.generate(crowd[:1] + [probe] + crowd[1:], others[:1] + [seeded] + others[1:], use_tqdm=False)
    together = outs[1].outputs[0]
    assert together.token_ids == alone.token_ids
    as_numbers = [[{t: lp.logprob for t, lp in step.items()} for step in out.logprobs] for out in (alone, together)]
    assert as_numbers[0] == as_numbers[1]
