"""The PyTorch path's decode rows in the fused step's attention (kernels/paged_attention.py) against
the same rows in SDPA over gathered blocks: every cache format, scattered block tables, contexts
that cross blocks, and groups of several rows a sequence (speculative verification), where each row
must see only the keys up to its own position."""

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.attention import build_attention_metadata
from minserve.attention.torch_paged import TorchPagedAttention
from minserve.kernels import paged_attention as paged
from minserve.kernels.triton.reference import write_kv_int8

if paged._library() is None:
    pytest.skip("no C compiler: the kernel cannot be built here", allow_module_level=True)

H, HKV, D, BLOCK, BLOCKS = 9, 3, 64, 16, 64


def _step(cache_dtype, query_len: int, seed: int):
    """A step's metadata, its new q/k/v and a cache full of earlier tokens: sequences with 1-300
    cached tokens whose blocks lie shuffled across the pool."""
    g = torch.Generator().manual_seed(seed)
    contexts = [5, 70, 300, 16, 33, 1]
    order = torch.randperm(BLOCKS, generator=g).tolist()
    tables, i = [], 0
    for c in contexts:
        n = (c + query_len) // BLOCK + 1
        tables.append(order[i:i + n])
        i += n
    meta = build_attention_metadata([query_len] * len(contexts), contexts, tables, BLOCK)
    dtype = torch.float32 if cache_dtype is torch.int8 else cache_dtype
    rows = query_len * len(contexts)
    q, k, v = (torch.randn(rows, h, D, generator=g).to(dtype) for h in (H, HKV, HKV))
    old_k, old_v = (torch.randn(BLOCKS * BLOCK, HKV, D, generator=g) for _ in range(2))
    if cache_dtype is torch.int8:
        caches = [torch.zeros(BLOCKS, BLOCK, HKV, D, dtype=torch.int8) for _ in range(2)]
        caches += [torch.zeros(BLOCKS, BLOCK, HKV) for _ in range(2)]
        write_kv_int8(caches[0], caches[2], torch.arange(BLOCKS * BLOCK), old_k)
        write_kv_int8(caches[1], caches[3], torch.arange(BLOCKS * BLOCK), old_v)
    else:
        caches = [t.view(BLOCKS, BLOCK, HKV, D).to(cache_dtype) for t in (old_k, old_v)]
    return meta, (q, k, v), caches


def _attend(monkeypatch, switch, meta, qkv, caches):
    monkeypatch.setenv("MINSERVE_PREFILL_ATTENTION", switch)
    calls = []
    inner = paged.paged_attention
    monkeypatch.setattr(paged, "paged_attention", lambda *a: calls.append(a[0].shape[0]) or inner(*a))
    out = TorchPagedAttention(H, HKV, D)(*qkv, *[c.clone() for c in caches[:2]], meta,
                                          *[c.clone() for c in caches[2:]])
    return out, calls


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("query_len", [1, 3])
def test_decode_rows_in_the_kernel_are_sdpa_s_attention(monkeypatch, cache_dtype, query_len):
    meta, qkv, caches = _step(cache_dtype, query_len, seed=query_len)
    out, calls = _attend(monkeypatch, "c", meta, qkv, caches)
    ref, none = _attend(monkeypatch, "sdpa", meta, qkv, caches)
    assert calls == [6 * query_len] and none == [] and out.dtype == ref.dtype == qkv[0].dtype
    if cache_dtype is torch.bfloat16:
        # The kernel sums in float32 and rounds once: (nearly) every output is the exact attention
        # of the bf16 inputs rounded to bf16, none more than a step off. SDPA's masked bf16 path
        # rounds its intermediate products to bf16: 68 % of its outputs are the exact ones rounded
        # (2026-12-06), so it is compared on average only.
        exact, _ = _attend(monkeypatch, "sdpa", meta, tuple(t.double() for t in qkv), [c.double() for c in caches])
        err = (out.double() - exact).abs()
        assert (err <= 2 ** -8 * exact.abs() + 1e-6).all()
        assert (out == exact.float().to(torch.bfloat16)).float().mean() > 0.99
        assert err.mean() < (ref.double() - exact).abs().mean()
    else:
        # float32 sums of <= 303 terms in another order (int8: the scale folded into the score
        # and the weight, not into a dequantized copy): a few float32 ulps of outputs ~1.
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


def test_a_row_sees_only_the_keys_up_to_its_own_position(monkeypatch):
    """Three rows of one sequence over the same table: each attends to one more key, so the
    outputs differ, and each equals the attention of a lone decode row at that position."""
    meta, (q, k, v), caches = _step(torch.float32, 3, seed=9)
    out, _ = _attend(monkeypatch, "c", meta, (q, k, v), caches)
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])
    g = meta.groups[0]
    k_cache, v_cache = (c.clone() for c in caches)
    TorchPagedAttention(H, HKV, D)(q, k, v, k_cache, v_cache, meta)   # writes the step's K/V
    for r in range(3):
        alone = paged.paged_attention(q[r:r + 1], (k_cache, v_cache, None, None), g.row_tables[r:r + 1],
                                      g.row_positions[r:r + 1], D ** -0.5)
        torch.testing.assert_close(alone[0], out[r], rtol=0, atol=0)


def test_positions_past_the_table_are_refused_with_the_sizes():
    meta, (q, _, _), caches = _step(torch.float32, 1, seed=2)
    g = meta.groups[0]
    with pytest.raises(ValueError, match=r"paged_attention: 6 query rows, tables \(6, \d+\).*positions"):
        paged.paged_attention(q, (*caches, None, None), g.row_tables, g.row_positions + 10_000, D ** -0.5)
    with pytest.raises(ValueError, match=f"of {BLOCKS} blocks"):
        paged.paged_attention(q, (*caches, None, None), g.row_tables + BLOCKS, g.row_positions, D ** -0.5)


def test_int8_scales_it_cannot_read_as_float32_are_declined():
    """The C side reads the scales as float32 [blocks, block_size, Hkv]: any other dtype or a
    shorter tensor would be read out of bounds, so the kernel declines (SDPA takes the rows)."""
    meta, (q, _, _), caches = _step(torch.int8, 1, seed=3)
    g = meta.groups[0]
    k, v, ks, vs = caches
    args = (g.row_tables, g.row_positions, D ** -0.5)
    assert paged.paged_attention(q, (k, v, ks, vs), *args) is not None
    assert paged.paged_attention(q, (k, v, ks.to(torch.bfloat16), vs), *args) is None
    assert paged.paged_attention(q, (k, v, ks, vs[:-1]), *args) is None


def test_a_mixed_step_s_decode_rows_take_the_kernel_with_sdpa_s_outputs(monkeypatch):
    """An engine whose prompts arrive in 48-token chunks while earlier requests decode: the mixed
    steps' decode rows go to the kernel, and greedy tokens and log-probabilities are SDPA's."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (30, 200, 90, 150)]

    def run(switch):
        monkeypatch.setenv("MINSERVE_PREFILL_ATTENTION", switch)
        calls = []
        inner = paged.paged_attention
        monkeypatch.setattr(paged, "paged_attention", lambda *a: calls.append(a[0].shape[0]) or inner(*a))
        llm = LLM("smollm2-135m", max_num_seqs=4, max_num_batched_tokens=48, kv_cache_memory="64MiB",
                  enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                         o.outputs[0].token_ids)])
                for o in outs], calls

    with_c, calls = run("c")
    with_sdpa, none = run("sdpa")
    assert calls and none == []
    for (ids_c, lp_c), (ids_s, lp_s) in zip(with_c, with_sdpa):
        assert ids_c == ids_s
        torch.testing.assert_close(torch.tensor(lp_c), torch.tensor(lp_s), rtol=0, atol=1e-3)
