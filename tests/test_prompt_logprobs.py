"""SamplingParams.prompt_logprobs (vLLM's field): values, layout, chunking, caching, fused path."""

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.engine import model_runner
from minserve.sampling_params import RequestOutputKind
from conftest import assert_all_blocks_free
from prompts import mixed_prompts
from reference import hf_model

TOL = 1e-4  # nats; fp32 implementations that differ in summation order agree far closer


@pytest.fixture(scope="module")
def chunked():
    """Prefill in chunks of 16 tokens: a prompt's logprobs come from several steps."""
    return LLM("tiny-llama", max_num_batched_tokens=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def whole():
    return LLM("tiny-llama", max_num_batched_tokens=512, num_kv_blocks=256)


def hf_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    """transformers' next-token log-distributions [len(prompt) - 1, vocab] for the prompt."""
    with torch.no_grad():
        logits = hf_model(str(llm.llm_engine.config_path))(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def run(llm, prompts, n=2, **kw):
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 1), prompt_logprobs=n, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return outs


def check_against(ref: torch.Tensor, prompt: list[int], pl, n: int) -> None:
    """Layout and values: None first; then the actual token (its logprob and rank) and the top n."""
    assert pl[0] is None and len(pl) == len(prompt)
    for i in range(1, len(prompt)):
        d, row, tok = pl[i], ref[i - 1], prompt[i]
        assert abs(d[tok].logprob - row[tok].item()) < TOL, f"position {i}"
        lp = row[tok].item()
        assert (row > lp + TOL).sum() + 1 <= d[tok].rank <= (row > lp - TOL).sum() + 1
        top = [(t, x) for t, x in d.items() if x.rank <= n]
        assert sorted(x.rank for _, x in top) == list(range(1, n + 1))
        kth = row.topk(n).values[-1].item()
        for t, x in top:
            assert abs(x.logprob - row[t].item()) < TOL and x.logprob > kth - TOL
        assert set(d) <= {tok} | {t for t, _ in top} and d[tok].decoded_token is not None


def test_validation():
    assert SamplingParams().prompt_logprobs is None
    for bad in (-1, 21, "1", 1.0, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_matches_transformers_and_chunking_changes_nothing(chunked, whole):
    prompts = mixed_prompts(chunked.get_tokenizer(), 5, 1, 90, seed=4)
    a, b = run(chunked, prompts, n=3), run(whole, prompts, n=3)
    for p, x, y in zip(prompts, a, b):
        ref = hf_logprobs(chunked, p)
        check_against(ref, p, x.prompt_logprobs, 3)
        check_against(ref, p, y.prompt_logprobs, 3)
    steps = chunked.llm_engine.steps_frame()
    assert (steps.num_prefill_tokens <= 16).all()


def test_only_when_asked(whole):
    out = whole.generate("Hello there", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    out = run(whole, [[42]], n=0)[0]
    assert out.prompt_logprobs == [None]  # one prompt token: nothing before it to predict it
    d = run(whole, [[42, 43, 44]], n=0)[0].prompt_logprobs
    assert [list(x) for x in d[1:]] == [[43], [44]]


def test_no_prefix_cache_hits(whole):
    """A prompt whose blocks are cached is still computed whole when it asks for prompt logprobs
    (the hit would skip the rows its logprobs need), and that lookup is not counted as a query."""
    prompt = mixed_prompts(whole.get_tokenizer(), 1, 70, 70, seed=5)[0]
    whole.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    again = whole.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # the cache works for requests that do not ask
    out = run(whole, [prompt])[0]
    assert out.num_cached_tokens == 0
    last = whole.llm_engine.last_step_stats
    assert last.prefix_cache_hits == 0 and last.prefix_cache_queries == 0
    check_against(hf_logprobs(whole, prompt), prompt, out.prompt_logprobs, 2)


def test_head_runs_in_bounded_chunks(whole, monkeypatch):
    """The LM head never sees more prompt rows at once than PROMPT_LOGPROBS_CHUNK_ROWS."""
    prompt = mixed_prompts(whole.get_tokenizer(), 1, 100, 100, seed=6)[0]
    expected = run(whole, [prompt])[0].prompt_logprobs
    model = whole.llm_engine.runner.model
    seen = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: seen.append(h.shape[0]) or real(h))
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_CHUNK_ROWS", 7)
    out = run(whole, [prompt])[0].prompt_logprobs
    assert sorted(seen)[-2:] == [7, 7] and sum(seen) == len(prompt) - 1 + 1  # + the sampled row
    assert len(seen) == -(-(len(prompt) - 1) // 7) + 1
    for x, y in zip(out[1:], expected[1:]):
        assert {t: v.logprob for t, v in x.items()} == pytest.approx({t: v.logprob for t, v in y.items()}, abs=TOL)


def test_fused_path_unaffected(whole):
    """Short prompts that the fused C step would take still get prompt logprobs (the step runs in
    PyTorch); decode steps after the prompt stay fused, and the sampled tokens do not change."""
    runner = whole.llm_engine.runner
    fused = [e for e in runner.executors if e.name == "fused-cpu"]
    if not fused:
        pytest.skip("the fused C decode step is unavailable here")
    calls = []
    real_run = fused[0].run
    fused[0].run = lambda *a: calls.append(1) or real_run(*a)
    try:
        prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
        plain = whole.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        before = len(calls)
        asked = run(whole, prompts, max_tokens=6, ignore_eos=True)
    finally:
        del fused[0].run
    assert before > 0 and len(calls) > before  # decodes of both runs went through the fused step
    for p, x, y in zip(prompts, plain, asked):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        check_against(hf_logprobs(whole, p), p, y.prompt_logprobs, 2)


def test_preempted_request_keeps_its_prompt_logprobs(chunked):
    """Preempted mid-prompt, the request recomputes from 0; what it had recorded is not repeated."""
    prompt = mixed_prompts(chunked.get_tokenizer(), 1, 50, 50, seed=7)[0]
    eng = chunked.llm_engine
    eng.add_request("p", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    eng.step()
    req = eng.requests["p"]
    assert len(req.prompt_logprobs) == 16  # the row of position 15 predicts token 16
    eng.scheduler._preempt(req)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert req.num_preemptions == 1
    check_against(hf_logprobs(chunked, prompt), prompt, outs[-1].prompt_logprobs, 1)


def test_delta_stream_sends_them_once(whole):
    eng = whole.llm_engine
    eng.add_request("d", {"prompt_token_ids": [7, 8, 9, 10]}, SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert len(outs) == 3 and len(outs[0].prompt_logprobs) == 4
    assert all(o.prompt_logprobs is None for o in outs[1:])


@pytest.mark.slow
def test_default_model_matches_transformers(smol_llm):
    prompt = mixed_prompts(smol_llm.get_tokenizer(), 1, 60, 60, seed=8)[0]
    out = run(smol_llm, [prompt], n=2)[0]
    check_against(hf_logprobs(smol_llm, prompt), prompt, out.prompt_logprobs, 2)
