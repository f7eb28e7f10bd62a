"""Verify steps through the real engine: several tokens per request per step, with rollback.

An oracle proposer knows each request's greedy answer (from a plain run) and proposes its next
tokens, some deliberately wrong. Whatever it proposes, greedy outputs must equal the plain run
token for token (exact verification), steps must carry fewer rows than tokens produced, and every
KV block must come back — in mixed batches with chunked prefill, under preemption, with prefix
caching, on the PyTorch path and the fused C path.
"""

from __future__ import annotations

import random

import pytest

from minserve import LLM, SamplingParams
from conftest import assert_all_blocks_free, generate_ids as _run
from prompts import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class OracleProposer:
    def __init__(self, answers: dict[tuple, list[int]], k: int, wrong: float, seed: int = 0):
        self.answers, self.k, self.wrong = answers, k, wrong
        self.rng = random.Random(seed)

    def propose(self, req) -> list[int]:
        true = self.answers[tuple(req.prompt_token_ids)][req.num_output_tokens:]
        return [t if self.rng.random() >= self.wrong else (t + 1) % 100 for t in true[:self.k]]


@pytest.fixture(scope="module")
def workload(tiny_llm):
    return mixed_prompts(tiny_llm.get_tokenizer(), 8, 3, 90, seed=11)


@pytest.fixture(scope="module")
def plain(tiny_llm, workload):
    return _run(tiny_llm, workload, GREEDY)


@pytest.mark.parametrize("engine_args,k,wrong", [
    (dict(), 4, 0.0),                                                  # roomy, every proposal right
    (dict(), 4, 0.3),                                                  # some rejected
    (dict(num_kv_blocks=14, max_num_seqs=8), 4, 0.3),                  # preemption (14 x 16 tokens)
    (dict(max_num_batched_tokens=9, block_size=4), 6, 1.0),            # tiny budget, all rejected
    (dict(enable_prefix_caching=False, fused_decode=False), 1, 0.0),   # PyTorch path only
])
def test_greedy_outputs_equal_plain_decoding(tiny_llm, workload, plain, engine_args, k, wrong):
    llm = LLM("tiny-llama", **{"num_kv_blocks": 256, **engine_args})
    eng = llm.llm_engine
    eng.proposer = OracleProposer({tuple(p): a for p, a in zip(workload, plain)}, k, wrong)
    eng.scheduler.num_lookahead_tokens = k
    assert _run(llm, workload, GREEDY) == plain
    steps = eng.steps_frame()
    produced = sum(len(a) for a in plain)
    decode_steps = int((steps.num_decode_tokens > 0).sum())
    if wrong == 0.0 and k > 1:
        assert decode_steps < produced / 2, "right proposals must save steps"
    # Twice, to see the prefix cache hit on the first run's blocks: still the same answers.
    assert _run(llm, workload, GREEDY) == plain


def test_seeded_sampling_with_proposals_is_reproducible(tiny_llm, workload, plain):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM("tiny-llama", num_kv_blocks=256)
        llm.llm_engine.proposer = OracleProposer({tuple(p): a for p, a in zip(workload, plain)}, 3, 0.2)
        runs.append(_run(llm, workload, params))
    assert runs[0] == runs[1]
    # Each token's noise is keyed by its position, so proposals (here right or wrong at random)
    # leave a seeded request's tokens as plain decoding draws them.
    assert runs[0] == _run(tiny_llm, workload, params)


def test_stop_token_inside_accepted_proposals_ends_there(tiny_llm, workload, plain):
    prompt, answer = workload[0], plain[0]
    stop_at = answer[5]
    expect = answer[:answer.index(stop_at) + 1]
    llm = LLM("tiny-llama", num_kv_blocks=256)
    llm.llm_engine.proposer = OracleProposer({tuple(prompt): answer}, 6, 0.0)
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at])
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expect and out.finish_reason == "stop"
    assert_all_blocks_free(llm)


def test_logprobs_come_per_accepted_token(tiny_llm, workload, plain):
    llm = LLM("tiny-llama", num_kv_blocks=256)
    llm.llm_engine.proposer = OracleProposer({tuple(p): a for p, a in zip(workload, plain)}, 4, 0.0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    spec = llm.generate([{"prompt_token_ids": workload[1]}], params, use_tqdm=False)[0].outputs[0]
    ref = tiny_llm.generate([{"prompt_token_ids": workload[1]}], params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == ref.token_ids
    assert len(spec.logprobs) == len(spec.token_ids)
    for a, b in zip(spec.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
