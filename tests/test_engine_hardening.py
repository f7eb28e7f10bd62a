"""Adversarial cases found against the engine (issue 8): one request must never fail its
neighbours, bad values are refused at ``add_request``, records stay bounded, nothing waits forever.

Each test reproduces a defect that was seen; a busy step always holds well-behaved requests beside
the bad one, and those must come out exactly as they do without it."""

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.llm_engine import LLMEngine
from conftest import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _drain(eng):
    """Step until idle; every output of every request, last one per id."""
    last = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            last[out.request_id] = out
    return last


def _engine(**kw):
    args = dict(max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=128)
    args.update(kw)
    return LLM("tiny-llama", **args)


@pytest.fixture(scope="module")
def llm():
    return _engine()


def _neighbours(eng, n=4):
    for i in range(n):
        eng.add_request(f"ok{i}", {"prompt_token_ids": list(range(100 + 7 * i, 130 + 7 * i))}, GREEDY)


@pytest.fixture(scope="module")
def clean_tokens(llm):
    """What the neighbours produce with no bad request beside them."""
    eng = llm.llm_engine
    _neighbours(eng)
    return {rid: out.outputs[0].token_ids for rid, out in _drain(eng).items()}


# ---- 1: logprobs in a mixed batch ------------------------------------------------------------------

def test_logprobs_request_beside_plain_ones(llm, clean_tokens):
    eng = llm.llm_engine
    _neighbours(eng)
    eng.add_request("lp", "x", SamplingParams(temperature=0, max_tokens=5, logprobs=1))
    eng.add_request("lp0", "y", SamplingParams(temperature=0.7, max_tokens=5, logprobs=0, seed=3))
    outs = _drain(eng)
    for rid, toks in clean_tokens.items():
        c = outs[rid].outputs[0]
        assert c.finish_reason == "length" and c.token_ids == toks
        assert c.logprobs is None and c.cumulative_logprob is None  # asked for none: None, not []
    for rid, n_top in (("lp", 1), ("lp0", 0)):
        c = outs[rid].outputs[0]
        assert c.finish_reason == "length" and len(c.logprobs) == len(c.token_ids) == 5
        for tok, d in zip(c.token_ids, c.logprobs):
            assert tok in d and len(d) <= 1 + n_top
    assert_all_blocks_free(llm)


# ---- 2: bad values are refused where they enter ------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(cache_salt="\ud800"), "cache_salt"),
    (dict(prompt="hello \udcff world"), "prompt"),
    (dict(params=SamplingParams(min_tokens=1, stop_token_ids=list(range(49152)))), "stop_token_ids"),
    # EOS (id 2) is banned too until min_tokens are out, unless ignore_eos.
    (dict(params=SamplingParams(min_tokens=2, stop_token_ids=[0, 1] + list(range(3, 49152)))),
     "stop_token_ids"),
])
def test_add_request_refuses_values_that_would_fail_a_step(llm, kwargs, field):
    eng = llm.llm_engine
    args = dict(prompt="hello", params=GREEDY)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        eng.add_request("bad", args.pop("prompt"), args.pop("params"), **args)
    assert "bad" not in eng.requests and not eng.has_unfinished_requests()


def test_stop_strings_must_be_valid_unicode():
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        SamplingParams(stop=["ok", "\ud83d"])


def test_min_tokens_with_most_of_the_vocab_banned_still_runs(llm):
    # One allowed token left: legal, and the request must run (not be refused).
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=3,
                            stop_token_ids=list(range(0, 49151)), ignore_eos=True)
    eng.add_request("narrow", "hi", params)
    out = _drain(eng)["narrow"].outputs[0]
    assert out.token_ids[:2] == [49151, 49151]
    assert_all_blocks_free(llm)


# ---- 2: a failure tied to one request stays with that request ---------------------------------------

def _fail_when(monkeypatch, obj, name, rid):
    """Make ``obj.name`` raise whenever request ``rid`` is involved in the call."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        if rid in repr(args):
            raise RuntimeError(f"injected failure for {rid}")
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, wrapper)


@pytest.mark.parametrize("where", ["runner", "output", "scheduler"])
def test_failure_of_one_request_inside_a_busy_step(llm, clean_tokens, monkeypatch, where):
    eng = llm.llm_engine
    errors_before = eng.snapshot().get('vllm:request_success{finished_reason="error"}', 0)
    _neighbours(eng)
    eng.add_request("poison", "a prompt that will fail", SamplingParams(temperature=0.8, max_tokens=8))
    if where == "runner":
        real = eng.runner.execute

        def execute(sched, kv):
            if any(s.request.request_id == "poison" for s in sched.scheduled):
                raise RuntimeError("injected failure for poison")
            return real(sched, kv)
        monkeypatch.setattr(eng.runner, "execute", execute)
    elif where == "output":
        _fail_when(monkeypatch, eng.output_processor, "append_token", "poison")
    else:
        _fail_when(monkeypatch, eng.kv, "find_cached_prefix", "poison")
    outs = _drain(eng)
    bad = outs["poison"]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "injected failure for poison" in bad.error
    for rid, toks in clean_tokens.items():
        assert outs[rid].outputs[0].token_ids == toks and outs[rid].error is None
    snap = eng.snapshot()
    assert snap.get('vllm:request_success{finished_reason="error"}', 0) == errors_before + 1
    assert_all_blocks_free(llm)
    frame = eng.requests_frame()
    assert frame[frame.request_id == "poison"].finish_reason.iloc[-1] == "error"


def test_a_failing_step_with_one_request_fails_only_it(llm, monkeypatch):
    eng = llm.llm_engine
    monkeypatch.setattr(eng.runner, "execute", lambda sched, kv: 1 / 0)
    eng.add_request("alone", "hello", GREEDY)
    out = _drain(eng)["alone"]
    assert out.outputs[0].finish_reason == "error" and "ZeroDivisionError" in out.error
    assert_all_blocks_free(llm)


# ---- 7: finished requests are kept as small, bounded records -----------------------------------------

def test_request_and_step_records_are_bounded():
    llm = _engine(max_request_records=5, max_step_records=7)
    eng = llm.llm_engine
    llm.generate([{"prompt_token_ids": list(range(50, 50 + 20 + i))} for i in range(12)], GREEDY,
                 use_tqdm=False)
    frame = eng.requests_frame()
    assert len(frame) == 5 and list(frame.request_id) == [str(i) for i in range(7, 12)]
    assert (frame.output_tokens == 12).all() and list(frame.prompt_tokens) == list(range(27, 32))
    assert frame.token_times_s.map(len).tolist() == [12] * 5
    assert len(eng.step_stats) == 7 and eng.steps_frame().step.tolist() == list(
        range(eng.num_steps - 7, eng.num_steps))
    # A record keeps counts and times, not the token lists, generator or prefix-cache keys.
    rec = eng.finished_requests[-1]
    assert not hasattr(rec, "prompt_token_ids") and not hasattr(rec, "generator")


def test_record_limits_are_validated():
    with pytest.raises(ValueError, match="max_request_records"):
        LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=8, max_request_records=-1)
    with pytest.raises(ValueError, match="max_step_records"):
        LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=8, max_step_records=0)


# ---- 8: a request that could never be scheduled is refused ------------------------------------------

def test_unchunked_prompt_longer_than_the_budget_is_refused():
    llm = _engine(enable_chunked_prefill=False, max_num_batched_tokens=32)
    eng = llm.llm_engine
    with pytest.raises(ValueError, match=r"enable_chunked_prefill=False.*max_num_batched_tokens=32"):
        eng.add_request("long", {"prompt_token_ids": list(range(100, 140))}, GREEDY)
    assert not eng.has_unfinished_requests()
    # One that fits still runs, and its recompute after preemption can never outgrow the budget.
    assert eng.max_model_len <= 32
    out = llm.generate([{"prompt_token_ids": list(range(100, 120))}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"


def test_unchunked_explicit_max_model_len_over_the_budget_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len=64.*max_num_batched_tokens=32"):
        LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=16, enable_chunked_prefill=False,
                                   max_num_batched_tokens=32, max_model_len=64)


def test_inprocess_bench_steps_are_this_runs_once_the_history_is_full():
    """Step cursors are step indices: with a full, bounded history a list position would point
    at the wrong steps (or past the end)."""
    from minserve.bench.datasets import SampleRequest
    from minserve.bench.inprocess import run_inprocess
    llm = _engine(max_step_records=6)
    llm.generate([{"prompt_token_ids": list(range(50, 80))}] * 3, GREEDY, use_tqdm=False)
    eng = llm.llm_engine
    before = eng.num_steps
    assert len(eng.step_stats) == 6 < before  # the history is full
    res = run_inprocess(eng, [SampleRequest("hello there", 2, 4, "a")], ignore_eos=True,
                        disable_tqdm=True)
    assert res.steps.step.tolist() == list(range(before, eng.num_steps))
    assert res.steps.num_decode_tokens.sum() + res.steps.num_prefill_tokens.sum() == 2 + 3
