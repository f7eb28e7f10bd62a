"""Structured outputs: every output parses and validates against its spec (JSON schema with nested
objects, arrays and enums; json_object; regex; choice; grammar), greedy and sampled, in mixed
batches; invalid specs are refused naming the field; grammars compile once per spec."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from minserve.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                           "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["kind", "legs"]}},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "pets", "address"],
}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]},
    "temps": {"type": "array", "items": {"type": "number", "minimum": -50, "maximum": 60},
              "minItems": 1, "maxItems": 4}}, "required": ["city", "unit", "temps"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
COLORS = ["red", "green", "blue", "dark \"navy\" blue"]
PERSON_QUESTIONS = ["Describe a person as JSON.", "Invent a character with pets.",
                    "Give me JSON about Bob, 30, from Paris.", "A cat owner in London."]
SHORT_OBJECTS = ["Return a JSON object whose only key is \"answer\" and value is the capital of France.",
                 "Reply with the JSON object {\"ok\": true} and nothing else.",
                 "Give {\"x\": 1, \"y\": 2} as JSON."]


def _chat(llm, question: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}],
                                                   tokenize=False, add_generation_prompt=True)


def _cases() -> list[tuple[str, StructuredOutputsParams]]:
    """(question, spec): 24 prompts over every kind."""
    cases = []
    for q in PERSON_QUESTIONS:
        cases += [(q, StructuredOutputsParams(json=PERSON)),
                  (q, StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True))]
    for city in ("Oslo", "Cairo", "Lima"):
        cases.append((f"Temperatures in {city} this week as JSON.",
                      StructuredOutputsParams(json=WEATHER, disable_any_whitespace=True)))
    cases += [(q, StructuredOutputsParams(json_object=True, disable_any_whitespace=True)) for q in SHORT_OBJECTS]
    for q in ("Write a US phone number.", "Call me at?", "Support hotline:"):
        cases.append((q, StructuredOutputsParams(regex=PHONE)))
    for q in ("When did you last travel?", "A date in 2024:"):
        cases.append((q, StructuredOutputsParams(regex=DATE)))
    for q in ("Your favourite colour?", "Colour of the sky?", "Colour of grass?"):
        cases.append((q, StructuredOutputsParams(choice=COLORS)))
    cases.append(("Yes or no?", StructuredOutputsParams(grammar='root ::= ("yes" | "no") "!"')))
    return cases


def _check(text: str, spec: StructuredOutputsParams) -> None:
    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, dict) else json.loads(spec.json)
        jsonschema.validate(json.loads(text), schema)
        if spec.disable_any_whitespace:
            assert "\n" not in text, text
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text
    else:
        assert text in ("yes!", "no!"), text


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_parse_and_validate(smol_llm, temperature):
    cases = _cases()
    assert len(cases) >= 20
    if temperature > 0:
        # Sampled with free JSON whitespace, a 135M model wanders through newlines past any
        # max_tokens (the grammar allows it); compact JSON keeps the sampled outputs finite.
        cases = [(q, dataclasses.replace(spec, disable_any_whitespace=True) if spec.kind == "json" else spec)
                 for q, spec in cases]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=160, structured_outputs=spec)
              for i, (_, spec) in enumerate(cases)]
    outs = smol_llm.generate([_chat(smol_llm, q) for q, _ in cases], params, use_tqdm=False)
    for (q, spec), out in zip(cases, outs):
        done = out.outputs[0]
        assert done.finish_reason == "stop", (q, spec.kind, done.text)
        _check(done.text, spec)


def test_a_structured_request_alone_equals_the_same_in_a_mixed_batch(smol_llm):
    """Rows without a grammar are unaffected by the others' masks and vice versa."""
    spec = StructuredOutputsParams(json=WEATHER, disable_any_whitespace=True)
    prompt = _chat(smol_llm, "Temperatures in Oslo this week as JSON.")
    greedy = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
    plain = SamplingParams(temperature=0, max_tokens=20)
    alone = smol_llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    plain_alone = smol_llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].text
    mixed = smol_llm.generate([prompt, prompt], [plain, greedy], use_tqdm=False)
    assert [o.outputs[0].text for o in mixed] == [plain_alone, alone]
    assert plain_alone != alone[:len(plain_alone)]  # the grammar did change the greedy choice


def test_the_grammar_ends_the_request_even_with_ignore_eos(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = tiny_llm.generate(["pick"] * 3, params, use_tqdm=False)
    for o in out:
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in ("alpha", "beta")


def test_logprobs_stay_those_of_the_raw_model(tiny_llm):
    """As vLLM's default (raw logprobs): the reported distribution is the model's, unmasked."""
    free = tiny_llm.generate(["q"], SamplingParams(temperature=0, logprobs=1, max_tokens=1),
                             use_tqdm=False)[0].outputs[0]
    spec = StructuredOutputsParams(choice=["yes", "no"])
    out = tiny_llm.generate(["q"], SamplingParams(temperature=0, logprobs=1, max_tokens=5,
                                                  structured_outputs=spec), use_tqdm=False)[0].outputs[0]
    favourite = free.token_ids[0]
    assert out.token_ids[0] != favourite  # the grammar changed the pick...
    # ...but the reported top-1 is still the unconstrained favourite, with the same logprob.
    top1 = {t: lp for t, lp in out.logprobs[0].items() if lp.rank == 1}
    assert list(top1) == [favourite]
    assert top1[favourite].logprob == pytest.approx(free.logprobs[0][favourite].logprob, abs=1e-5)
    assert out.logprobs[0][out.token_ids[0]].rank > 1


def test_compile_cache_hits_for_the_same_spec(tiny_llm):
    grammar = tiny_llm.llm_engine.grammar
    spec = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    hits, misses = grammar.cache_hits, grammar.cache_misses
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=spec))
    tiny_llm.generate(["a", "b", "c"], params, use_tqdm=False)
    # The same schema as text: the same grammar.
    tiny_llm.generate(["d"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json=json.dumps(spec))), use_tqdm=False)
    assert grammar.cache_misses == misses + 1
    assert grammar.cache_hits >= hits + 3


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "nonsense"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= "), "structured_outputs.grammar"),
    (dict(json_object=True, whitespace_pattern=r"[ ]?"), "structured_outputs.whitespace_pattern"),
])
def test_invalid_specs_are_refused_at_add_request(tiny_llm, spec, field):
    engine = tiny_llm.llm_engine
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request("bad-spec", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("spec", [dict(), dict(json={}, regex="a"), dict(choice=[]), dict(choice="ab"),
                                  dict(regex=3), dict(json=[1])])
def test_malformed_params_name_structured_outputs(spec):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**spec)


def test_structured_requests_get_no_speculative_proposals():
    from minserve import LLM
    llm = LLM("tiny-llama", num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False})
    proposed = (lambda: sum(s.num_spec_tokens for s in llm.llm_engine.step_stats))
    # The control: the plain request repeats itself and gets proposals...
    prompt = {"prompt_token_ids": [7, 8, 9] * 10}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                          logit_bias={7: 50, 8: 30, 9: 10}), use_tqdm=False)
    assert proposed() > 0
    before = proposed()
    spec = StructuredOutputsParams(regex="(ab){1,20}c")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("(ab){1,20}c", out.text)
    assert proposed() == before  # ...the structured one none


def test_preemption_keeps_each_matcher_consistent(tiny_llm):
    """Preempted requests recompute their prompt and output; the matcher, which only ever saw
    final tokens, carries on where it was: the same outputs as with room to spare."""
    from minserve import LLM
    pattern = "(ab|cd|ef|gh)( (ab|cd|ef|gh)){30,40}\\."
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=90,
                             structured_outputs=StructuredOutputsParams(regex=pattern),
                             presence_penalty=0.5, frequency_penalty=0.2) for i in range(8)]
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 7 * i))} for i in range(8)]
    roomy = [o.outputs[0].text for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM("tiny-llama", num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=128)
    squeezed = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert squeezed == roomy
    assert all(re.fullmatch(pattern, text) for text in roomy), roomy


def test_parallel_samples_each_follow_the_grammar(tiny_llm):
    """n > 1: the samples forked off one prompt each get their own matcher."""
    pattern = "(ab|cd|ef)( (ab|cd|ef)){3,8}\\."
    out = tiny_llm.generate(["hello there"], SamplingParams(
        n=4, temperature=1.0, seed=5, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern)),
        use_tqdm=False)[0].outputs
    assert len(out) == 4 and len({o.text for o in out}) > 1
    assert all(o.finish_reason == "stop" and re.fullmatch(pattern, o.text) for o in out), out
