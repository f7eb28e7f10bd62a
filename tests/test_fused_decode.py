"""The fused C decode step computes what the PyTorch model computes, and the engine uses it.

The PyTorch path is itself checked token for token against transformers (test_models.py,
test_correctness_vs_transformers.py run both paths); here the two paths are compared directly on
logits and on the K/V they write, for every architecture variant, with batches of sequences whose
block tables are scattered across the pool and whose contexts cross block boundaries.
"""

import copy
import ctypes
import shutil

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.attention import build_attention_metadata
from minserve.kernels import build as kernel_build
from minserve.kernels.build import KernelUnavailable
from minserve.kernels.decode import FusedDecoder
from minserve.models.loader import _smollm2_tokenizer_dir
from minserve.models.tiny import write_tiny_model
from conftest import assert_all_blocks_free
from variants import VARIANTS

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the fused decode kernel cannot be built"),
              pytest.mark.usefixtures("sdpa_reference")]   # conftest.py says why


CONTEXTS = [5, 70, 600]  # one block, several, and past the kernel's initial softmax scratch (256)
# Nine rows: at one or two threads, attention takes one work item per row (every kv head of the
# row together); three rows: one per (row, kv head). Both must compute what PyTorch computes.
WIDE_CONTEXTS = [5, 70, 600, 16, 33, 1, 250, 47, 129]


def _scattered_tables(contexts: list[int], num_blocks: int, block_size: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled block tables: attention must follow the table, not assume order."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, i = [], 0
    for ctx in contexts:
        n = ctx // block_size + 1
        tables.append(order[i:i + n])
        i += n
    return tables


@pytest.mark.parametrize("contexts", [CONTEXTS, WIDE_CONTEXTS], ids=["3-rows", "9-rows"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_step_matches_torch_forward(variant, contexts, tmp_path):
    path = write_tiny_model(tmp_path / variant, seed=5, tokenizer_dir=_smollm2_tokenizer_dir(),
                            overrides=VARIANTS[variant])
    _check_fused_step_against_torch(path, contexts, block_size=16)


@pytest.mark.parametrize("block_size", [8, 32])
def test_fused_step_matches_torch_forward_at_other_block_sizes(block_size, tmp_path):
    """Attention walks keys in runs of a vector's width (16 floats on AVX-512, 8 on AVX2): with
    8-slot blocks a run spans two blocks, with 32-slot blocks a block holds two runs."""
    path = write_tiny_model(tmp_path / "llama", seed=5, tokenizer_dir=_smollm2_tokenizer_dir())
    _check_fused_step_against_torch(path, WIDE_CONTEXTS, block_size=block_size)


def _check_fused_step_against_torch(path, contexts: list[int], block_size: int) -> None:
    llm = LLM(str(path), num_kv_blocks=128 * 16 // block_size, block_size=block_size, fused_decode=True,
              max_model_len=1024, device="cpu")
    runner = llm.llm_engine.runner
    bs = runner.block_size
    torch.manual_seed(0)
    for k, v in runner.kv_caches:  # a populated cache: random keys/values as earlier steps left them
        k.normal_()
        v.normal_()
    assert bs == block_size
    tables = _scattered_tables(contexts, 128 * 16 // bs, bs, seed=1)
    meta = build_attention_metadata([1] * len(contexts), contexts, tables, bs)
    ids, pos = torch.tensor([17, 4000, 123, 9, 77, 2048, 5, 300, 31][:len(contexts)]), torch.tensor(contexts)
    rows = torch.tensor([2, 0])  # logits for a subset of the rows, in another order
    slots = meta.slot_mapping

    ref = runner.model(ids, pos, runner.kv_caches, meta, rows)
    ref_kv = [(k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots].clone())
              for k, v in runner.kv_caches]
    for k, v in runner.kv_caches:  # forget the new tokens' K/V: the fused step must write them itself
        k.view(-1, *k.shape[2:])[slots] = 0
        v.view(-1, *v.shape[2:])[slots] = 0
    out = runner.fused(ids, pos, meta.groups[0].kv_blocks, rows)

    assert out.shape == ref.shape == (2, llm.llm_engine.model_config.vocab_size)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    for (k, v), (rk, rv) in zip(runner.kv_caches, ref_kv):
        torch.testing.assert_close(k.view(-1, *k.shape[2:])[slots], rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v.view(-1, *v.shape[2:])[slots], rv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch,in_features,out_features",
                         [(1, 576, 960), (11, 37, 5), (3, 16, 33), (16, 40, 19), (7, 1536, 66)])
@pytest.mark.parametrize("accumulate", [0, 1])
def test_matmul_kernel_matches_linear(batch, in_features, out_features, accumulate):
    """Odd sizes (tails shorter than a vector, more inputs than one pass, rows a block of 4 leaves
    over: 19 = 4 x 4 + 3, 16 inputs = 6 + 6 + 4) and the residual mode."""
    lib = kernel_build.load("decode")
    g = torch.Generator().manual_seed(batch)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x, y = torch.randn(batch, in_features, generator=g), torch.randn(batch, out_features, generator=g)
    expected = torch.nn.functional.linear(x, w, b) + (y if accumulate else 0)
    f32 = ctypes.POINTER(ctypes.c_float)
    lib.ms_matmul(*(ctypes.cast(t.data_ptr(), f32) for t in (w, b, x, y)), ctypes.c_int64(batch),
                  ctypes.c_int64(in_features), ctypes.c_int64(out_features), accumulate)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


def test_engine_runs_decode_steps_through_the_kernel(monkeypatch):
    calls = []  # rows of every kernel call, whichever runner object holds the decoder
    inner = FusedDecoder.__call__
    monkeypatch.setattr(FusedDecoder, "__call__",
                        lambda self, ids, *args: calls.append(len(ids)) or inner(self, ids, *args))
    llm = LLM("tiny-llama", num_kv_blocks=64, max_num_batched_tokens=64, fused_decode=True,
              device="cpu")
    eng = llm.llm_engine
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (3, 90, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    # Every all-decode step went through the kernel with all its sequences, in step order (short
    # mixed steps may go through it too: that is the runner's choice, see FusedDecoder.supports).
    decode_only = [s.num_decode_tokens for s in eng.step_stats if s.num_prefill_tokens == 0]
    remaining = iter(calls)
    assert all(any(rows == n for rows in remaining) for n in decode_only), (decode_only, calls)
    assert sum(decode_only) > 0
    assert_all_blocks_free(llm)


def test_fused_decode_config_errors_and_fallback():
    with pytest.raises(ValueError, match="fused_decode must be None"):
        LLM("tiny-llama", num_kv_blocks=8, fused_decode="yes")
    with pytest.raises(ValueError, match="fused_decode=True.*float32 or bfloat16"):
        LLM("tiny-llama", num_kv_blocks=8, dtype="float16", fused_decode=True, device="cpu")
    auto = LLM("tiny-llama", num_kv_blocks=8, dtype="float16", device="cpu")  # auto: falls back to PyTorch
    assert auto.llm_engine.runner.fused is None
    out = auto.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert LLM("tiny-llama", num_kv_blocks=8, fused_decode=False).llm_engine.runner.fused is None


def test_a_bfloat16_model_decodes_in_the_kernel_as_its_float32_widening_would():
    """bfloat16 weights, embeddings and KV cache, widened exactly as they stream in: the kernel's
    logits for a bf16 model equal its logits for the same model widened to float32 (with a float32
    cache holding the same bf16-rounded keys), so its only rounding is the cache's on write."""
    bf = LLM("tiny-llama", num_kv_blocks=16, dtype="bfloat16", fused_decode=True, device="cpu")
    assert bf.llm_engine.runner.fused is not None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": list(range(300, 300 + n))} for n in (5, 33)]
    outs = bf.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert_all_blocks_free(bf)
    runner = bf.llm_engine.runner
    wide_caches = [(k.float(), v.float()) for k, v in runner.kv_caches]
    wide = FusedDecoder(copy.deepcopy(runner.model).float(), wide_caches, max_rows=4)
    narrow = runner.fused
    ids, pos = torch.tensor([7, 9]), torch.tensor([3, 20])
    tables = torch.tensor([[0, 1], [2, 3]])
    rows = torch.arange(2)
    # Same rows into both caches. Every product is the same float32 arithmetic on the same
    # values; only each row's own new key and value differ, rounded to bf16 (2^-9 relative) in
    # the narrow cache: the logits may move by a fraction of one bf16 step of their largest
    # (measured: 0.026 of 36.7, 1/5 of the bound).
    # Two rows take AVX-512 BF16 dot products where the CPU has them, which round each input to
    # bf16 (tests/test_bf16_dot.py): turned off here, as are the tiles, to compare the widening.
    narrow._lib.ms_amx(0)
    narrow._lib.ms_bf16_dot(0)
    try:
        got, want = narrow(ids, pos, tables, rows), wide(ids, pos, tables, rows)
    finally:
        narrow._lib.ms_amx(1)
        narrow._lib.ms_bf16_dot(1)
    torch.testing.assert_close(got, want, rtol=0, atol=2 ** -8 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Layer 0's new K/V come from identical float32 arithmetic in both (its input is the embedding):
    # the bf16 cache must hold exactly PyTorch's rounding of the float32 one (nearest, ties to even).
    bs = runner.block_size
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables.tolist(), pos.tolist())]
    for narrow_cache, wide_cache in zip(runner.kv_caches[0], wide_caches[0]):
        flat_n = narrow_cache.view(-1, *narrow_cache.shape[2:])
        flat_w = wide_cache.view(-1, *wide_cache.shape[2:])
        assert torch.equal(flat_n[slots], flat_w[slots].to(torch.bfloat16))


def test_kernel_build_is_cached_and_keyed_by_flags(tmp_path, monkeypatch):
    # token_ops: the same build() as decode's, compiled in 0.4 s instead of decode.c's ~20.
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path))
    first = kernel_build.build("token_ops")
    mtime = first.stat().st_mtime_ns
    assert kernel_build.build("token_ops") == first and first.stat().st_mtime_ns == mtime  # reused
    monkeypatch.setattr(kernel_build, "FLAGS", kernel_build.FLAGS + ["-DMINSERVE_TEST_FLAG"])
    assert kernel_build.library_path("token_ops") != first  # other flags, other binary
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]  # no temp files left


@pytest.mark.parametrize("vendor,flags", [("AuthenticAMD", ["-DMS_PREFETCH_L2"]), ("GenuineIntel", []), ("", [])])
def test_kernels_are_built_for_the_cpus_maker(monkeypatch, vendor, flags):
    """AMD gets its prefetches into L2 (quant_dot.h's PREFETCH_AHEAD), everyone else into L1; the
    define is part of the build's key, so one cache shared by two makers holds two binaries."""
    real_info = kernel_build.cpu_info
    monkeypatch.setattr(kernel_build, "cpu_info",
                        lambda *fields: vendor if fields == ("vendor_id",) else real_info(*fields))
    assert kernel_build.vendor_flags() == flags
    key = kernel_build.library_path("token_ops")
    monkeypatch.setattr(kernel_build, "vendor_flags", lambda: flags + ["-DMINSERVE_TEST_FLAG"])
    assert kernel_build.library_path("token_ops") != key


def test_missing_compiler_or_unwritable_cache_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelUnavailable, match="no-such-cc"):
        kernel_build.build("decode")
    monkeypatch.delenv("CC")
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path / "file"))
    with pytest.raises(KernelUnavailable, match="cannot create the kernel cache"):
        kernel_build.build("decode")


def test_vectorized_exp_matches_torch_exp():
    """Softmax and SiLU use the kernel's own 16-wide exp: compare it with torch.exp in float64."""
    lib = kernel_build.load("decode")
    lib.ms_exp_shifted.restype = ctypes.c_float
    tail = torch.randn(999, generator=torch.Generator().manual_seed(179)) * 10  # a tail of 999 % 16
    x = torch.cat([torch.linspace(-100, 100, 20001), tail])
    got = x.clone()
    total = lib.ms_exp_shifted(ctypes.cast(got.data_ptr(), ctypes.POINTER(ctypes.c_float)),
                               ctypes.c_int64(got.numel()), ctypes.c_float(1.5))
    exact = torch.exp((x - 1.5).double())  # the shift is applied in float32, as in the kernel
    # Outside [exp(-87), exp(88)] the kernel clamps: softmax weights that small vanish anyway, and
    # exp(-g) beyond exp(88) already makes SiLU's g / (1 + exp(-g)) zero to float precision.
    in_range = (exact > 1e-37) & (exact < 1e38)
    rel = ((got.double() - exact).abs() / exact)[in_range]
    assert rel.max() < 1e-6, f"max relative error {rel.max():.2e}"
    assert (got[exact <= 1e-37] < 1e-37).all() and (got[exact >= 1e38] > 1e38).all()
    assert torch.isfinite(got).all()
    assert total == float("inf")  # the float sum of values up to 1e38 overflows, as it would in C
    # softmax's use: shift by the max, sum the weights
    scores = torch.randn(1001, generator=torch.Generator().manual_seed(192)) * 5
    weights = scores.clone()
    total = lib.ms_exp_shifted(ctypes.cast(weights.data_ptr(), ctypes.POINTER(ctypes.c_float)),
                               ctypes.c_int64(weights.numel()), ctypes.c_float(scores.max()))
    torch.testing.assert_close(weights, torch.exp(scores - scores.max()), rtol=1e-6, atol=0)
    assert abs(total - float(weights.double().sum())) <= 1e-5 * total


def test_engine_falls_back_with_a_warning_when_the_kernel_cannot_build(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    # Bypass the library this process already loaded: the engine must try (and fail) to build.
    monkeypatch.setattr("minserve.kernels.decode.load", kernel_build.load.__wrapped__)
    with caplog.at_level("WARNING", logger="minserve"):
        llm = LLM("tiny-llama", num_kv_blocks=16, device="cpu")
    assert llm.llm_engine.runner.fused is None
    assert any("decode steps run in PyTorch" in r.message and "no-such-cc" in r.message
               for r in caplog.records if r.levelname == "WARNING")
    out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="fused_decode=True.*no-such-cc"):
        LLM("tiny-llama", num_kv_blocks=16, fused_decode=True, device="cpu")


def test_kernel_call_rejects_indices_that_would_leave_its_buffers():
    llm = LLM("tiny-llama", num_kv_blocks=8, max_num_seqs=2, fused_decode=True, device="cpu")
    fused = llm.llm_engine.runner.fused
    ids, pos, tables, rows = torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([[0], [1]]), torch.tensor([0, 1])
    assert fused(ids, pos, tables, rows).shape == (2, llm.llm_engine.model_config.vocab_size)
    bad = {
        "int64": (ids.int(), pos, tables, rows),
        # The scratch holds max_num_seqs x MAX_FUSED_QUERY_LEN = 16 rows: 17 do not fit.
        "batch": (torch.ones(17, dtype=torch.long), torch.arange(17), torch.zeros(17, 2, dtype=torch.long), rows),
        "positions": (ids, torch.tensor([3, 16]), tables, rows),        # one block holds 0..15
        "block ids": (ids, pos, torch.tensor([[0], [8]]), rows),        # the pool has blocks 0..7
        "logit rows": (ids, pos, tables, torch.tensor([2])),
    }
    for what, args in bad.items():
        with pytest.raises(ValueError, match=what):
            fused(*args)
