"""Penalties, biases, allowed ids and bad words: each against its formula as vLLM defines it, on
hand-computed small logits, then through the engine (greedy choices move as the formula says)."""

from __future__ import annotations

import math

import pytest
import torch

from minserve.engine.penalties import apply_logits_controls, bad_word_bans, bad_words_token_ids
from minserve.engine.sampler import Sampler, SamplingBatch
from minserve.sampling_params import SamplingParams

from reference import hf_model

LOGITS = [1.0, 2.0, -1.0, 0.5, -2.0, 3.0]
NEG = -math.inf


def _process(params: list[SamplingParams], outputs=None, prompts=None, banned=None) -> list[list[float]]:
    logits = torch.tensor([LOGITS] * len(params))
    out = apply_logits_controls(logits, params, outputs, prompts, [], None, banned or [[] for _ in params])
    assert logits.tolist() == [LOGITS] * len(params), "the caller's logits must not change"
    return out.tolist()


def _with_bad_words(ids: list[list[int]], **kw) -> SamplingParams:
    p = SamplingParams(bad_words=["x"], **kw)  # the engine tokenizes; here the ids are given
    p._bad_words_token_ids = ids
    return p


def test_frequency_and_presence_count_output_tokens_only():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # Token 1 twice in the output, token 3 once; token 5 only in the prompt (not penalized).
    got = _process([p], outputs=[[1, 3, 1]], prompts=[[5, 5]])[0]
    want = [1.0, 2.0 - 0.5 * 2 - 0.25, -1.0, 0.5 - 0.5 - 0.25, -2.0, 3.0]
    assert got == pytest.approx(want)


def test_negative_penalties_reward_repeats():
    got = _process([SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0)], outputs=[[4, 4, 4]])[0]
    assert got[4] == pytest.approx(-2.0 + 3 * 1.0 + 2.0)
    assert got[:4] == pytest.approx(LOGITS[:4])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    p = SamplingParams(repetition_penalty=2.0)
    # Prompt holds 0 (positive) and 2 (negative); the output holds 5 (positive) and 4 (negative).
    got = _process([p], outputs=[[5, 4]], prompts=[[0, 2, 0]])[0]
    assert got == pytest.approx([0.5, 2.0, -2.0, 0.5, -4.0, 1.5])


def test_repetition_then_frequency_then_presence_in_vllm_order():
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.1)
    got = _process([p], outputs=[[5, 5]], prompts=[[1]])[0]
    assert got[5] == pytest.approx(3.0 / 1.5 - 0.4 * 2 - 0.1)
    assert got[1] == pytest.approx(2.0 / 1.5)  # prompt only: repetition, not frequency/presence


def test_logit_bias_is_added_and_clamped_to_100():
    p = SamplingParams(logit_bias={2: 5.0, "4": -1.5, 0: 1e9})
    assert p.logit_bias == {2: 5.0, 4: -1.5, 0: 100.0}
    assert _process([p])[0] == pytest.approx([101.0, 2.0, 4.0, 0.5, -3.5, 3.0])


def test_logit_bias_comes_before_the_repetition_penalty():
    # vLLM applies logit_bias (a logits processor) before the penalties: 3 - 4 = -1, then * 2.
    p = SamplingParams(logit_bias={5: -4.0}, repetition_penalty=2.0)
    assert _process([p], outputs=[[5]], prompts=[[]])[0][5] == pytest.approx(-2.0)


def test_allowed_token_ids_mask_everything_else():
    got = _process([SamplingParams(allowed_token_ids=[0, 4])])[0]
    assert got == [1.0, NEG, NEG, NEG, -2.0, NEG]


def test_bad_words_single_token_always_banned_multi_token_only_after_its_prefix():
    p = _with_bad_words([[3], [1, 2], [0, 1, 4]])
    assert bad_word_bans(p, []) == [3]
    assert bad_word_bans(p, [5, 1]) == [3, 2]
    assert bad_word_bans(p, [0, 1]) == [3, 2, 4]
    assert bad_word_bans(p, [1, 5]) == [3]
    got = _process([p, p], outputs=[[5, 1], [2]])
    assert got[0] == [1.0, 2.0, NEG, NEG, -2.0, 3.0]
    assert got[1] == [1.0, 2.0, -1.0, NEG, -2.0, 3.0]


def test_bad_words_tokenized_with_and_without_a_leading_space():
    from minserve.models.loader import _smollm2_tokenizer_dir, load_tokenizer
    tok = load_tokenizer(_smollm2_tokenizer_dir())
    ids = bad_words_token_ids(["hello", " world peace"], tok)
    assert tok.encode("hello", add_special_tokens=False) in ids
    assert tok.encode(" hello", add_special_tokens=False) in ids
    assert tok.encode("world peace", add_special_tokens=False) in ids
    assert all(tok.decode(w).strip() in ("hello", "world peace") for w in ids)


def test_rows_without_controls_are_untouched_and_a_plain_batch_is_not_copied():
    logits = torch.tensor([LOGITS, LOGITS])
    plain = SamplingParams()
    assert apply_logits_controls(logits, [plain, plain], None, None, [], None, [[], []]) is logits
    got = _process([plain, SamplingParams(logit_bias={1: 1.0})])
    assert got[0] == LOGITS and got[1][1] == 3.0


def test_controls_change_the_greedy_and_sampled_choice_but_not_the_logprobs():
    logits = torch.tensor([LOGITS] * 3)
    params = [SamplingParams(temperature=0, logit_bias={4: 10.0}, logprobs=1),
              SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[2], logprobs=1),
              SamplingParams(temperature=0, presence_penalty=2.0, logprobs=0)]
    out = Sampler()(logits, SamplingBatch(params, [None, torch.Generator().manual_seed(1), None],
                                          [[], [], []], output_token_ids=[None, None, [5]]))
    assert out.token_ids == [4, 2, 1]  # row 2: 3.0 - 2 = 1.0 < 2.0
    raw = torch.log_softmax(logits[0], dim=-1)
    for row, tok in enumerate(out.token_ids):
        assert out.logprobs[row][0] == (tok, pytest.approx(raw[tok].item()))


def test_a_row_left_with_nothing_to_sample_raises():
    p = SamplingParams(allowed_token_ids=[2], min_tokens=1)
    with pytest.raises(ValueError, match="no token"):
        _process([p], banned=[[2]])


def test_sampler_refuses_a_penalty_row_without_its_history():
    batch = SamplingBatch([SamplingParams(repetition_penalty=1.2)], [None], [[]], output_token_ids=[[1]])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sampler()(torch.tensor([LOGITS]), batch)


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(logit_bias={1: "x"}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
])
def test_invalid_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={49152: 1.0}), "logit_bias"), (dict(allowed_token_ids=[0, 10**6]), "allowed_token_ids"),
])
def test_out_of_vocab_ids_are_refused_at_add_request(tiny_llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny_llm.llm_engine.add_request("oov", "hi", SamplingParams(**kwargs))
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def _greedy_ids(llm, prompt: str, max_tokens: int = 12, **kw) -> list[int]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_engine_logit_bias_plus_100_makes_greedy_emit_the_token(tiny_llm):
    assert _greedy_ids(tiny_llm, "The weather today", logit_bias={1234: 100}) == [1234] * 12


def test_engine_allowed_token_ids_restrict_sampled_output(tiny_llm):
    allowed = [17, 400, 9001]
    out = tiny_llm.generate(["Once upon a time"] * 4, SamplingParams(
        temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed), use_tqdm=False)
    tokens = {t for o in out for t in o.outputs[0].token_ids}
    assert tokens <= set(allowed) and len(tokens) > 1


def test_engine_bad_words_never_appear(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    plain = _greedy_ids(tiny_llm, "Tell me a story")
    # Ban the word of the most frequent greedy token (both its spellings, as vLLM tokenizes it).
    word = tok.decode([max(set(plain), key=plain.count)]).strip()
    assert word, "the test needs a token with a visible word"
    banned = {w[0] for w in bad_words_token_ids([word], tok) if len(w) == 1}
    assert banned & set(plain)
    out = _greedy_ids(tiny_llm, "Tell me a story", bad_words=[word])
    assert not banned & set(out) and out != plain


def test_engine_penalized_request_is_the_same_alone_and_in_a_batch(tiny_llm):
    """The same penalized greedy request alone and in a batch with plain ones gives the same ids."""
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.3)
    alone = _greedy_ids(tiny_llm, "Numbers: one two", **kw)
    out = tiny_llm.generate(["Numbers: one two", "plain"], [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    assert out[0].outputs[0].token_ids == alone


def test_engine_repetition_penalty_matches_transformers(tiny_llm):
    """transformers' RepetitionPenaltyLogitsProcessor is the same formula over prompt + output."""
    text = "the cat sat on the mat the cat"
    prompt = tiny_llm.get_tokenizer()(text).input_ids
    model = hf_model(str(tiny_llm.llm_engine.config_path))
    plain = _greedy_ids(tiny_llm, text, max_tokens=16)
    changed = []
    for penalty in (3.0, 0.2):  # 0.2 favours the prompt's tokens, so that continuation changes
        ours = tiny_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty), use_tqdm=False)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, repetition_penalty=penalty, pad_token_id=0)
        ids = ours[0].outputs[0].token_ids
        assert ids == ref[0, len(prompt):].tolist(), penalty
        changed.append(ids != plain)
    assert changed[1], "a penalty below 1 should change this continuation"


def test_grammar_bitmask_masks_exactly_the_unset_bits(monkeypatch):
    """Bit b of word w allows token 32w + b; the torch fallback and xgrammar's kernel agree."""
    import sys

    from minserve.engine.penalties import apply_token_bitmask
    vocab, rows = 70, [0, 2]
    allowed = {0: {0, 31, 32, 69}, 2: {5, 40}}
    bitmask = torch.zeros((2, 3), dtype=torch.int32)
    for j, row in enumerate(rows):
        for t in allowed[row]:
            bitmask[j, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)  # bit 31 wraps negative
    results = []
    for blocked in (False, True):
        if blocked:  # the fallback: pretend xgrammar is not installed
            monkeypatch.setitem(sys.modules, "xgrammar", None)
        logits = torch.zeros((3, vocab))
        apply_token_bitmask(logits, rows, bitmask)
        results.append(logits)
        for row in rows:
            assert set((logits[row] == 0).nonzero().squeeze(1).tolist()) == allowed[row]
        assert (logits[1] == 0).all()
    assert torch.equal(results[0], results[1])
