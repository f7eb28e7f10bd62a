"""Batch-invariant runs (minserve/engine/batch_invariance.py): a request's tokens and
log-probabilities do not depend on what else the engine runs.

The kernel underneath: ms_prefill_attention_paged computes each query row with the same arithmetic
whatever its chunk, its neighbours, or where its keys were read from; the engine test puts a seeded
request through other chunk cuts, a prefix-cache hit and a preemption and compares bits."""

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.config import EngineConfig
from minserve.kernels import prefill_attention as pa
from minserve.kernels.triton.reference import dequantize_kv_int8, quantize_kv_int8

if not pa.paged_available():
    pytest.skip("no C compiler: the kernel cannot be built here", allow_module_level=True)

A8 = {"quantization": "int4", "quantization_config": {"activations": "int8"}}


SIZES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64}   # heads the C attention takes
# Qwen2's q/k/v biases: int8 rows with a bias once got other last bits at 1-7 rows than at 16
# (kernels/quant_dot.h's store_row), which a Llama without biases did not show.
ARCHS = {"llama": SIZES, "qwen2-biases": SIZES | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                  "attention_bias": True, "use_sliding_window": False}}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from minserve.models.loader import _smollm2_tokenizer_dir
    from minserve.models.tiny import write_tiny_model
    root = tmp_path_factory.mktemp("bi")
    return {name: write_tiny_model(root / name, 3, _smollm2_tokenizer_dir(), over) for name, over in ARCHS.items()}


@pytest.fixture
def model_dir(model_dirs):
    return model_dirs["llama"]


def _paged_cache(int8: bool, blocks=24, block_size=16, Hkv=3, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(blocks * block_size, Hkv, D, generator=g) for _ in range(2))
    if not int8:
        return k.view(blocks, block_size, Hkv, D), v.view(blocks, block_size, Hkv, D), None, None
    (kc, ks), (vc, vs) = quantize_kv_int8(k), quantize_kv_int8(v)
    shape = (blocks, block_size, Hkv)
    return kc.view(*shape, D), vc.view(*shape, D), ks.float().view(shape), vs.float().view(shape)


def _sequence(caches, table, L):
    """The sequence's keys and values in token order, as the PyTorch path hands them over."""
    k, v, ks, vs = caches
    rows = [c[table].flatten(0, 1)[:L] for c in (k, v)]
    if ks is None:
        return rows
    return [dequantize_kv_int8(r, s[table].flatten(0, 1)[:L]) for r, s in zip(rows, (ks, vs))]


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_each_row_gets_the_same_bits_in_any_chunk_and_beside_any_sequence(int8):
    """The paged entry gives ms_prefill_attention's bits for a whole prompt, and every row the same
    bits again when the prompt is cut into chunks of 1 to 79 queries or shares the call."""
    caches, L, H = _paged_cache(int8), 150, 9
    table = torch.randperm(24, generator=torch.Generator().manual_seed(1))[:10]
    q = torch.randn(L, H, 64, generator=torch.Generator().manual_seed(2))
    whole = pa.prefill_attention_paged(q, caches, table[None], [0], 0.125)
    k, v = _sequence(caches, table, L)
    assert torch.equal(whole, pa.prefill_attention(q, k, v, 0.125).view(L, -1))
    for start, n in ((0, 64), (64, 6), (70, 1), (71, 79), (149, 1), (100, 17), (3, 33)):
        assert torch.equal(pa.prefill_attention_paged(q[start:start + n], caches, table[None], [start], 0.125),
                           whole[start:start + n]), (start, n)
    two = pa.prefill_attention_paged(torch.cat([q[10:13], q[140:143]]), caches, torch.stack([table, table]),
                                     [10, 140], 0.125)
    assert torch.equal(two, torch.cat([whole[10:13], whole[140:143]]))
    # Decode rows of many sequences: one work item per row, its kv heads in turn (not one per kv
    # head): the same bits, at one thread and at two.
    rows = [3, 64, 65, 100, 128, 129, 149, 0]
    for threads in (1, 2):
        many = pa.prefill_attention_paged(q[rows], caches, table[None].expand(len(rows), -1), rows, 0.125,
                                          num_threads=threads)
        assert torch.equal(many, whole[rows]), threads


def test_the_paged_entry_declines_what_it_does_not_take():
    caches = _paged_cache(False)
    table = torch.arange(4)[None]
    assert pa.prefill_attention_paged(torch.randn(3, 9, 32), caches, table, [0], 0.1) is None   # head size
    assert pa.prefill_attention_paged(torch.randn(3, 9, 64).bfloat16(), caches, table, [0], 0.1) is None
    k, v, _, _ = caches
    assert pa.prefill_attention_paged(torch.randn(3, 9, 64), (k.transpose(0, 1), v, None, None), table, [0], 0.1) is None
    with pytest.raises(ValueError, match="2 context lengths for 1 sequences"):
        pa.prefill_attention_paged(torch.randn(3, 9, 64), caches, table, [0, 1], 0.1)


def _crowd_run(model, prompt, weights=A8, threads=(1, 1), **engine):
    """A seeded request alone on one engine, then on a fresh one behind a request sharing its first
    64 tokens (a prefix-cache hit), beside others in a pool small enough that it is preempted, with
    a token budget that cuts its prompt elsewhere; ``threads``: the team size of each run (the
    engine lowers it when other processes take a core). Returns (alone, together, its
    requests_frame row)."""
    mk = lambda: LLM(str(model), num_kv_blocks=24, block_size=16, max_num_seqs=5, max_num_batched_tokens=40,  # noqa: E731
                     max_model_len=256, device="cpu", seed=0, enable_prefix_caching=True,
                     kv_cache_dtype="int8", **weights, **engine)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=40, logprobs=5, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads[0])
        alone = mk().generate([{"prompt_token_ids": prompt}], seeded, use_tqdm=False)[0].outputs[0]
        torch.set_num_threads(threads[1])
        llm = mk()
        crowd = [prompt[:64] + [7, 8, 9]] + [[(29 * i + j) % 900 + 3 for i in range(20 + 15 * j)] for j in range(3)]
        outs = llm.generate([{"prompt_token_ids": p} for p in crowd + [prompt]],
                            [SamplingParams(max_tokens=90, ignore_eos=True)] * 4 + [seeded], use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    return alone, outs[-1].outputs[0], llm.llm_engine.requests_frame().iloc[-1]


def _executors(llm) -> list[str]:
    return [e.name for e in llm.llm_engine.runner.executors]


def _numbers(out):
    return [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


PROMPT = [(13 * i) % 900 + 5 for i in range(110)]


FORMATS = {"float32": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}, "int4-a8": A8}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("weights", FORMATS.values(), ids=FORMATS.keys())
def test_a_seeded_request_is_bit_for_bit_the_same_alone_and_in_a_crowd(model_dirs, arch, weights):
    """Every step in the fused C step (the mode's default), alone at one thread, in the crowd at two."""
    alone, together, row = _crowd_run(model_dirs[arch], PROMPT, weights, threads=(1, 2), batch_invariant=True)
    assert row.num_preemptions >= 1   # the run went through a recompute, not only other chunks
    assert together.token_ids == alone.token_ids
    assert _numbers(together) == _numbers(alone)


@pytest.mark.parametrize("weights", [FORMATS["float32"], A8], ids=["float32", "int4-a8"])
def test_on_the_pytorch_path_too(model_dirs, weights):
    """``fused_decode=False``: every step on the PyTorch path, in its row-invariant loops."""
    alone, together, row = _crowd_run(model_dirs["qwen2-biases"], PROMPT, weights, threads=(2, 1),
                                      batch_invariant=True, fused_decode=False)
    assert row.num_preemptions >= 1
    assert together.token_ids == alone.token_ids
    assert _numbers(together) == _numbers(alone)


def test_every_step_of_the_mode_runs_in_one_executor(model_dir):
    """Prompt chunks, decode rows and prompt logprobs alike: a step on another path would give
    its rows other roundings. The PyTorch path only when asked for (or where C cannot run)."""
    assert _executors(LLM(str(model_dir), batch_invariant=True, num_kv_blocks=24)) == ["fused-cpu-invariant"]
    assert _executors(LLM(str(model_dir), batch_invariant=True, fused_decode=True, num_kv_blocks=24)) == [
        "fused-cpu-invariant"]
    assert _executors(LLM(str(model_dir), batch_invariant=True, fused_decode=False, num_kv_blocks=24)) == ["torch"]


def test_prompt_logprobs_are_the_same_alone_and_beside_others(model_dir):
    """Prompt rows' logprobs come from the fused step's own final hidden rows and LM head loops."""
    params = SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2, temperature=0)
    mk = lambda: LLM(str(model_dir), batch_invariant=True, num_kv_blocks=24, max_num_batched_tokens=48,  # noqa: E731
                     max_model_len=256, device="cpu")
    alone = mk().generate([{"prompt_token_ids": PROMPT[:90]}], params, use_tqdm=False)[0]
    others = [{"prompt_token_ids": [(7 * i + j) % 800 + 2 for i in range(30 + 9 * j)]} for j in range(3)]
    together = mk().generate(others + [{"prompt_token_ids": PROMPT[:90]}], params, use_tqdm=False)[-1]
    pl = lambda o: [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]  # noqa: E731
    assert pl(together) == pl(alone) and len(alone.prompt_logprobs) == 90
    assert _numbers(together.outputs[0]) == _numbers(alone.outputs[0])


def test_without_the_mode_the_same_crowd_moves_the_logprobs(model_dir):
    """What the mode fixes: the fused step off alone leaves rows whose attention kernel depends on
    the chunk (a decode-style kernel under 16 queries, the flash kernel from 16), so the same run
    moves the log-probabilities."""
    alone, together, _ = _crowd_run(model_dir, PROMPT, fused_decode=False)
    assert _numbers(together) != _numbers(alone)


def test_the_mode_computes_the_same_model(model_dir):
    """Its products and attention are other kernels for the same formulas: a prompt's logprobs stay
    within float32 rounding of the default engine's (which the suite holds to transformers)."""
    params = SamplingParams(max_tokens=1, logprobs=10, prompt_logprobs=1)
    outs = [LLM(str(model_dir), num_kv_blocks=24, device="cpu", max_model_len=256, **engine).generate(
        [{"prompt_token_ids": PROMPT[:70]}], params, use_tqdm=False)[0] for engine in ({}, {"batch_invariant": True})]
    first = [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
    assert first[0].keys() == first[1].keys()
    assert max(abs(first[0][t] - first[1][t]) for t in first[0]) < 1e-4
    prompt = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    torch.testing.assert_close(torch.tensor(prompt[1]), torch.tensor(prompt[0]), rtol=0, atol=1e-4)


def test_speculation_keeps_it():
    """Proposals come from the request's own tokens, seeded draws do not depend on how many were
    proposed, and verification rows are rows like the others. SmolLM2 on a repetitive text, so
    that n-gram lookup proposes (a random model's samples never repeat)."""
    from transformers import AutoTokenizer

    from minserve.models.loader import _smollm2_tokenizer_dir
    tokenizer = AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir())
    prompt = tokenizer.encode("The cat sat on the mat and the dog sat on the log. " * 6)[:110]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    alone, together, row = _crowd_run("smollm2-135m", prompt, batch_invariant=True, speculative_config=ngram)
    assert row.spec_proposed > 0 and row.num_preemptions >= 1
    assert together.token_ids == alone.token_ids
    assert _numbers(together) == _numbers(alone)


@pytest.mark.parametrize("engine, message", [
    ({"fp32_matmul_precision": "high"}, "needs fp32_matmul_precision='highest'"),
    ({"dtype": "bfloat16"}, "needs dtype='float32', got 'bfloat16'"),
    ({"device": "cuda"}, "needs the CPU kernels"),
    ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, "n-gram speculation or none"),
    ({**A8, "device": "cuda"}, "CPU only"),   # int8 activations refuse a GPU first
    ({**A8, "batch_invariant": "yes"}, "batch_invariant must be True or False, got 'yes'"),
])
def test_the_mode_names_what_conflicts(engine, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="tiny-llama", **{"batch_invariant": True, **engine})


def test_the_server_takes_the_flag():
    from minserve.server.cli import build_parser
    args = build_parser().parse_args(["--batch-invariant", "--quantization", "int4"])
    assert args.batch_invariant is True


def test_the_step_s_sequences_are_grouped_by_query_count_for_the_flash_kernel():
    from minserve.kernels.decode_flash import FlashSequences, flash_reason
    seqs = FlashSequences.build([3, 1, 1, 5, 1], [0, 10, 20, 0, 7], [[4], [1, 2], [3], [5, 6], [7]])
    assert seqs.groups.tolist() == [[0, 3, 1], [3, 1, 3], [4, 1, 5]]   # first sequence, sequences, queries
    assert seqs.first_row.tolist() == [3, 4, 10, 0, 5]                 # rows 0-2, 3, 4, 5-9, 10
    assert seqs.context_lens.tolist() == [10, 20, 7, 0, 0]
    assert seqs.tables.tolist() == [[1, 2], [3, 0], [7, 0], [4, 0], [5, 6]]
    with pytest.raises(ValueError, match="run past the step's 10 rows"):
        seqs.check(10, 8)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 7\)"):
        seqs.check(11, 7)
    assert "multiples of 64" in flash_reason(9, 3, 32, torch.float32)
    assert "at most 16 query heads" in flash_reason(68, 4, 64, torch.float32)
    assert "not torch.bfloat16" in flash_reason(9, 3, 64, torch.bfloat16)
    assert flash_reason(9, 3, 64, torch.int8) is None


def test_a_flash_step_needs_its_sequences(model_dir):
    llm = LLM(str(model_dir), batch_invariant=True, num_kv_blocks=24, max_model_len=256)
    decoder = llm.llm_engine.runner.fused
    assert decoder.flash
    one = torch.tensor([5])
    with pytest.raises(ValueError, match="needs its FlashSequences"):
        decoder(one, torch.tensor([0]), torch.tensor([[0]]), torch.tensor([0]))


def test_a_model_the_fused_step_does_not_compute_stays_invariant_on_the_pytorch_path(tmp_path):
    """Qwen3 normalizes each q and k head, which the fused step does not compute: the mode runs it
    on the PyTorch path (and says so), and the crowd still leaves the seeded request's bits alone."""
    from test_model_registry import hf_checkpoint
    path = hf_checkpoint(tmp_path, "qwen3", hidden_size=128, intermediate_size=256, head_dim=64,
                         num_attention_heads=6, num_key_value_heads=2)
    assert _executors(LLM(str(path), batch_invariant=True, num_kv_blocks=24, max_model_len=256)) == ["torch"]
    alone, together, row = _crowd_run(path, PROMPT, A8, threads=(1, 2), batch_invariant=True)
    assert row.num_preemptions >= 1
    assert together.token_ids == alone.token_ids
    assert _numbers(together) == _numbers(alone)


@pytest.mark.parametrize("sizes, message", [
    ({"head_dim": 32}, "a head size that is a multiple of 64, got 32"),
    ({"num_attention_heads": 17, "num_key_value_heads": 1}, "at most 16 query heads per kv head, got 17"),
])
def test_a_model_the_attention_kernel_cannot_take_is_refused_at_start(tmp_path, sizes, message):
    from minserve.models.loader import _smollm2_tokenizer_dir
    from minserve.models.tiny import write_tiny_model
    path = write_tiny_model(tmp_path / "m", 0, _smollm2_tokenizer_dir(), SIZES | sizes)
    LLM(str(path), num_kv_blocks=8)   # the default engine takes it
    with pytest.raises(ValueError, match=message):
        LLM(str(path), batch_invariant=True, num_kv_blocks=8)
