"""Logits controls are prepared once per request, off the step (issue 20 item 2).

``LLMEngine.prepare_params`` (the server runs it on its tokenizer threads) tokenizes bad words,
compiles grammars and builds the allowed-ids mask and the logit-bias tensors; ``add_request`` does
not redo it, and a step uses the tensors without walking the request's lists (asserted by counting
iterations, not by timing: benchmarks/bench_logits_controls.py measures the time). The results are
those of the plain formulas, to the bit."""

import dataclasses
import random
import re
import threading

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.engine.penalties import apply_logits_controls, bad_word_bans
from minserve.sampling_params import StructuredOutputsParams
from conftest import assert_all_blocks_free

VOCAB = 49152  # tiny-llama's


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=128)


class CountingList(list):
    """A list that counts how often Python code walks it."""
    walks = 0

    def __iter__(self):
        CountingList.walks += 1
        return super().__iter__()


class CountingDict(dict):
    walks = 0

    def _walk(self, it):
        CountingDict.walks += 1
        return it

    def __iter__(self):
        return self._walk(super().__iter__())

    def items(self):
        return self._walk(super().items())

    def keys(self):
        return self._walk(super().keys())

    def values(self):
        return self._walk(super().values())


def _ids(llm, prompt_ids, params):
    outs = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    return outs[0].outputs[0].token_ids


def _in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.update(r=fn(*args)))
    t.start()
    t.join()
    return box.get("r")


def test_a_step_never_walks_allowed_token_ids_or_logit_bias(llm):
    """Full-vocabulary lists: preparing them walks them; the steps after that do not (today's code
    rebuilt Python index lists over every entry at every step)."""
    eng = llm.llm_engine
    allowed = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    allowed.allowed_token_ids = CountingList(range(VOCAB))
    bias = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bias.logit_bias = CountingDict({t: 0.0 for t in range(VOCAB)})
    eng.add_request("allowed", {"prompt_token_ids": list(range(100, 120))}, allowed)
    eng.add_request("bias", {"prompt_token_ids": list(range(200, 220))}, bias)
    walked = CountingList.walks, CountingDict.walks
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    assert steps >= 8
    assert (CountingList.walks, CountingDict.walks) == walked
    assert_all_blocks_free(llm)


def test_full_vocabulary_allowed_ids_and_zero_biases_change_no_token(llm):
    """Every token allowed, every bias 0: the same tokens as the plain request, greedy and seeded."""
    prompt = list(range(300, 330))
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=11)):
        plain = _ids(llm, prompt, SamplingParams(max_tokens=10, ignore_eos=True, **kw))
        for extra in (dict(allowed_token_ids=list(range(VOCAB))), dict(logit_bias=dict.fromkeys(range(VOCAB), 0.0)),
                      dict(allowed_token_ids=list(range(VOCAB)), logit_bias=dict.fromkeys(range(VOCAB), 0.0))):
            params = SamplingParams(max_tokens=10, ignore_eos=True, **kw, **extra)
            _in_thread(llm.llm_engine.prepare_params, params)
            assert _ids(llm, prompt, params) == plain, (kw, list(extra))


def test_bad_words_prepared_on_a_thread_are_not_tokenized_again(llm, monkeypatch):
    eng = llm.llm_engine
    tok = eng.tokenizer
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(a) or real(*a, **k))
    prompt = list(range(400, 430))
    plain = _ids(llm, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    word = tok.decode([max(set(plain), key=plain.count)]).strip()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word, "the the"])
    _in_thread(eng.prepare_params, params)
    tokenized = len(calls)
    assert tokenized > 0 and params._bad_words_token_ids
    _in_thread(eng.prepare_params, params)  # idempotent (a second call may redo, must not break)
    tokenized = len(calls)
    out = _ids(llm, prompt, params)
    # A copy the server makes per prompt of a batch keeps the preparation too.
    copy = dataclasses.replace(params, max_tokens=11)
    assert copy._bad_words_token_ids is None  # a non-init field: replace drops it...
    out_copy = _ids(llm, prompt, copy)
    assert len(calls) == tokenized, "add_request tokenized bad words prepared before"
    banned = {w[0] for w in params._bad_words_token_ids if len(w) == 1}
    assert banned & set(plain) and not banned & set(out) and out != plain
    assert out_copy == out[:11]
    # A copy whose bad words changed is prepared again.
    other = dataclasses.replace(params, bad_words=["zebra"])
    _ids(llm, prompt, other)
    assert len(calls) > tokenized


def test_concurrent_prepare_params_compile_each_grammar_once(llm):
    """Threads preparing the same and different grammars at once: each spec is compiled once,
    every params gets the right grammar, and the steps compile nothing."""
    eng = llm.llm_engine
    grammar = eng.grammar
    patterns = [f"(x{i}|y{i}){{2,4}}z" for i in range(4)]  # specs no other test compiles
    params = [SamplingParams(temperature=1.0, seed=j, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=patterns[j % 4]))
              for j in range(16)]
    misses = grammar.cache_misses
    barrier = threading.Barrier(8)

    def work(chunk):
        barrier.wait()
        for p in chunk:
            eng.prepare_params(p)
    threads = [threading.Thread(target=work, args=(params[k::8],)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert grammar.cache_misses == misses + 4
    compiled = [p._prepared.grammar[1] for p in params]
    for j in range(16):
        assert compiled[j] is compiled[j % 4] and compiled[j] is grammar.compile(params[j].structured_outputs)
    hits, misses = grammar.cache_hits, grammar.cache_misses
    outs = llm.generate(["hello"] * 16, params, use_tqdm=False)
    assert (grammar.cache_hits, grammar.cache_misses) == (hits, misses)
    for j, o in enumerate(outs):
        assert re.fullmatch(patterns[j % 4], o.outputs[0].text), o.outputs[0].text
    assert_all_blocks_free(llm)


def test_params_prepared_by_another_engine_are_prepared_again(llm):
    other = LLM("tiny-llama", max_num_seqs=2, num_kv_blocks=16).llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, allowed_token_ids=[5, 6])
    other.prepare_params(params)
    first = params._prepared
    llm.llm_engine.add_request("elsewhere", "hi", params)
    assert params._prepared is not first and params._prepared.owner is llm.llm_engine._prepared_key
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


# ---- the prepared tensors against the plain formulas -------------------------------------------------

def _reference(logits, params, outputs):
    """Today's formulas, written out per entry: allowed ids, bad words, logit bias."""
    out = logits.clone()
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = torch.full_like(out[i], float("-inf"))
            keep[p.allowed_token_ids] = out[i][p.allowed_token_ids]
            out[i] = keep
        for t in bad_word_bans(p, outputs[i]) if p.bad_words else ():
            out[i, t] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            out[i, t] = out[i, t] + torch.tensor(b, dtype=out.dtype)
    return out


def test_prepared_controls_equal_the_formulas_to_the_bit():
    rng = random.Random(0)
    vocab = 300
    params, outputs = [], []
    for _ in range(12):
        p = SamplingParams(
            allowed_token_ids=rng.sample(range(vocab), rng.randrange(1, vocab)) if rng.random() < 0.5 else None,
            logit_bias={t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), rng.randrange(1, vocab))}
            if rng.random() < 0.5 else None,
            bad_words=["w"] if rng.random() < 0.7 else None)
        if p.bad_words:  # the engine tokenizes; here random words of 1-3 tokens, some sharing prefixes
            p._bad_words_token_ids = [[rng.randrange(8) for _ in range(rng.randrange(1, 4))] for _ in range(40)]
        params.append(p)
        outputs.append([rng.randrange(8) for _ in range(rng.randrange(0, 6))])
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(209)) * 5
    dead = {}
    got = apply_logits_controls(logits, params, outputs, None, [], None, [[] for _ in params],
                                dead_rows=dead)
    want = _reference(logits, params, outputs)
    assert set(dead) == {i for i in range(len(params)) if want[i].max() == float("-inf")}
    live = [i for i in range(len(params)) if i not in dead]
    assert len(live) >= 10 and torch.equal(got[live], want[live])
