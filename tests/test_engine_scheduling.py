"""Scheduling must not change results: chunking, budgets and preemption give the roomy outputs,
seeded sampling ignores batch composition, and every KV block comes back."""

import pytest

from minserve import LLM, SamplingParams
from prompts import mixed_prompts
from conftest import assert_all_blocks_free, generate_ids as _run


@pytest.fixture(scope="module")
def workload(tiny_llm):
    return mixed_prompts(tiny_llm.get_tokenizer(), 12, 3, 150, seed=7)


@pytest.fixture(scope="module")
def roomy_greedy(tiny_llm, workload):
    return _run(tiny_llm, workload, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=7),                      # tiny chunks: every prompt split many times
    dict(max_num_batched_tokens=16, max_num_seqs=3),     # tiny budget and few seats
    dict(max_num_batched_tokens=64, block_size=4),       # other block size
])
def test_small_chunks_and_budgets_give_same_greedy_outputs(engine_args, workload, roomy_greedy):
    llm = LLM("tiny-llama", num_kv_blocks=512, **engine_args)
    assert _run(llm, workload, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) == roomy_greedy


def test_preemption_gives_same_greedy_outputs(workload, roomy_greedy):
    # 20 blocks of 16 = 320 tokens: the longest request (150 + 30) fits alone, the batch does not.
    llm = LLM("tiny-llama", num_kv_blocks=20, max_num_seqs=12, max_num_batched_tokens=128)
    assert _run(llm, workload, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) == roomy_greedy
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert sum(s.num_preemptions for s in llm.llm_engine.step_stats) == llm.llm_engine.scheduler.num_preemptions


def test_seeded_sampling_is_independent_of_batch(tiny_llm, workload):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _run(tiny_llm, workload[:1], params)[0]
    noisy = [SamplingParams(temperature=1.0, seed=s, max_tokens=25, ignore_eos=True) for s in range(6)]
    crowded = tiny_llm.generate([{"prompt_token_ids": p} for p in workload[1:7]] + [{"prompt_token_ids": workload[0]}],
                                noisy + [params], use_tqdm=False)[-1].outputs[0].token_ids
    small = LLM("tiny-llama", num_kv_blocks=20, max_num_batched_tokens=9)
    preempted = small.generate([{"prompt_token_ids": p} for p in workload[:6]] , [params] + noisy[:5],
                               use_tqdm=False)[0].outputs[0].token_ids
    assert alone == crowded == preempted
    other_seed = _run(tiny_llm, workload[:1], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99,
                                                            max_tokens=20, ignore_eos=True))[0]
    assert other_seed != alone


def test_decodes_are_not_stalled_by_a_long_prompt(tiny_llm):
    eng = LLM("tiny-llama", max_num_batched_tokens=32, num_kv_blocks=256).llm_engine
    eng.add_request("short", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.step()  # prefill of the short request; it now decodes
    eng.add_request("long", list(range(1000, 1300)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    produced = 0
    for _ in range(9):  # the 300-token prompt needs ~10 chunked steps...
        produced += sum(1 for o in eng.step() if o.request_id == "short")
    assert produced == 9  # ...and the running stream got a token in every one of them
    stats = eng.step_stats[-1]
    assert stats.num_decode_tokens == 1 and stats.num_prefill_tokens == 31


def test_abort_frees_blocks_immediately(tiny_llm):
    eng = tiny_llm.llm_engine
    eng.add_request("a", list(range(200, 260)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", list(range(300, 330)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv.pool.num_free < eng.kv.pool.num_blocks
    eng.abort_request("a")
    assert "a" not in eng.kv.block_tables and eng.get_num_unfinished_requests() == 1
    eng.abort_request(["b", "unknown-id"])
    assert_all_blocks_free(tiny_llm)


def test_failed_step_returns_blocks(tiny_llm, monkeypatch):
    eng = tiny_llm.llm_engine
    eng.add_request("x", list(range(10, 40)), SamplingParams(max_tokens=5))

    def boom(*a, **k):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(eng.runner, "execute", boom)
    [out] = eng.step()  # the failure is the request's own: it ends with "error", the engine goes on
    assert out.finished and out.outputs[0].finish_reason == "error" and "injected" in out.error
    monkeypatch.undo()
    assert_all_blocks_free(tiny_llm)
    assert tiny_llm.generate("still works", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def test_step_streams_incremental_outputs_and_stats(tiny_llm):
    eng = tiny_llm.llm_engine
    from minserve import RequestOutputKind
    eng.add_request("cum", "Streaming test", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.add_request("delta", "Streaming test", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            output_kind=RequestOutputKind.DELTA))
    texts, deltas, last = [], [], {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            last[o.request_id] = o
            if o.request_id == "cum":
                texts.append(o.outputs[0].text)
            else:
                deltas.append(o.outputs[0].token_ids)
    assert len(texts) == 12 and all(texts[i + 1].startswith(texts[i].rstrip("\ufffd")) for i in range(11))
    assert sum(deltas, []) == last["cum"].outputs[0].token_ids
    assert last["cum"].finished and last["cum"].outputs[0].finish_reason == "length"
    s = eng.last_step_stats
    assert s.num_running == 0 and s.num_waiting == 0 and s.step_time_s > 0
