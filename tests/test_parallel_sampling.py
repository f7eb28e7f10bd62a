"""Parallel sampling, ``SamplingParams(n=k)`` (engine/parallel_sampling.py): one prefill whose KV
blocks the k samples share by reference count, then k independent sequences. Counted here: the
prefill tokens of the steps, the blocks in use and their reference counts, the copied block's
contents in every KV layout; then per-sample seeds, stops, logprobs, aborts, preemption,
speculative decoding, the output shapes (vLLM's) and the metrics."""

from __future__ import annotations

import asyncio

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.engine.parallel_sampling import sample_seed
from minserve.sampling_params import RequestOutputKind
from minserve.server.async_engine import AsyncEngine
from conftest import assert_all_blocks_free

PROMPT = list(range(100, 137))       # 37 tokens: 2 full blocks of 16 and a partial one of 5
ALIGNED = list(range(200, 232))      # 32 tokens: ends on a block boundary
OTHERS = [list(range(300 + 7 * i, 318 + 7 * i)) for i in range(3)]  # batch neighbours
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=256)
SEEDED = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
VARIANTS = {
    "fused+prefix": dict(),
    "fused": dict(enable_prefix_caching=False),
    "torch+prefix": dict(fused_decode=False),
    "torch": dict(fused_decode=False, enable_prefix_caching=False),
}
_engines: dict[tuple, LLM] = {}


def llm_for(**kw) -> LLM:
    """One engine per configuration for the whole module (a load takes seconds)."""
    key = tuple(sorted(kw.items()))
    if key not in _engines:
        _engines[key] = LLM("tiny-llama", **{**ENGINE, **kw})
    return _engines[key]


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant(request) -> LLM:
    return llm_for(**VARIANTS[request.param])


def params(base: SamplingParams = SEEDED, **kw) -> SamplingParams:
    p = base.clone()
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def generate(llm: LLM, prompts: list[list[int]], p: SamplingParams | list[SamplingParams]):
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
    assert_all_blocks_free(llm)
    return outs


def samples(llm: LLM, prompt: list[int], p: SamplingParams = SEEDED) -> list[list[int]]:
    (out,) = generate(llm, [prompt], p)
    assert [c.index for c in out.outputs] == list(range(p.n))
    return [c.token_ids for c in out.outputs]


def drain(eng) -> list:
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


def blocks_in_use(eng) -> int:
    return sum(1 for c in eng.kv.pool.ref_count if c > 0)


# ---- one prefill, shared blocks --------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [PROMPT, ALIGNED], ids=["partial-last-block", "block-aligned"])
def test_the_prompt_is_prefilled_once_and_its_blocks_shared(variant, prompt):
    eng, n, bs = variant.llm_engine, SEEDED.n, variant.llm_engine.kv.block_size
    full, partial = divmod(len(prompt), bs)
    prefill_before = sum(s.num_prefill_tokens for s in eng.step_stats)
    eng.add_request("p", {"prompt_token_ids": prompt}, SEEDED)
    eng.step()
    assert eng.last_step_stats.num_prefill_tokens == len(prompt)
    tables = [eng.kv.block_table(sid) for sid in ["p", "p#1", "p#2", "p#3"]]
    # Full blocks: one copy, n references. The partial last block: one per sample.
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert all(eng.kv.pool.ref_count[b] == n for b in tables[0][:full])
    assert blocks_in_use(eng) == full + (n if partial else 0)   # independent requests: n * (full + 1)
    drain(eng)
    steps = list(eng.step_stats)
    assert sum(s.num_prefill_tokens for s in steps) - prefill_before == len(prompt)
    assert [r.num_output_tokens for r in list(eng.finished_requests)[-n:]] == [10] * n
    assert_all_blocks_free(variant)


def test_forked_samples_copy_the_partial_block_in_every_kv_layout():
    """The copy is of every tensor of the layout: K and V, and int8's codes and scales."""
    for kv_dtype in ("auto", "int8"):
        eng = llm_for(kv_cache_dtype=kv_dtype, fused_decode=False).llm_engine
        eng.add_request("c", {"prompt_token_ids": PROMPT}, params(n=3, max_tokens=2))
        eng.step()
        full = len(PROMPT) // eng.kv.block_size
        src = eng.kv.block_table("c")[full]
        layout = eng.runner.kv_caches[0]
        assert len(layout) == (4 if kv_dtype == "int8" else 2)
        for sid in ("c#1", "c#2"):
            dst = eng.kv.block_table(sid)[full]
            assert dst != src
            for layer in eng.runner.kv_caches:
                for t in layer:
                    assert torch.equal(t[dst], t[src]) and t[src].abs().sum() > 0
        drain(eng)
        assert_all_blocks_free(llm_for(kv_cache_dtype=kv_dtype, fused_decode=False))


def test_int8_kv_samples_match_single_requests():
    llm = llm_for(kv_cache_dtype="int8", fused_decode=False)
    got = samples(llm, PROMPT, params(n=3))
    assert got == [samples(llm, PROMPT, params(n=1, seed=7 + j))[0] for j in range(3)]


# ---- seeds, greedy, reproducibility ----------------------------------------------------------------

def test_sample_j_is_the_single_request_seeded_seed_plus_j(variant):
    """Same first-token logits for all samples: sample j of the n-run is, token for token, what an
    n=1 request seeded seed + j produces."""
    got = samples(variant, PROMPT)
    assert len({tuple(s) for s in got}) == SEEDED.n, "seeded samples must differ"
    assert got == [samples(variant, PROMPT, params(n=1, seed=7 + j))[0] for j in range(SEEDED.n)]


def test_seeded_samples_reproduce_across_runs_and_batch_compositions(variant):
    alone = samples(variant, PROMPT)
    assert samples(variant, PROMPT) == alone
    plain = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    outs = generate(variant, OTHERS + [PROMPT] + OTHERS, [plain] * 3 + [SEEDED] + [plain] * 3)
    assert [c.token_ids for c in outs[3].outputs] == alone


def test_greedy_samples_are_identical():
    llm = llm_for()
    got = samples(llm, PROMPT, params(temperature=0.0, seed=None))
    assert got == [got[0]] * SEEDED.n
    assert got[0] == samples(llm, PROMPT, params(n=1, temperature=0.0, seed=None))[0]


def test_unseeded_samples_differ():
    got = samples(llm_for(), PROMPT, params(seed=None, max_tokens=16))
    assert len({tuple(s) for s in got}) > 1


def test_sample_seeds_wrap_into_torchs_range():
    assert sample_seed(None, 3) is None and sample_seed(5, 0) == 5 and sample_seed(5, 3) == 8
    assert sample_seed(2**64 - 1, 1) == 0
    samples(llm_for(), PROMPT, params(seed=2**64 - 2, max_tokens=2))  # no overflow in manual_seed


# ---- per-sample stops, lengths and logprobs --------------------------------------------------------

def test_stop_tokens_and_max_tokens_apply_per_sample():
    llm = llm_for()
    free = samples(llm, PROMPT, params(max_tokens=12))
    stop = free[1][3]     # sample 1 stops on its 4th token; the others wherever it appears, if at all
    (out,) = generate(llm, [PROMPT], params(max_tokens=12, stop_token_ids=[stop]))
    for c, tokens in zip(out.outputs, free):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert c.token_ids == tokens[:cut]
        assert (c.finish_reason, c.stop_reason) == (("stop", stop) if stop in tokens else ("length", None))
    assert out.outputs[1].token_ids == free[1][:free[1].index(stop) + 1]


def test_stop_strings_apply_per_sample():
    llm = llm_for()
    (free,) = generate(llm, [PROMPT], params(max_tokens=12))
    text = free.outputs[2].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    (out,) = generate(llm, [PROMPT], params(max_tokens=12, stop=[stop]))
    for c, whole in zip(out.outputs, free.outputs):
        if stop in whole.text:
            assert (c.finish_reason, c.stop_reason) == ("stop", stop) and stop not in c.text
            assert whole.text.startswith(c.text)
        else:
            assert c.token_ids == whole.token_ids and c.finish_reason == "length"
    assert out.outputs[2].finish_reason == "stop"


def test_logprobs_are_per_sample():
    llm = llm_for()
    (out,) = generate(llm, [PROMPT], params(n=3, logprobs=2))
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(next(iter(lp)) == t for lp, t in zip(c.logprobs, c.token_ids))
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)))
        (single,) = generate(llm, [PROMPT], params(n=1, seed=7 + c.index, logprobs=2))
        assert single.outputs[0].cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-4)


def test_prompt_logprobs_come_once_from_the_prefill():
    llm = llm_for()
    (out,) = generate(llm, [PROMPT], params(n=3, prompt_logprobs=1, max_tokens=3))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    (single,) = generate(llm, [PROMPT], params(n=1, prompt_logprobs=1, max_tokens=3))
    assert [d and next(iter(d.items()))[1].logprob for d in out.prompt_logprobs] == pytest.approx(
        [d and next(iter(d.items()))[1].logprob for d in single.prompt_logprobs])


# ---- output shapes -----------------------------------------------------------------------------------

def test_final_only_returns_every_sample_sorted_once_all_finished():
    eng = llm_for().llm_engine
    eng.add_request("f", {"prompt_token_ids": PROMPT}, params(output_kind=RequestOutputKind.FINAL_ONLY))
    outs = [o for o in drain(eng) if o.request_id == "f"]
    assert len(outs) == 1 and outs[0].finished
    assert [c.index for c in outs[0].outputs] == [0, 1, 2, 3]
    assert outs[0].metrics.num_generation_tokens == 40
    assert outs[0].metrics.first_token_time <= outs[0].metrics.last_token_time <= outs[0].metrics.finished_time


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streams_carry_the_samples_that_changed(kind):
    llm = llm_for()
    final = samples(llm, PROMPT)
    free = samples(llm, PROMPT, params(max_tokens=12))
    stop = free[1][3]   # sample 1 ends early: later outputs no longer carry it
    eng = llm.llm_engine
    eng.add_request("s", {"prompt_token_ids": PROMPT}, params(output_kind=kind, stop_token_ids=[stop]))
    outs = [o for o in drain(eng) if o.request_id == "s"]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    got: dict[int, list[int]] = {}
    done: set[int] = set()
    for o in outs:
        idx = [c.index for c in o.outputs]
        assert idx == sorted(set(idx)) and o.outputs
        for c in o.outputs:
            assert c.index not in done, "a finished sample came back"
            got[c.index] = (got.get(c.index, []) + c.token_ids if kind is RequestOutputKind.DELTA
                            else c.token_ids)
            if c.finish_reason is not None:
                done.add(c.index)
    assert done == {0, 1, 2, 3}
    want = [t[:t.index(stop) + 1] if stop in t else t for t in final]
    assert [got[j] for j in range(4)] == want
    assert sum(1 for o in outs if any(c.index == 1 for c in o.outputs)) == len(want[1])
    assert_all_blocks_free(llm)


def test_llm_generate_mixes_n_per_prompt():
    llm = llm_for()
    outs = generate(llm, [PROMPT, OTHERS[0]], [params(n=3), params(n=1)])
    assert [len(o.outputs) for o in outs] == [3, 1]


# ---- aborts, failures, preemption --------------------------------------------------------------------

@pytest.mark.parametrize("steps", [0, 1, 4])
def test_aborting_the_request_id_aborts_every_sample(steps):
    llm = llm_for(max_num_batched_tokens=16)   # 37 prompt tokens: three chunks before the fork
    eng = llm.llm_engine
    eng.add_request("a", {"prompt_token_ids": PROMPT}, SEEDED)
    sample_ids = ["a", "a#1", "a#2", "a#3"]
    all_samples = [eng.requests[s] for s in sample_ids]
    for _ in range(steps):
        eng.step()
    eng.abort_request("a")
    assert all(s.finish_reason == "abort" for s in all_samples)
    assert not eng.parents and not eng.requests
    assert_all_blocks_free(llm)
    eng.add_request("a", {"prompt_token_ids": PROMPT}, SEEDED)   # the ids are free again
    eng.abort_request("a")


@pytest.mark.parametrize("forked", [False, True], ids=["before-the-fork", "after-the-fork"])
def test_one_sample_aborted_alone_leaves_the_others_running(forked):
    llm = llm_for()
    eng = llm.llm_engine
    eng.add_request("b", {"prompt_token_ids": PROMPT}, params(output_kind=RequestOutputKind.FINAL_ONLY))
    if forked:
        eng.step()
    eng.abort_request("b#2")
    (out,) = [o for o in drain(eng) if o.request_id == "b"]
    assert [c.finish_reason for c in out.outputs] == ["length", "length", "abort", "length"]
    assert [len(c.token_ids) for c in out.outputs] == [10, 10, 1 if forked else 0, 10]
    assert_all_blocks_free(llm)


def test_a_failing_sample_fails_its_request_alone():
    llm = llm_for()
    eng = llm.llm_engine
    append = eng._append_tokens

    def broken(req, tokens):
        if req.request_id == "e#2" and req.num_output_tokens == 2:
            raise RuntimeError("detokenizer broke")
        return append(req, tokens)

    eng._append_tokens = broken
    try:
        eng.add_request("e", {"prompt_token_ids": PROMPT}, SEEDED)
        eng.add_request("ok", {"prompt_token_ids": OTHERS[0]}, params(n=1))
        failed, outs = {}, []
        while eng.has_unfinished_requests():
            outs += eng.step()
            failed.update(eng.last_step_failures)
    finally:
        del eng._append_tokens
    assert list(failed) == ["e"] and "detokenizer broke" in failed["e"]
    last = [o for o in outs if o.request_id == "e"][-1]
    assert last.finished and "detokenizer broke" in last.error
    assert [o for o in outs if o.request_id == "ok"][-1].outputs[0].finish_reason == "length"
    assert not eng.parents
    assert_all_blocks_free(llm)


def test_preemption_and_short_seats_keep_samples_exact():
    """A small pool preempts samples; two seats park forked samples in the queue (they recompute
    their prompt later). Either way every sample is exact and every block returns."""
    roomy = samples(llm_for(), PROMPT, params(max_tokens=40))
    for kw in (dict(num_kv_blocks=12), dict(max_num_seqs=2)):
        llm = llm_for(**kw)
        (out,) = generate(llm, [PROMPT], params(max_tokens=40))
        assert [c.token_ids for c in out.outputs] == roomy
        frame = llm.llm_engine.steps_frame()
        assert frame.num_preemptions.sum() > 0 if "num_kv_blocks" in kw else frame.num_running.max() == 2


def test_request_ids_of_samples_cannot_be_reused_while_running():
    eng = llm_for().llm_engine
    eng.add_request("x#1", {"prompt_token_ids": OTHERS[0]}, params(n=1))
    with pytest.raises(ValueError, match="x#1"):
        eng.add_request("x", {"prompt_token_ids": PROMPT}, SEEDED)
    assert "x" not in eng.requests and "x" not in eng.parents
    drain(eng)
    free = samples(llm_for(), PROMPT, params(max_tokens=8))
    # A token only sample 0 draws early: it stops there while the others run on.
    stop = next(t for t in free[0] if all(t not in other for other in free[1:]))
    eng.add_request("y", {"prompt_token_ids": PROMPT}, params(max_tokens=8, stop_token_ids=[stop]))
    while "y" in eng.requests:
        eng.step()
    assert "y#1" in eng.requests and "y" in eng.parents
    with pytest.raises(ValueError, match="'y'"):
        eng.add_request("y", {"prompt_token_ids": PROMPT}, SEEDED)
    drain(eng)
    assert not eng.parents


# ---- speculative decoding ----------------------------------------------------------------------------

class SampleOracle:
    """Proposes each sample's known answer (by sample index): right proposals except every
    ``wrong_every``-th, so verify steps accept several tokens and sometimes roll back."""

    def __init__(self, answers: list[list[int]], k: int, wrong_every: int = 0):
        self.answers, self.k, self.wrong_every, self.calls = answers, k, wrong_every, 0

    def propose(self, req) -> list[int]:
        self.calls += 1
        true = self.answers[req.sample_index][req.num_output_tokens:][:self.k]
        if self.wrong_every and self.calls % self.wrong_every == 0 and true:
            true[-1] = (true[-1] + 1) % 100
        return true


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_speculative_decoding_applies_per_sample(greedy):
    p = params(temperature=0.0, seed=None, max_tokens=24) if greedy else params(max_tokens=24)
    want = samples(llm_for(), PROMPT, p)
    llm = LLM("tiny-llama", **ENGINE)
    eng = llm.llm_engine
    # Wrong proposals change which draws a seeded row gets, so only greedy runs may have them.
    eng.proposer, eng.scheduler.num_lookahead_tokens = SampleOracle(want, 4, 3 if greedy else 0), 4
    assert samples(llm, PROMPT, p) == want
    steps = eng.steps_frame()
    assert steps.num_accepted_spec_tokens.sum() > 0
    assert (steps.num_decode_tokens > 0).sum() < 24 / 2, "each sample verifies its own proposals"


# ---- metrics and the server's engine thread ----------------------------------------------------------

def test_metrics_count_the_prompt_once_and_every_sample():
    llm = LLM("tiny-llama", **ENGINE)
    samples(llm, PROMPT)
    snap = llm.llm_engine.snapshot()
    assert snap["vllm:prompt_tokens"] == len(PROMPT)
    assert snap["vllm:generation_tokens"] == 40
    frame = llm.llm_engine.requests_frame()
    assert sorted(frame.request_id) == ["0", "0#1", "0#2", "0#3"]   # a row per sample
    assert (frame.prompt_tokens == len(PROMPT)).all() and (frame.output_tokens == 10).all()
    assert frame.ttft_s.notna().all() and frame.queue_s.nunique() == 1


def test_async_engine_delivers_a_request_with_n_samples():
    eng = LLM("tiny-llama", **ENGINE).llm_engine

    async def main():
        ae = AsyncEngine(eng)
        ae.start()
        try:
            q = ae.submit("r", {"prompt_token_ids": PROMPT}, params(output_kind=RequestOutputKind.DELTA))
            outs = []
            while not outs or not outs[-1].finished:
                outs.append(await asyncio.wait_for(q.get(), 60))
            for _ in range(100):   # the engine thread drops the sink after the last output
                if "r" not in ae._sinks:
                    break
                await asyncio.sleep(0.05)
            return outs, dict(ae._sinks)
        finally:
            ae.stop()

    outs, sinks = asyncio.run(main())
    assert {o.request_id for o in outs} == {"r"} and not sinks
    tokens = {j: sum(len(c.token_ids) for o in outs for c in o.outputs if c.index == j) for j in range(4)}
    assert tokens == {j: 10 for j in range(4)}
