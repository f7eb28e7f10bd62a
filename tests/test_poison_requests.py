"""Poison requests (issue 20 item 3): a request whose own constraints leave no token to sample.

What is certain from the values alone is refused at the door (ValueError naming the field, a 400
at the server); what only shows mid-run fails that request alone, in the step where it shows: its
neighbours keep the tokens of that very step (no serial rerun of the step, request by request),
and the engine lists it in ``last_step_client_errors`` (the server answers 400, not 500)."""

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.inputs import check_params
from minserve.sampling_params import StructuredOutputsParams
from conftest import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
THE = 260  # " the" in the SmolLM2 tokenizer (tiny-llama's); "the the" tokenizes as [1195, 260] and [260, 260]


def _poison_bad_words(**kw) -> SamplingParams:
    """Only " the" may be sampled, and " the the" is a bad word: the first token is fine, the
    second has nothing left. Nothing at the door can see it (the ban needs the output)."""
    return SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[THE], bad_words=["the the"], **kw)


def _poison_grammar() -> SamplingParams:
    """The regex ends after "yes" (at most 3 tokens), then only EOS may follow, which min_tokens
    bans until 10 tokens are out. (A regex, unlike a choice, is not measured at the door.)"""
    return SamplingParams(temperature=0, max_tokens=12, min_tokens=10,
                          structured_outputs=StructuredOutputsParams(regex="yes"))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=128)


def _neighbours(eng, n=4):
    for i in range(n):
        eng.add_request(f"ok{i}", {"prompt_token_ids": list(range(100 + 7 * i, 130 + 7 * i))}, GREEDY)


def _drain(eng, calls):
    """Step until idle. Per step: its outputs, its client errors, and how many times the runner's
    execute ran in it (``calls``: a list the counting wrapper appends to)."""
    last, client, per_step = {}, {}, []
    while eng.has_unfinished_requests():
        before = len(calls)
        for out in eng.step():
            last[out.request_id] = out
        per_step.append(len(calls) - before)
        for rid in eng.last_step_client_errors:
            client[rid] = eng.last_step_failures[rid]
    return last, client, per_step


@pytest.fixture
def counted(llm, monkeypatch):
    calls = []
    real = llm.llm_engine.runner.execute

    def execute(sched, kv):
        calls.append(len(sched.scheduled))
        return real(sched, kv)
    monkeypatch.setattr(llm.llm_engine.runner, "execute", execute)
    return calls


@pytest.fixture(scope="module")
def clean_tokens(llm):
    """What the neighbours produce with no poison beside them."""
    outs = llm.generate([{"prompt_token_ids": list(range(100 + 7 * i, 130 + 7 * i))} for i in range(4)],
                        GREEDY, use_tqdm=False)
    return {f"ok{i}": o.outputs[0].token_ids for i, o in enumerate(outs)}


# ---- at the door ---------------------------------------------------------------------------------

def test_allowed_ids_all_banned_until_min_tokens_are_refused_naming_both_fields(llm):
    eng = llm.llm_engine
    # Token 2 is tiny-llama's (SmolLM2's) EOS: banned until min_tokens=3 are out.
    params = SamplingParams(max_tokens=5, allowed_token_ids=[2], min_tokens=3)
    with pytest.raises(ValueError, match=r"^allowed_token_ids .*min_tokens=3"):
        check_params(params, eng.model_config.vocab_size, eng.eos_token_ids)
    with pytest.raises(ValueError, match=r"^allowed_token_ids .*min_tokens"):
        eng.add_request("door1", "x", params)
    with pytest.raises(ValueError, match=r"^allowed_token_ids .*min_tokens"):
        eng.prepare_params(SamplingParams(max_tokens=5, allowed_token_ids=[2, 7], stop_token_ids=[7],
                                          min_tokens=1))
    assert not eng.has_unfinished_requests()


def test_allowed_ids_that_are_all_one_token_bad_words_are_refused(llm):
    with pytest.raises(ValueError, match=r"^allowed_token_ids .*bad_words"):
        llm.llm_engine.add_request("door2", "x", SamplingParams(allowed_token_ids=[THE], bad_words=["the"]))
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_choice_shorter_than_min_tokens_is_refused_naming_structured_outputs(llm):
    eng = llm.llm_engine
    params = SamplingParams(max_tokens=20, min_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match=r"^min_tokens=10 .*structured_outputs\.choice"):
        check_params(params, eng.model_config.vocab_size, eng.eos_token_ids)
    with pytest.raises(ValueError, match=r"^min_tokens"):
        eng.add_request("door3", "x", params)
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=5, allowed_token_ids=[2], min_tokens=3, ignore_eos=True),  # EOS not banned
    SamplingParams(max_tokens=5, allowed_token_ids=[2, 5], min_tokens=3),                # 5 is left
    SamplingParams(max_tokens=5, min_tokens=3,                                           # 3 bytes: 3 tokens can
                   structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    SamplingParams(max_tokens=12, min_tokens=10, ignore_eos=True,                        # EOS ends it
                   structured_outputs=StructuredOutputsParams(choice=["yes"])),
], ids=["ignore_eos", "one-left", "choice-as-long", "choice-ignore-eos"])
def test_what_is_not_certain_to_fail_is_accepted(llm, params):
    eng = llm.llm_engine
    check_params(params, eng.model_config.vocab_size, eng.eos_token_ids)
    eng.prepare_params(params)


# ---- mid-run: the culprit fails alone, in one pass -----------------------------------------------

@pytest.mark.parametrize("poison, at", [(_poison_bad_words, 1), (_poison_grammar, None)],
                         ids=["bad_words", "grammar"])
def test_a_poison_request_fails_alone_without_a_serial_rerun(llm, clean_tokens, counted, poison, at):
    eng = llm.llm_engine
    _neighbours(eng)
    eng.add_request("poison", "x", poison())
    outs, client, per_step = _drain(eng, counted)
    bad = outs["poison"]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "no token that may be sampled at output token" in bad.error
    if at is not None:
        assert bad.error.endswith(f"at output token {at}")
        assert bad.error.startswith("allowed_token_ids and bad_words together leave")
    else:
        assert "min_tokens and the structured-output grammar" in bad.error
    assert set(client) == {"poison"} and client["poison"] == bad.error
    assert per_step == [1] * len(per_step), "each step ran the model once: no request-by-request rerun"
    for rid, toks in clean_tokens.items():
        assert outs[rid].outputs[0].token_ids == toks and outs[rid].error is None
    assert_all_blocks_free(llm)


def test_several_poison_requests_in_one_step_and_an_engine_fault_is_no_client_error(llm, clean_tokens,
                                                                                   counted, monkeypatch):
    eng = llm.llm_engine
    _neighbours(eng)
    for i in range(3):
        eng.add_request(f"poison{i}", "x", _poison_bad_words())
    outs, client, per_step = _drain(eng, counted)
    assert set(client) == {"poison0", "poison1", "poison2"}
    assert per_step == [1] * len(per_step)
    for rid, toks in clean_tokens.items():
        assert outs[rid].outputs[0].token_ids == toks
    # A fault of the engine's (here an injected one) still fails its request, but not as the
    # client's doing: the server keeps answering those 500.
    monkeypatch.setattr(eng.runner, "execute", lambda sched, kv: 1 / 0)
    eng.add_request("fault", "hello", GREEDY)
    eng.step()
    assert "fault" in eng.last_step_failures and not eng.last_step_client_errors
    assert_all_blocks_free(llm)


def test_a_poison_request_with_n_samples_fails_as_one_answer(llm, clean_tokens, counted):
    eng = llm.llm_engine
    _neighbours(eng)
    eng.add_request("poison-n", "x", _poison_bad_words(n=3, seed=1))
    outs, client, per_step = _drain(eng, counted)
    assert outs["poison-n"].finished and outs["poison-n"].error
    assert set(client) == {"poison-n"}
    assert per_step == [1] * len(per_step)
    for rid, toks in clean_tokens.items():
        assert outs[rid].outputs[0].token_ids == toks
    assert_all_blocks_free(llm)


def test_a_poison_request_in_a_speculative_verify_step():
    """The verify rows of a proposal step go through the same controls: a dead row among the rows
    the request's tokens come from fails it, the neighbours verify as usual."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM("tiny-llama", max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=128,
              speculative_config=spec)
    eng = llm.llm_engine
    prompts = [{"prompt_token_ids": [7, 8, 9] * 10}, {"prompt_token_ids": list(range(100, 130))}]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 50, 8: 30, 9: 10}),
              GREEDY]  # the first repeats its prompt, so it gets proposals
    solo = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"ok{i}", p, sp)
    # Its prompt repeats " the": the ngram proposer offers " the" after its first " the".
    eng.add_request("poison", {"prompt_token_ids": [THE] * 12}, _poison_bad_words())
    proposed, real = [], eng.proposer.propose_batch

    def propose_batch(reqs):
        out = real(reqs)
        proposed.extend(list(spec) for r, spec in zip(reqs, out) if r.request_id == "poison")
        return out
    eng.proposer.propose_batch = propose_batch
    outs, client = {}, set()
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
        client |= eng.last_step_client_errors
    assert client == {"poison"} and outs["poison"].outputs[0].finish_reason == "error"
    assert outs["poison"].error.endswith("at output token 1")
    assert len(proposed) == 1 and proposed[0][:1] == [THE], "the poison failed verifying its own proposal"
    assert [outs[f"ok{i}"].outputs[0].token_ids for i in range(2)] == solo
    assert_all_blocks_free(llm)
