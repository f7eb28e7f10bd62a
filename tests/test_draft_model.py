"""Speculative decoding with a draft model (``method="draft_model"``), through the real engine.

The draft here is the self-draft: tiny-llama's own checkpoint in int4 (or cut to its first layer),
so proposals are often right and often wrong. Greedy outputs must equal plain decoding token for
token in mixed batches, under preemption, with prefix caching, with a tiny step budget, on the
fused and the PyTorch paths; seeded sampled requests must be reproducible; every KV block, the
target's and the draft's, must come back after aborts and preemption; and the draft's own cache
must be rolled back after rejections (its proposals must equal what the draft proposes from a
fresh cache). Bad configs are refused naming the key.
"""

from __future__ import annotations

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.spec.verify import sampling_probs, verify_with_draft
from conftest import assert_all_blocks_free, generate_ids
from prompts import mixed_prompts

DRAFT = {"method": "draft_model", "model": "self", "num_speculative_tokens": 4, "adaptive": False}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def assert_draft_blocks_free(llm) -> None:
    pool = llm.llm_engine.proposer.kv.pool
    assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} draft KV blocks still held"
    assert not llm.llm_engine.proposer.kv.block_tables


@pytest.fixture(scope="module")
def workload(tiny_llm):
    return mixed_prompts(tiny_llm.get_tokenizer(), 6, 3, 70, seed=5)


@pytest.fixture(scope="module")
def plain(tiny_llm, workload):
    return generate_ids(tiny_llm, workload, GREEDY)


@pytest.mark.parametrize("engine_args,spec", [
    (dict(), {}),                                                   # fused C steps, int4 draft
    (dict(fused_decode=False, enable_prefix_caching=False), {}),    # PyTorch path, both models
    (dict(num_kv_blocks=8, max_num_seqs=6), {}),                    # preemption
    (dict(max_num_batched_tokens=12, block_size=4), {"num_speculative_tokens": 6}),  # chunked, cut
    (dict(), {"quantization": None, "draft_layers": 1}),            # layer-skip self-draft
    (dict(), {"draft_num_kv_blocks": 3}),                           # draft pool too small for all
])
def test_greedy_outputs_equal_plain_decoding(workload, plain, engine_args, spec):
    llm = LLM("tiny-llama", speculative_config={**DRAFT, **spec}, **{"num_kv_blocks": 256, **engine_args})
    assert generate_ids(llm, workload, GREEDY) == plain
    assert generate_ids(llm, workload, GREEDY) == plain    # again, with prefix-cache hits
    assert_draft_blocks_free(llm)
    snap = llm.llm_engine.snapshot()
    assert snap["vllm:spec_decode_num_drafts"] > 0
    assert 0 < snap["vllm:spec_decode_num_accepted_tokens"] <= snap["vllm:spec_decode_num_draft_tokens"]


def test_seeded_sampled_requests_are_reproducible(workload, monkeypatch):
    import minserve.engine.model_runner as model_runner
    calls = []
    verify = model_runner.verify_with_draft
    monkeypatch.setattr(model_runner, "verify_with_draft", lambda *a, **kw: calls.append(1) or verify(*a, **kw))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = []
    for _ in range(2):
        llm = LLM("tiny-llama", num_kv_blocks=256, speculative_config=DRAFT)
        outs = llm.generate([{"prompt_token_ids": p} for p in workload], params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [sorted(lp) for lp in o.outputs[0].logprobs]) for o in outs])
        assert llm.llm_engine.snapshot()["vllm:spec_decode_num_accepted_tokens"] > 0
        assert_all_blocks_free(llm)
    assert runs[0] == runs[1]
    assert calls, "sampled requests must verify against the draft's distribution (rejection sampling)"
    for ids, logprobs in runs[0]:
        assert len(logprobs) == len(ids) and all(t in lp for t, lp in zip(ids, logprobs))


def test_aborts_and_preemption_return_every_block(workload):
    llm = LLM("tiny-llama", num_kv_blocks=8, max_num_seqs=6, speculative_config=DRAFT)
    eng = llm.llm_engine
    for i, p in enumerate(workload):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for step in range(12):
        eng.step()
        if step % 4 == 3:
            eng.abort_request(str(step // 4))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.num_preemptions > 0, "the test must preempt"
    assert_all_blocks_free(llm)
    assert_draft_blocks_free(llm)


def test_draft_cache_is_rolled_back_after_rejections(workload):
    """Each proposal list must be what the draft model proposes from a fresh cache: stale K/V of
    rejected guesses left in the draft's cache would change its next proposals."""
    llm = LLM("tiny-llama", num_kv_blocks=256, speculative_config=DRAFT)
    proposer, seen = llm.llm_engine.proposer, []
    batch = proposer.propose_batch

    def recording(reqs):
        out = batch(reqs)
        seen.extend((r.token_ids(0, r.num_tokens), p) for r, p in zip(reqs, out) if p)
        return out
    proposer.propose_batch = recording
    generate_ids(llm, workload[:3], GREEDY)
    snap = llm.llm_engine.snapshot()
    assert snap["vllm:spec_decode_num_accepted_tokens"] < snap["vllm:spec_decode_num_draft_tokens"], \
        "the test needs rejected proposals"
    fresh = LLM("tiny-llama", quantization="int4", num_kv_blocks=256, enable_prefix_caching=False)
    k_tokens = [SamplingParams(temperature=0, max_tokens=len(p), ignore_eos=True) for _, p in seen]
    ref = fresh.generate([{"prompt_token_ids": t} for t, _ in seen], k_tokens, use_tqdm=False)
    assert [p for _, p in seen] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("bad,key", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({**DRAFT, "num_speculative_tokens": 8}, "num_speculative_tokens"),
    ({**DRAFT, "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({**DRAFT, "prompt_lookup_max": 3}, "unknown key"),
    ({**DRAFT, "quantization": None}, "cheaper"),
    ({**DRAFT, "quantization": "int3"}, "quantization"),
    ({**DRAFT, "draft_layers": 9}, "draft_layers"),
    ({**DRAFT, "model": 7}, "model"),
])
def test_bad_draft_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        LLM("tiny-llama", speculative_config=bad)


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    from minserve.models.loader import _smollm2_tokenizer_dir
    from minserve.models.tiny import write_tiny_model
    other = write_tiny_model(tmp_path / "other", 1, _smollm2_tokenizer_dir(), {"vocab_size": 1024})
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens"):
        LLM("tiny-llama", speculative_config={**DRAFT, "model": str(other)})


def test_verify_with_draft_samples_the_target_distribution():
    """The engine's entry to rejection sampling: the first returned token must follow the
    target's processed distribution (temperature, top-k) whatever the draft's q, and a broken
    target distribution (temperature ignored) must be told apart (the test can fail)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=g) * 2
    params = SamplingParams(temperature=0.7, top_k=5)
    p = sampling_probs(logits, [params] * 3, [[]] * 3)
    q = torch.softmax(torch.randn(2, 8, generator=g), dim=-1)
    n, counts = 6000, torch.zeros(8)
    for _ in range(n):
        proposals = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        counts[verify_with_draft(logits, params, [[]] * 3, proposals, q, g)[0].token_id] += 1
    tv = 0.5 * (counts / n - p[0]).abs().sum().item()
    wrong = sampling_probs(logits, [SamplingParams(temperature=1.0, top_k=5)] * 3, [[]] * 3)
    assert tv < 0.03 and 0.5 * (counts / n - wrong[0]).abs().sum().item() > 2 * tv
    assert (p[0] == 0).sum() == 3 and (counts[p[0] == 0] == 0).all()   # top-k's zeros stay zero


def test_a_draft_equal_to_the_target_has_every_greedy_proposal_accepted(workload, plain):
    """A separate checkpoint as the draft (here the target's own, unquantized): its greedy guesses
    are the target's tokens, so all are accepted; a cache out of step would make some wrong."""
    llm = LLM("tiny-llama", num_kv_blocks=256, speculative_config={**DRAFT, "model": "tiny-llama"})
    assert generate_ids(llm, workload, GREEDY) == plain
    snap = llm.llm_engine.snapshot()
    assert snap["vllm:spec_decode_num_draft_tokens"] > 0
    assert snap["vllm:spec_decode_num_accepted_tokens"] == snap["vllm:spec_decode_num_draft_tokens"]
    assert_draft_blocks_free(llm)
