"""The C prefill attention (kernels/prefill_attention.c) against PyTorch's SDPA with an explicit
causal mask, and the engine's routing to it."""

import pytest
import torch
import torch.nn.functional as F

from minserve import LLM, SamplingParams
from minserve.kernels import prefill_attention as pa

if pa._library() is None:
    pytest.skip("no C compiler: the kernel cannot be built here", allow_module_level=True)


def _reference(q, k, v, scale):
    """SDPA with the mask written out: query i at position L - T + i sees keys 0..L - T + i."""
    T, L = q.shape[0], k.shape[0]
    mask = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


# (queries, cached context, heads, kv heads, head size): blocks of 32 queries and of 64 keys (256
# on the tiles) with tails on both sides, a context that is not a multiple of a block, prompts
# whose diagonal crosses key blocks, grouped and plain heads.
SHAPES = [(16, 0, 9, 3, 64), (37, 0, 9, 3, 64), (100, 250, 9, 3, 64), (64, 0, 4, 4, 128),
          (200, 70, 8, 2, 128), (129, 1, 6, 1, 64), (300, 530, 9, 3, 64)]


@pytest.mark.parametrize("T,ctx,H,Hkv,D", SHAPES)
def test_the_kernel_is_causal_attention(T, ctx, H, Hkv, D):
    g = torch.Generator().manual_seed(T * 1000 + ctx)
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(ctx + T, Hkv, D, generator=g), torch.randn(ctx + T, Hkv, D, generator=g)
    out = pa.prefill_attention(q, k, v, D ** -0.5)
    # float32 sums of <= 300 terms of size ~1 in another order: a few ulps of the outputs' ~1.
    torch.testing.assert_close(out, _reference(q, k, v, D ** -0.5), rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow():
    """The online softmax subtracts each row's running max: scores of ~1e3 are fine."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(80, 2, 64, generator=g) * 6 for _ in range(3))
    out = pa.prefill_attention(q, k, v, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(q, k, v, 1.0), rtol=1e-4, atol=1e-4)


def test_bfloat16_inputs_are_attended_in_float32(monkeypatch):
    monkeypatch.setattr(pa, "tiles_on", lambda: False)   # the widened path, AMX or not
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(48, 4, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    out = pa.prefill_attention(q, k, v, 0.125)
    assert out.dtype == torch.bfloat16
    expected = _reference(*(t.float() for t in (q, k, v)), 0.125).to(torch.bfloat16)
    # Both round a float32 result once; float32 sums in another order may fall on either side of a
    # bfloat16 rounding boundary: at most one bf16 step (2^-8 relative) apart.
    torch.testing.assert_close(out, expected, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("flags,tiles,routed", [({"avx512f", "avx512_bf16"}, False, True),
                                                ({"avx512f", "amx_tile", "amx_bf16"}, True, True),
                                                ({"avx512f", "amx_tile", "amx_bf16"}, False, False)])
def test_bfloat16_chunks_go_to_sdpa_only_where_amx_is_there_but_off(monkeypatch, flags, tiles, routed):
    """No AMX: widened to float32 here. AMX and its tiles on: here, on the tiles. AMX with the
    tiles off (MINSERVE_AMX=off): PyTorch's SDPA, which multiplies on them itself."""
    monkeypatch.setattr(pa, "cpu_flags", lambda: flags)
    monkeypatch.setattr(pa, "tiles_on", lambda: tiles)
    pa._routes_bf16_here.cache_clear()
    try:
        q = torch.zeros(32, 4, 64, dtype=torch.bfloat16)
        assert pa.applies(q, 64) is routed
        assert pa.applies(q.float(), 64)          # float32 always takes the kernel
    finally:
        pa._routes_bf16_here.cache_clear()


def test_amx_off_keeps_bfloat16_off_the_tiles(monkeypatch):
    monkeypatch.setenv("MINSERVE_AMX", "off")
    pa.tiles_on.cache_clear()
    try:
        assert pa.tiles_on() is False
    finally:
        pa.tiles_on.cache_clear()


needs_tiles = pytest.mark.skipif(not pa.tiles_on(), reason="no AMX tiles on this CPU (or MINSERVE_AMX=off)")


@needs_tiles
def test_the_tiles_softmax_exp_is_within_its_bound():
    """The softmax's exp (Taylor terms to r^5 after the 2^n split): relative error < 4e-6 (the
    remainder r^6 e^|r| / 720) over the arguments a softmax sees (score - running max <= 0), down
    to where results stay normal floats; exp(0) = 1 exactly (a row whose max did not move keeps its
    sum unscaled)."""
    import ctypes
    x = torch.cat([torch.linspace(-80.0, 0.0, 160_000), torch.zeros(16)]).contiguous()
    out = x.clone()
    pa._library().ms_exp_for_bf16(ctypes.cast(out.data_ptr(), pa._f32p), ctypes.c_int64(out.numel()))
    exact = x.double().exp()
    assert ((out.double() - exact).abs() / exact).max() < 4e-6
    assert (out[-16:] == 1.0).all()


@needs_tiles
@pytest.mark.parametrize("T,ctx,H,Hkv,D", SHAPES)
def test_bfloat16_on_the_tiles_is_causal_attention(T, ctx, H, Hkv, D):
    """As PyTorch's bf16 SDPA does on CPU, the result is the exact attention of the bf16 inputs
    rounded once: scores of bf16 products summed and scaled in float32, probabilities carried in two
    bf16 halves. So (nearly) every output is the float64 result rounded to bf16, and none is more
    than a bf16 step off (plus float32 summation noise where outputs cancel to near zero). A wrong
    mask, a packing slip or a lost rescale is off by the values' own size; probabilities in one
    bf16 half, or queries scaled before their rounding (D = 128), leave a third of the outputs off
    by a step."""
    g = torch.Generator().manual_seed(T * 1000 + ctx + 7)
    q, k, v = (torch.randn(n, h, D, generator=g).to(torch.bfloat16)
               for n, h in ((T, H), (ctx + T, Hkv), (ctx + T, Hkv)))
    out = pa.prefill_attention(q, k, v, D ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H, D)
    exact = _reference(q.double(), k.double(), v.double(), D ** -0.5)
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-4)
    assert (out == exact.float().to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.parametrize("case", ["short", "float16", "head_dim_80"])
def test_what_the_kernel_does_not_take_returns_none(case):
    T, D, dtype = {"short": (pa.MIN_QUERY_LEN - 1, 64, torch.float32),
                   "float16": (32, 64, torch.float16), "head_dim_80": (32, 80, torch.float32)}[case]
    q, k = torch.zeros(T, 2, D, dtype=dtype), torch.zeros(T, 2, D, dtype=dtype)
    assert pa.prefill_attention(q, k, k, 1.0) is None


def test_mismatched_shapes_name_both():
    with pytest.raises(ValueError, match=r"keys \(20, 2, 64\)"):
        pa.prefill_attention(torch.zeros(32, 4, 64), torch.zeros(20, 2, 64), torch.zeros(20, 2, 64), 1.0)


def test_bfloat16_queries_take_float32_keys_and_values():
    """An int8 KV cache dequantizes to float32 while a bf16 engine's queries are bf16: the kernel
    must attend to those values, not read their float32 bytes as bf16 ones (it did, on the tiles:
    NaN from the first position, 2026-12-06)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(40, 9, 64, generator=g).to(torch.bfloat16)
    k, v = torch.randn(70, 3, 64, generator=g), torch.randn(70, 3, 64, generator=g)
    out = pa.prefill_attention(q, k, v, 0.125)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # Outputs ~0.18 in size: bf16 rounding of the output (2^-9 relative) and, on the tiles, of the
    # keys and values (measured: at most 0.0046 from the float64 result on either path).
    expected = _reference(q.double(), k.double(), v.double(), 0.125)
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=1e-2)


def test_the_switch_is_checked(monkeypatch):
    monkeypatch.setenv("MINSERVE_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError, match="MINSERVE_PREFILL_ATTENTION must be one of c, sdpa"):
        pa.choice()


def _greedy(monkeypatch, switch, prompts, **engine):
    monkeypatch.setenv("MINSERVE_PREFILL_ATTENTION", switch)
    calls = []   # queries per sequence of every call (float32 chunks read the paged cache in place)
    inner, paged = pa.prefill_attention, pa.prefill_attention_paged
    monkeypatch.setattr("minserve.attention.torch_paged.prefill_attention",
                        lambda *a, **k: calls.append(a[0].shape[0]) or inner(*a, **k))
    monkeypatch.setattr("minserve.attention.torch_paged.prefill_attention_paged",
                        lambda *a, **k: calls.append(a[0].shape[0] // len(a[3])) or paged(*a, **k))
    # A 64-token step budget: long prompts arrive in chunks, the later ones over cached context;
    # prefix caching makes the repeated prompt start from cached blocks.
    llm = LLM("smollm2-135m", max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="64MiB",
              enable_prefix_caching=True, **engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                     o.outputs[0].token_ids)])
            for o in outs], calls


def test_the_engine_prefills_through_the_kernel_with_sdpa_s_outputs(monkeypatch):
    g = torch.Generator().manual_seed(11)
    base = torch.randint(100, 40000, (150,), generator=g).tolist()
    prompts = [base, base[:40] + [7] * 30, torch.randint(100, 40000, (20,), generator=g).tolist(), base]
    with_c, calls = _greedy(monkeypatch, "c", prompts)
    with_sdpa, none = _greedy(monkeypatch, "sdpa", prompts)
    assert calls and min(calls) >= pa.MIN_QUERY_LEN and none == []
    for (ids_c, lp_c), (ids_s, lp_s) in zip(with_c, with_sdpa):
        assert ids_c == ids_s
        torch.testing.assert_close(torch.tensor(lp_c), torch.tensor(lp_s), rtol=0, atol=2e-3)


@needs_tiles
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_bfloat16_engine_prefills_on_the_tiles_with_sdpa_s_outputs(monkeypatch, kv_cache_dtype):
    """The same prompts (chunked, over cached context) through a dtype="bfloat16" engine: the tiles
    and PyTorch's bf16 SDPA pick the same first token (the one the prompt's attention decides). A bf16
    engine's later tokens and log-probabilities move with any change of summation order in any of
    its products: on these prompts the tiles, float32-widened attention and SDPA differed by
    0.08-0.35 in a log-probability (2026-12-06, with bf16 products on AMX tiles for 16-128 rows);
    an earlier version of the tiles, and the products in oneDNN, moved them by up to 0.63 and one
    later token. A wrong mask or a lost rescale moves them by whole units."""
    g = torch.Generator().manual_seed(12)
    base = torch.randint(100, 40000, (150,), generator=g).tolist()
    prompts = [base, base[:40] + [9] * 30, torch.randint(100, 40000, (20,), generator=g).tolist(), base]
    engine = dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    with_tiles, calls = _greedy(monkeypatch, "c", prompts, **engine)
    with_sdpa, _ = _greedy(monkeypatch, "sdpa", prompts, **engine)
    assert calls
    for (ids_c, lp_c), (ids_s, lp_s) in zip(with_tiles, with_sdpa):
        assert ids_c[0] == ids_s[0]
        torch.testing.assert_close(lp_c[0], lp_s[0], rtol=0, atol=0.75)
