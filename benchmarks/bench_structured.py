"""Cost of structured outputs and logits controls: grammar compile times, engine decode-step time
with and without grammar rows (batch 1 and 8), and the sampler's own time on a plain batch vs
batches that use penalties, logit_bias or a grammar mask.

    .venv/bin/python benchmarks/bench_structured.py [--quick] [--model smollm2-135m]

Step times are the median of the decode steps where every request is decoding (prefill steps and
the ragged tail left out), alternating plain / structured runs so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minserve import LLM, SamplingParams
from minserve.engine.sampler import Sampler, SamplingBatch
from minserve.sampling_params import StructuredOutputsParams
from minserve.structured import GrammarBackend

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer"}}, "required": ["kind", "legs"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "pets", "address"]}
SPECS = {"json schema (nested)": StructuredOutputsParams(json=PERSON),
         "json_object": StructuredOutputsParams(json_object=True),
         "regex (phone)": StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
         "choice (4)": StructuredOutputsParams(choice=["red", "green", "blue", "navy"])}


def compile_times(tokenizer, vocab: int, eos: list[int]) -> None:
    backend = GrammarBackend(tokenizer, vocab, eos)
    t = time.perf_counter()
    backend.compiler  # tokenizer analysis, once per engine
    print(f"tokenizer info (once per engine): {(time.perf_counter() - t) * 1e3:.0f} ms")
    for name, spec in SPECS.items():
        t = time.perf_counter()
        backend.compile(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        backend.compile(spec)
        print(f"compile {name:22s} cold {cold * 1e3:7.2f} ms, cached {(time.perf_counter() - t) * 1e6:6.1f} us")


def decode_step_ms(llm: LLM, prompts: list[str], spec: StructuredOutputsParams | None, tokens: int) -> float:
    eng = llm.llm_engine
    first = eng.num_steps
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
    llm.generate(prompts, params, use_tqdm=False)
    steps = [s for s in eng.step_stats if s.step >= first and s.num_prefill_tokens == 0
             and s.num_decode_tokens == len(prompts)]
    return statistics.median(s.step_time_s for s in steps) * 1e3


def engine_overhead(llm: LLM, runs: int, tokens: int) -> None:
    tok = llm.get_tokenizer()
    chat = [tok.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON."}],
                                    tokenize=False, add_generation_prompt=True) for i in range(8)]
    spec = StructuredOutputsParams(json=PERSON)
    for batch in (1, 8):
        plain, constrained = [], []
        for _ in range(runs):
            plain.append(decode_step_ms(llm, chat[:batch], None, tokens))
            constrained.append(decode_step_ms(llm, chat[:batch], spec, tokens))
        p, c = statistics.median(plain), statistics.median(constrained)
        print(f"batch {batch}: decode step plain {p:6.2f} ms, json-schema rows {c:6.2f} ms, "
              f"overhead {c - p:+.2f} ms ({100 * (c / p - 1):+.1f}%)")


def sampler_times(tokenizer, vocab: int, eos: list[int], reps: int) -> None:
    """The sampler alone on [8, vocab] greedy logits: what each control adds (one thread: on a
    shared machine, two-thread elementwise ops mostly measure waiting for the other core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _sampler_times(tokenizer, vocab, eos, reps)
    finally:
        torch.set_num_threads(threads)


def _sampler_times(tokenizer, vocab: int, eos: list[int], reps: int) -> None:
    sampler, rows = Sampler(), 8
    logits = torch.randn(rows, vocab)
    history = [list(range(i, 200 + i)) for i in range(rows)]
    backend = GrammarBackend(tokenizer, vocab, eos)

    class Req:  # what GrammarBackend.fill_bitmask reads from a request
        def __init__(self, i):
            self.request_id, self.output_token_ids, self.structured = str(i), [], None
            self.params = SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON))

    reqs = [Req(i) for i in range(rows)]
    cases = {
        "plain": lambda: SamplingBatch([SamplingParams(temperature=0)] * rows, [None] * rows, [[]] * rows),
        "penalties (200 out, 200 prompt)": lambda: SamplingBatch(
            [SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)] * rows,
            [None] * rows, [[]] * rows, output_token_ids=history, prompt_token_ids=history),
        "logit_bias (10 ids)": lambda: SamplingBatch(
            [SamplingParams(temperature=0, logit_bias={i: 1.0 for i in range(10)})] * rows, [None] * rows, [[]] * rows),
        "grammar (fill + mask)": lambda: SamplingBatch(
            [SamplingParams(temperature=0)] * rows, [None] * rows, [[]] * rows,
            grammar_rows=list(range(rows)), grammar_bitmask=backend.fill_bitmask(reqs)),
    }
    for name, make in cases.items():
        make(), sampler(logits, make())  # warm up
        t = time.perf_counter()
        for _ in range(reps):
            sampler(logits, make())
        print(f"sampler, 8 greedy rows, {name:32s} {(time.perf_counter() - t) / reps * 1e3:6.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true", help="fewer runs and tokens (~1 minute)")
    a = ap.parse_args()
    runs, tokens, reps = (2, 24, 50) if a.quick else (5, 48, 300)
    llm = LLM(a.model, enable_prefix_caching=False)
    eng = llm.llm_engine
    compile_times(llm.get_tokenizer(), eng.model_config.vocab_size, eng.eos_token_ids)
    sampler_times(llm.get_tokenizer(), eng.model_config.vocab_size, eng.eos_token_ids, reps)
    engine_overhead(llm, runs, tokens)
    print(json.dumps({"compile_cache": [eng.grammar.cache_hits, eng.grammar.cache_misses]}))


if __name__ == "__main__":
    main()
