"""Speculative decoding with n-gram (prompt-lookup) proposals, through the real engine.

Greedy outputs with speculation equal those without, token for token, in mixed batches, under
preemption, with prefix caching, on the fused and the PyTorch paths; the vLLM counters add up;
requests_frame / steps_frame show acceptance; the adaptive rule turns proposals off where they
cost more than they save; bad configs are refused naming the key.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from minserve import LLM, SamplingParams
from minserve.spec.adaptive import AdaptiveSpeculation
from minserve.spec.config import parse_speculative_config
from minserve.spec.ngram import NgramProposer
from conftest import assert_all_blocks_free, generate_ids

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


class _Req(SimpleNamespace):
    @property
    def num_tokens(self):
        return len(self.tokens)

    def token_ids(self, a, b):
        return self.tokens[a:b]


def _proposer(**kw) -> NgramProposer:
    return NgramProposer(parse_speculative_config({**NGRAM, **kw}))


def test_ngram_proposes_what_followed_the_latest_occurrence():
    p = _proposer()
    assert p.propose(_Req(request_id="a", tokens=[1, 2, 3, 4, 5, 6, 9, 2, 3])) == [4, 5, 6, 9]
    # The longest suffix that occurred before is used ([7, 3], not [3] alone) ...
    assert p.propose(_Req(request_id="b", tokens=[7, 3, 1, 8, 3, 2, 7, 3])) == [1, 8, 3, 2]
    # ... and of its occurrences, the latest.
    assert p.propose(_Req(request_id="f", tokens=[3, 5, 3, 6, 3])) == [6, 3]
    assert p.propose(_Req(request_id="c", tokens=[1, 2, 3])) == []
    # Token ids whose bytes straddle a 4-byte boundary must not match out of alignment.
    assert p.propose(_Req(request_id="d", tokens=[256, 1, 7, 65536, 1])) == [7, 65536, 1]
    assert _proposer(prompt_lookup_min=2).propose(_Req(request_id="e", tokens=[4, 5, 9, 5])) == []


def test_ngram_buffer_follows_a_growing_request():
    p, req = _proposer(), _Req(request_id="a", tokens=[1, 2, 3, 1])
    assert p.propose(req) == [2, 3, 1]
    req.tokens += [2, 3, 4]
    assert p.propose(req) == []             # no suffix ending in 4 occurred before
    req.tokens += [9, 2, 3]
    assert p.propose(req) == [4, 9, 2, 3]   # the new tokens were appended to the buffer
    p.forget("a")
    assert "a" not in p._buffers


@pytest.mark.parametrize("bad,key", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({**NGRAM, "lookahead": 1}, "unknown key"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        LLM("tiny-llama", speculative_config=bad)


def _copy_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (a document quoted twice), so lookups find matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        doc = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randrange(8, 40))]
        out.append(doc + doc[: rng.randrange(3, len(doc))])
    return out


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return _copy_prompts(tiny_llm.get_tokenizer(), 10, 3)


@pytest.fixture(scope="module")
def plain(tiny_llm, prompts):
    return generate_ids(tiny_llm, prompts, GREEDY)


@pytest.mark.parametrize("engine_args", [
    dict(),                                                 # fused C verify steps (CPU float32)
    dict(fused_decode=False, enable_prefix_caching=False),  # PyTorch path
    dict(num_kv_blocks=10, max_num_seqs=10),                # preemption
    dict(max_num_batched_tokens=12, block_size=4),          # verify steps cut by the budget
])
def test_greedy_outputs_equal_plain_decoding(prompts, plain, engine_args):
    llm = LLM("tiny-llama", speculative_config={**NGRAM, "adaptive": False},
              **{"num_kv_blocks": 256, **engine_args})
    assert generate_ids(llm, prompts, GREEDY) == plain
    assert generate_ids(llm, prompts, GREEDY) == plain    # again, with prefix-cache hits
    snap = llm.llm_engine.snapshot()
    drafts, proposed = snap["vllm:spec_decode_num_drafts"], snap["vllm:spec_decode_num_draft_tokens"]
    accepted = snap["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and 0 < accepted <= proposed <= 4 * drafts
    assert snap["vllm:spec_decode_num_accepted_tokens_per_pos"] == accepted
    per_pos = [snap[f'vllm:spec_decode_num_accepted_tokens_per_pos{{position="{i}"}}'] for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
    frame = llm.llm_engine.requests_frame()
    assert frame.spec_accepted.sum() == accepted and frame.spec_proposed.sum() == proposed
    steps = llm.llm_engine.steps_frame()
    assert steps.num_spec_tokens.sum() == proposed and steps.num_accepted_spec_tokens.sum() == accepted
    assert snap["vllm:generation_tokens"] == 2 * sum(len(a) for a in plain)


def test_sampled_requests_stay_reproducible_with_a_seed(prompts):
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    runs = [generate_ids(LLM("tiny-llama", num_kv_blocks=256, speculative_config=NGRAM), prompts, params)
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("engine_args", [dict(num_kv_blocks=256),
                                         dict(num_kv_blocks=16, max_num_seqs=10)])   # preemption
def test_seeded_sampled_tokens_do_not_depend_on_proposals(prompts, engine_args):
    """A seeded request's noise is keyed by output position (engine/draws.py), so the rows a
    verify step draws and throws away take nothing from the tokens after them: with lookup
    proposals, always or as the adaptive rule decides, the tokens are those of plain decoding, for
    each of a request's samples (n = 2: seeds s and s + 1), and through preemption."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, n=2, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]

    def samples(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_all_blocks_free(llm)
        return [[c.token_ids for c in o.outputs] for o in outs]
    plain = samples(LLM("tiny-llama", **engine_args))
    for spec in ({**NGRAM, "adaptive": False}, NGRAM):
        llm = LLM("tiny-llama", speculative_config=spec, **engine_args)
        assert samples(llm) == plain, spec
        assert llm.llm_engine.snapshot()["vllm:spec_decode_num_draft_tokens"] > 0   # rows thrown away


def test_aborts_mid_speculation_return_every_block(prompts):
    llm = LLM("tiny-llama", num_kv_blocks=64, speculative_config={**NGRAM, "adaptive": False})
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for step in range(12):
        eng.step()
        if step % 3 == 2:
            eng.abort_request(str(step))
    while eng.has_unfinished_requests():
        eng.step()
    assert_all_blocks_free(llm)


def _stats(prefill=0, decode=4, spec=0, accepted=0, t=0.01):
    return SimpleNamespace(num_prefill_tokens=prefill, num_decode_tokens=decode, num_spec_tokens=spec,
                           num_accepted_spec_tokens=accepted, step_time_s=t)


def test_adaptive_rule_stops_proposing_when_it_does_not_pay():
    ctl = AdaptiveSpeculation(probe_every=10)
    assert ctl.should_propose(2)                         # nothing measured: try proposals first
    ctl.record(_stats(decode=2 + 8, spec=8, accepted=1, t=0.030), batch=2)   # 3 tokens in 30 ms
    assert not ctl.should_propose(2)                     # now measure plain steps
    ctl.record(_stats(decode=2, t=0.010), batch=2)                           # 2 tokens in 10 ms
    choices = [ctl.should_propose(2) for _ in range(20)]
    assert choices.count(True) <= 2, "proposals that lose must stop, but for rare probes"
    other = AdaptiveSpeculation()
    other.should_propose(1)
    other.record(_stats(decode=1 + 4, spec=4, accepted=4, t=0.012), batch=1)   # 5 tokens in 12 ms
    other.should_propose(1)
    other.record(_stats(decode=1, t=0.010), batch=1)
    assert sum(other.should_propose(1) for _ in range(20)) >= 18
    ctl.record(_stats(prefill=30, decode=2, t=1.0), batch=3)                   # mixed: ignored
    assert (4, False) not in ctl.rate and (3, False) not in ctl.rate


def _run_steps(ctl, batch: int, n: int, pays: bool) -> list[bool]:
    """``n`` steps at ``batch``: 4 proposals per request, half of them accepted when ``pays``
    (a verify step then costs 1.1 plain steps of 10 ms), else none (and 3 plain steps)."""
    choices = []
    for _ in range(n):
        c = ctl.should_propose(batch)
        choices.append(c)
        spec = 4 * batch if c else 0
        ctl.record(_stats(decode=batch + spec, spec=spec, accepted=spec // 2 if pays else 0,
                          t=(0.011 if pays else 0.030) if c else 0.010), batch=batch)
    return choices


def test_adaptive_rule_probes_at_once_when_the_batch_shrinks():
    ctl = AdaptiveSpeculation(probe_every=16)
    _run_steps(ctl, 1, 20, pays=False)          # batch 1, chat: proposals turned off
    _run_steps(ctl, 8, 30, pays=False)          # a busy phase at batch 8
    back = _run_steps(ctl, 1, 6, pays=True)     # back to batch 1, now copying: proposals pay
    assert back[0], "a batch that shrank must probe proposals at once, not at the next 16th step"
    assert all(back), "a winning probe must turn proposals back on"


def test_adaptive_rule_re_enables_within_one_probe_period():
    ctl = AdaptiveSpeculation(probe_every=16)
    off = _run_steps(ctl, 1, 40, pays=False)
    assert off[-10:].count(True) <= 1
    on = _run_steps(ctl, 1, 40, pays=True)      # the workload changed: the next probe must flip it
    first = on.index(True)
    assert first <= 16 and on[first:].count(False) <= 2, on   # then plain only as a rare probe
