"""kv_cache_dtype="int8": K/V stored as int8 codes with a float32 scale per (token slot, kv head).

The pool holds 4 x head_dim / (head_dim + 4) times the tokens of fp32 in the same memory (the same
bytes-per-token function sizes the engine's pool and minserve.plan's); greedy outputs stay close to
fp32's (measured bounds below); prefix caching, preemption and block accounting work unchanged;
the KV dtype is part of the prefix-cache key; bad arguments are named."""

import logging

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.attention import StepSequences
from minserve.attention.metadata import build_attention_metadata
from minserve.attention.torch_paged import TorchPagedAttention
from minserve.config import EngineConfig
from minserve.engine.kv_cache import extra_keys_digest, kv_cache_bytes_per_token
from minserve.engine.llm_engine import model_fingerprint
from minserve.kernels.decode import unsupported_reason
from minserve.kernels import paged_attention as paged
from minserve.kernels.triton.reference import dequantize_kv_int8, quantize_kv_int8, write_kv_int8
from minserve.models.loader import _smollm2_tokenizer_dir, load_model
from minserve.models.registry import ModelConfig
from minserve.models.tiny import TINY_CONFIG, write_tiny_model
from minserve.plan import plan
from conftest import assert_all_blocks_free, generate_ids

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "Explain why the sky is blue.", "Once upon a time, in a small village,",
           "List three uses of a paperclip:", "The quick brown fox", "What is 17 times 23?",
           "Translate 'good morning' into Spanish.", "In machine learning, overfitting means"]
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=256)


@pytest.fixture(scope="module")
def int8_llm():
    """The torch backend over an int8 cache (the fused C step, where it reads int8, is checked
    against it below)."""
    return LLM("tiny-llama", kv_cache_dtype="int8", fused_decode=False, **ENGINE)


def _prompt_ids(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


# ---- capacity: bytes per token, blocks, layout ---------------------------------------------------

@pytest.mark.parametrize("head_dim", [16, 64])
def test_pool_holds_4x_the_tokens_less_the_scales(head_dim, tmp_path):
    name = "tiny-llama" if head_dim == 16 else str(write_tiny_model(
        tmp_path / "d64", seed=3, tokenizer_dir=_smollm2_tokenizer_dir(), overrides={"head_dim": head_dim}))
    fp, q = (LLM(name, kv_cache_memory="8MiB", kv_cache_dtype=d).llm_engine for d in ("auto", "int8"))
    layers, heads = TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_key_value_heads"]
    assert fp.kv_spec.bytes_per_token == 2 * layers * heads * head_dim * 4
    assert q.kv_spec.bytes_per_token == 2 * layers * heads * (head_dim + 4)
    for eng in (fp, q):
        assert eng.kv_spec.num_blocks == 8 * 2**20 // (eng.kv_spec.bytes_per_token * BS)
        tensors = [t for layer in eng.runner.kv_caches for t in layer]
        assert sum(t.numel() * t.element_size() for t in tensors) == eng.kv_spec.total_bytes
    ratio = q.kv_spec.num_blocks / fp.kv_spec.num_blocks
    assert ratio == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)  # 3.76x at 64, 3.2x at 16
    k, v, ks, vs = q.runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.int8 and ks.dtype == vs.dtype == torch.float32
    assert k.shape == (q.kv_spec.num_blocks, BS, heads, head_dim) and ks.shape == k.shape[:3]
    assert len(fp.runner.kv_caches[0]) == 2


def test_the_planner_uses_the_engines_bytes_per_token(int8_llm):
    eng = LLM("tiny-llama", kv_cache_memory="3MiB", kv_cache_dtype="int8").llm_engine
    p = plan(ModelConfig.from_hf(TINY_CONFIG), hardware="h100", precision="fp32", kv_cache_memory="3MiB",
             kv_cache_dtype="int8")
    assert p.kv_bytes_per_token == eng.kv_spec.bytes_per_token == kv_cache_bytes_per_token(
        eng.model_config, "int8")
    assert p.num_kv_blocks == eng.kv_spec.num_blocks
    assert "int8" in p.table()
    # In "auto", the KV dtype follows the activations: bf16 halves fp32, int8 ignores the dtype.
    cfg = eng.model_config
    assert kv_cache_bytes_per_token(cfg, "auto", "bfloat16") * 2 == kv_cache_bytes_per_token(cfg, "auto")
    assert kv_cache_bytes_per_token(cfg, "int8", "bfloat16") == kv_cache_bytes_per_token(cfg, "int8")


# ---- the torch backend: quantize on write, dequantize after the gather -----------------------------

def test_torch_attention_over_int8_is_attention_over_the_dequantized_cache():
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, blocks = 4, 2, 16, 12
    op = TorchPagedAttention(H, Hkv, D)
    # A decode group (3 sequences, scattered tables) and a prefill chunk on top of a context.
    q_lens, ctx, tables = [1, 1, 1, 5], [20, 3, 33, 17], [[7, 2], [5], [0, 9, 4], [11, 1]]
    meta = build_attention_metadata(q_lens, ctx, tables, BS)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv))
    codes = [torch.randint(-127, 128, (blocks, BS, Hkv, D), generator=g, dtype=torch.int8) for _ in range(2)]
    scales = [torch.rand(blocks, BS, Hkv, generator=g) / 50 for _ in range(2)]
    fp = [dequantize_kv_int8(c, s) for c, s in zip(codes, scales)]
    out = op(q, k, v, *codes, meta, *scales)
    # What was written: quantize_kv_int8 of the new K/V, in their slots.
    kc, ksc = quantize_kv_int8(k)
    assert torch.equal(codes[0].view(-1, Hkv, D)[meta.slot_mapping], kc)
    assert torch.equal(scales[0].view(-1, Hkv)[meta.slot_mapping], ksc)
    # The same attention over a float cache of the dequantized values, new tokens included.
    dq_k, dq_v = (dequantize_kv_int8(*quantize_kv_int8(x)) for x in (k, v))
    torch.testing.assert_close(out, op(q, dq_k, dq_v, *fp, meta), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(paged._library() is None, reason="no C compiler: the C kernels cannot be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_writer_stores_the_bits_the_torch_reference_stores(dtype):
    """The PyTorch path quantizes new K/V into an int8 cache in C (paged_attention.write_kv_int8):
    the codes and scales of write_kv_int8's torch form, bit for bit, in the given slots only; an
    all-zero vector stays zeros with scale 0; a slot past the cache is refused, naming the range."""
    g = torch.Generator().manual_seed(3)
    blocks, Hkv, D, T = 6, 3, 64, 40
    x = (torch.randn(T, Hkv, D, generator=g) * torch.logspace(-3, 3, T)[:, None, None]).to(dtype)
    x[5, 1] = 0
    slots = torch.randperm(blocks * BS, generator=g)[:T]
    want, got = ((torch.full((blocks, BS, Hkv, D), 9, dtype=torch.int8), torch.full((blocks, BS, Hkv), -1.0))
                 for _ in range(2))
    write_kv_int8(*want, slots, x)
    assert paged.write_kv_int8(*got, slots, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].view(-1, Hkv)[slots[5], 1] == 0 and not got[0].view(-1, Hkv, D)[slots[5], 1].any()
    untouched = torch.ones(blocks * BS, dtype=torch.bool)
    untouched[slots] = False
    assert (got[0].view(-1, Hkv, D)[untouched] == 9).all()
    with pytest.raises(ValueError, match=f"slots 0..{blocks * BS} outside the cache's {blocks * BS} slots"):
        paged.write_kv_int8(*got, torch.tensor([0, blocks * BS]), x[:2])
    assert not paged.write_kv_int8(got[0].float(), got[1], slots, x)   # a float cache: not this writer


# ---- quality: close to fp32 --------------------------------------------------------------------

def _first_step_logits(llm, prompt_ids):
    """Logits after each prompt, through the engine's own model and KV cache (prefill attention
    reads the cache, so int8 K/V are already in play)."""
    r = llm.llm_engine.runner
    out = []
    for ids in prompt_ids:
        n = len(ids)
        meta = r.layer_backend.build_metadata(StepSequences([n], [0], [list(range(-(-n // BS)))]))
        out.append(r.model(torch.tensor(ids), torch.arange(n), r.kv_caches, meta, torch.tensor([n - 1]))[0])
    return out


def test_greedy_outputs_stay_close_to_fp32(tiny_llm_torch_decode, int8_llm):
    prompts = _prompt_ids(int8_llm)
    # First step: logits within 1 % of their range (measured: at most 0.58 %), same argmax.
    for a, b in zip(_first_step_logits(tiny_llm_torch_decode, prompts), _first_step_logits(int8_llm, prompts)):
        assert (a - b).abs().max() <= 0.01 * a.abs().max()
        assert a.argmax() == b.argmax()
    # 64 greedy tokens: position of the first differing token per prompt. Measured on tiny-llama
    # (2 layers, head_dim 16): [50, 26, 26, 64, 10, 1, 64, 64, 64, 64], 5 of 10 identical, mean 43.
    # (smollm2-135m: [64, 56, 64, 49, 16, 64, 31, 48, 38, 53], 3 of 10 identical, mean 48; fp32
    # torch vs fp32 fused agree on all 64 tokens of all 10.)
    fp = generate_ids(tiny_llm_torch_decode, prompts, GREEDY)
    q = generate_ids(int8_llm, prompts, GREEDY)
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(fp, q)]
    assert sum(f == 64 for f in first) >= 4, first
    assert sum(first) / len(first) >= 32, first


def test_half_precision_model_with_int8_kv(tiny_llm_torch_decode):
    llm = LLM("tiny-llama", dtype="bfloat16", kv_cache_dtype="int8", **ENGINE)
    prompts = _prompt_ids(llm)[:4]
    out = generate_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o) == 8 for o in out)
    assert llm.llm_engine.kv_spec.bytes_per_token == kv_cache_bytes_per_token(llm.llm_engine.model_config, "int8")


# ---- prefix caching, preemption, block accounting -------------------------------------------------

def _run(eng, rid, prompt, params):
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    out = None
    while eng.has_unfinished_requests():
        out = next((o for o in eng.step() if o.finished and o.request_id == rid), out)
    return out


def test_prefix_cache_hits_with_int8_kv_and_gives_the_uncached_outputs(int8_llm):
    eng = LLM("tiny-llama", kv_cache_dtype="int8", **ENGINE).llm_engine
    plain = LLM("tiny-llama", kv_cache_dtype="int8", enable_prefix_caching=False, **ENGINE).llm_engine
    shared = list(range(1000, 1000 + 3 * BS))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    _run(eng, "a", shared + [7, 8, 9], params)
    hit = _run(eng, "b", shared + [11, 12, 13, 14], params)
    assert hit.num_cached_tokens == 3 * BS
    assert sum(s.prefix_cache_hits for s in eng.step_stats) == 3 * BS
    miss = _run(plain, "b", shared + [11, 12, 13, 14], params)
    assert miss.num_cached_tokens == 0 and hit.outputs[0].token_ids == miss.outputs[0].token_ids
    for e in (eng, plain):
        assert e.kv.pool.num_free == e.kv.pool.num_blocks and not e.kv.block_tables


def test_the_kv_dtype_is_part_of_the_prefix_cache_key(tiny_llm, int8_llm):
    fp, q = tiny_llm.llm_engine, int8_llm.llm_engine
    assert fp.model_fingerprint != q.model_fingerprint
    loaded = load_model("tiny-llama")
    assert q.model_fingerprint == model_fingerprint(loaded, "float32", kv_cache_dtype="int8")
    assert fp.model_fingerprint == model_fingerprint(loaded, "float32", quantization="none")
    # Same tokens, same salt: different block hashes, so a pool could never serve one to the other.
    assert extra_keys_digest(fp.model_fingerprint, None) != extra_keys_digest(q.model_fingerprint, None)


def test_preemption_with_int8_kv_gives_the_unpreempted_outputs(int8_llm):
    from prompts import mixed_prompts
    workload = mixed_prompts(int8_llm.get_tokenizer(), 12, 3, 150, seed=7)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = generate_ids(int8_llm, workload, params)
    # 20 blocks of 16 = 320 tokens: the longest request (150 + 30) fits alone, the batch does not.
    small = LLM("tiny-llama", kv_cache_dtype="int8", num_kv_blocks=20, max_num_seqs=12, max_num_batched_tokens=128)
    assert generate_ids(small, workload, params) == roomy  # generate_ids checks every block came back
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(int8_llm)


def test_the_profiling_step_runs_over_an_int8_scratch_cache(monkeypatch, int8_llm):
    """Planning as on CUDA (a memory reader; computed on CPU): the largest step runs once over an
    int8 scratch cache, so its peak includes the dequantized copies, and changes no output."""
    from minserve.engine import llm_engine
    from minserve.models.llama import LlamaForCausalLM
    from test_memory_planning import FakeReader
    layouts, forward = [], LlamaForCausalLM.forward

    def spy(self, input_ids, positions, kv_caches, meta, rows):
        layouts.append(tuple(t.dtype for t in kv_caches[0]))
        return forward(self, input_ids, positions, kv_caches, meta, rows)

    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    monkeypatch.setattr(llm_engine, "device_memory_reader", lambda device: FakeReader())
    llm = LLM("tiny-llama", kv_cache_dtype="int8", **ENGINE)
    assert llm.llm_engine.runner.device_memory is not None
    assert layouts == [(torch.int8, torch.int8, torch.float32, torch.float32)] * 2  # widest, longest
    prompts = _prompt_ids(llm)[:3]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert generate_ids(llm, prompts, params) == generate_ids(int8_llm, prompts, params)


# ---- errors and flags ---------------------------------------------------------------------------

def test_unknown_kv_cache_dtype_is_named_with_the_known_ones():
    for bad in ("fp8", "float32", None, 8):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'int8'\]"):
            EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        plan(ModelConfig.from_hf(TINY_CONFIG), hardware="h100", kv_cache_dtype="fp8")


def test_the_fused_decoder_is_bound_only_to_a_kv_cache_it_can_read(int8_llm):
    llm = LLM("tiny-llama", kv_cache_dtype="int8", **ENGINE)
    runner = llm.llm_engine.runner
    reason = unsupported_reason(runner.model, runner.kv_caches)
    if reason is None:  # the fused C step reads int8 KV: bound as for fp32, same tokens as torch
        assert runner.fused is not None
        prompts, params = _prompt_ids(llm)[:4], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert generate_ids(llm, prompts, params) == generate_ids(int8_llm, prompts, params)
    else:
        assert runner.fused is None and "kv_caches[0].key: int8" in reason


def test_a_kv_dtype_the_fused_step_refuses_is_named(monkeypatch, caplog):
    """A kernel that refuses the cache (as the fused C step refused int8 K/V before it learnt
    them): skipped with a logged reason, or with fused_decode=True a ValueError naming both."""
    from minserve.engine import fused_step
    refusal = "kv_caches[0].key: int8 [8, 16, 2, 16]; the fused decode kernel implements float32 only"
    monkeypatch.setattr(fused_step, "unsupported_reason", lambda model, kv_caches: refusal)
    with caplog.at_level(logging.INFO, logger="minserve"):
        assert LLM("tiny-llama", kv_cache_dtype="int8", num_kv_blocks=8).llm_engine.runner.fused is None
    assert any("PyTorch" in r.getMessage() and "kv_cache_dtype='int8'" in r.getMessage() and refusal in
               r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"fused_decode=True .*kv_cache_dtype='int8': kv_caches\[0\]\.key: int8"):
        LLM("tiny-llama", kv_cache_dtype="int8", num_kv_blocks=8, fused_decode=True)


def test_serve_and_plan_take_the_flag():
    from minserve.plan.cli import parser as plan_parser
    from minserve.server.cli import build_parser, engine_kwargs
    ap = build_parser()
    assert engine_kwargs(ap.parse_args(["--kv-cache-dtype", "int8"]))["kv_cache_dtype"] == "int8"
    assert "kv_cache_dtype" not in engine_kwargs(ap.parse_args([]))
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "fp8"])
    assert plan_parser().parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
