"""How far a prompt's first-token log-probabilities move when another prompt shares its step.

A seed fixes a request's random draws, so its tokens repeat exactly when its logits do
(docs/engine/sampling.md). For each engine setting, each short prompt runs alone and then beside a
longer one; the table gives the largest difference over the alone run's top 20 log-probabilities,
in nats, and how many prompts came out bit for bit the same. float32 differs only in the last
bits; settings whose steps take another path by size (bfloat16 prefill tiles for int8/int4 weights,
int8 activations between the fused C step and the PyTorch path) move more; with
``fused_decode=False`` int8 activations do not move at all.

    .venv/bin/python benchmarks/bench_batch_invariance.py [--model smollm2-135m --neighbour-tokens 300]
"""

from __future__ import annotations

import argparse
import gc
import json

from minserve import LLM, SamplingParams

PROMPTS = ["Invent a word:", "The capital of France is", "def add(a, b):", "Once upon a time",
           "Water boils at", "List three colors:", "My favourite food is", "The quick brown fox"]
A8 = {"quantization": "int4", "quantization_config": {"activations": "int8"}}
SETTINGS = {"float32": {}, "int4": {"quantization": "int4"}, "int4, int8 activations": A8,
            # Every step through the PyTorch path: the batch-invariant recipe (docs/engine/sampling.md).
            "float32, fused_decode=False": {"fused_decode": False},
            "int4, int8 activations, fused_decode=False": {**A8, "fused_decode": False}}


def first_logprobs(llm: LLM, prompt: str, neighbour: str | None) -> dict:
    probe = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    if neighbour is None:
        return llm.generate([prompt], probe, use_tqdm=False)[0].outputs[0].logprobs[0]
    outs = llm.generate([neighbour, prompt], [SamplingParams(max_tokens=1), probe], use_tqdm=False)
    return outs[1].outputs[0].logprobs[0]


def measure(model: str, engine_args: dict, neighbour: str) -> dict:
    llm = LLM(model, max_num_seqs=8, num_kv_blocks=256, **engine_args)
    apart = []
    for p in PROMPTS:
        alone, beside = first_logprobs(llm, p, None), first_logprobs(llm, p, neighbour)
        apart.append(max(abs(alone[t].logprob - beside[t].logprob) for t in alone if t in beside))
    del llm
    gc.collect()
    return {"max_nats": max(apart), "identical": sum(a == 0 for a in apart), "prompts": len(apart)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--neighbour-tokens", type=int, default=300, help="words in the prompt beside each one (enough for a step of 256 tokens or more)")
    args = ap.parse_args()
    neighbour = "x " * args.neighbour_tokens
    rows = {name: measure(args.model, kw, neighbour) for name, kw in SETTINGS.items()}
    print("| setting | largest difference (nats, top 20) | prompts bit for bit the same |")
    print("| --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['max_nats']:.2g} | {r['identical']} of {r['prompts']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
