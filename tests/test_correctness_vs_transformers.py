"""Greedy outputs equal transformers' generate, token for token (or depart only at a near-tie)."""

import pytest

from minserve import SamplingParams
from prompts import mixed_prompts
from reference import check_greedy_close, hf_greedy, hf_greedy_batch
from conftest import assert_all_blocks_free

GREEDY = dict(temperature=0, ignore_eos=True)


def _compare(llm, prompts, max_tokens, batched: bool):
    path = str(llm.llm_engine.config_path)
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    if batched:   # transformers too runs the batch at once (left-padded): one generate, not one a prompt
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        refs = hf_greedy_batch(path, prompts, max_tokens)
    else:
        outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
        refs = [hf_greedy(path, p, max_tokens) for p in prompts]
    exact = 0
    for i, (p, o, (ref, ref_lp)) in enumerate(zip(prompts, outs, refs)):
        matched = check_greedy_close(o.outputs[0].token_ids, ref, ref_lp, f"prompt {i} ({len(p)} tokens)")
        exact += matched == max_tokens
    assert_all_blocks_free(llm)
    return exact


# Both decode paths: the fused C kernel (the default on CPU) and the PyTorch model.
TINY_ENGINES = pytest.mark.parametrize("engine", ["tiny_llm", "tiny_llm_torch_decode"])


@TINY_ENGINES
def test_tiny_batch1_exact(engine, request):
    tiny_llm = request.getfixturevalue(engine)
    prompts = mixed_prompts(tiny_llm.get_tokenizer(), 3, 5, 120)
    assert _compare(tiny_llm, prompts, 24, batched=False) == 3


@TINY_ENGINES
def test_tiny_batch_of_20_mixed_lengths(engine, request):
    tiny_llm = request.getfixturevalue(engine)
    prompts = mixed_prompts(tiny_llm.get_tokenizer(), 20, 1, 300, seed=1)
    exact = _compare(tiny_llm, prompts, 24, batched=True)
    assert exact >= 18, f"only {exact}/20 sequences matched exactly"


@pytest.mark.slow
def test_smollm2_batch1_exact(smol_llm):
    prompts = mixed_prompts(smol_llm.get_tokenizer(), 2, 20, 200, seed=2)
    assert _compare(smol_llm, prompts, 32, batched=False) == 2


@pytest.mark.slow
def test_smollm2_batch_of_16_mixed_lengths(smol_llm):
    prompts = mixed_prompts(smol_llm.get_tokenizer(), 16, 4, 250, seed=3)
    exact = _compare(smol_llm, prompts, 24, batched=True)
    assert exact >= 12, f"only {exact}/16 sequences matched exactly"
