"""Parallel sampling: one request with ``n=k`` against k requests of the same prompt sent together.

Both ways give the same k answers (sample j of the ``n`` request is seeded ``seed + j``, exactly
what request j is seeded with here). Reports, for each way: prefill tokens computed, the most KV
blocks in use after any step, wall time, TTFT and the output throughput. Prefix caching is on in
both, each run under its own ``cache_salt``: k requests arriving together all miss (nothing is
cached until the first prefill ends), so they prefill k times; the ``n`` request prefills once and
its samples share the prompt's blocks.

    .venv/bin/python benchmarks/bench_parallel_sampling.py [--model smollm2-135m --n 8
                                                            --prompt-tokens 512 --max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import pydoc
import time

from minserve import LLM, SamplingParams


def prompt_tokens(tokenizer, n: int) -> list[int]:
    # Real text available offline: the rendered documentation of a standard-library module.
    ids = tokenizer(pydoc.render_doc("json", renderer=pydoc.plaintext)).input_ids
    return (ids * (n // len(ids) + 1))[:n]


def run(llm: LLM, prompt: list[int], params: list[SamplingParams], salt: str) -> dict:
    """Run the requests together; ``salt`` keeps each run's prefix-cache entries to itself."""
    eng = llm.llm_engine
    for i, p in enumerate(params):
        eng.add_request(f"{salt}-{i}", {"prompt_token_ids": prompt}, p, cache_salt=salt)
    t0, first = time.perf_counter(), len(eng.step_stats)
    tokens, ttft, peak = {}, None, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            ttft = ttft or time.perf_counter() - t0
            if out.finished:
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
        peak = max(peak, sum(1 for c in eng.kv.pool.ref_count if c > 0))
    wall = time.perf_counter() - t0
    steps = list(eng.step_stats)[first:]
    answers = [t for rid in sorted(tokens, key=lambda r: int(r.rsplit("-", 1)[1])) for t in tokens[rid]]
    return {"prefill_tokens": sum(s.num_prefill_tokens for s in steps), "peak_kv_blocks": peak,
            "wall_s": round(wall, 3), "ttft_s": round(ttft, 3),
            "output_tok_per_s": round(sum(map(len, answers)) / wall, 1), "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    llm = LLM(a.model, max_num_seqs=max(16, a.n), max_num_batched_tokens=8192)
    prompt = prompt_tokens(llm.get_tokenizer(), a.prompt_tokens)
    base = SamplingParams(temperature=0.8, max_tokens=a.max_tokens, ignore_eos=True, seed=1)
    run(llm, list(range(100, 100 + a.prompt_tokens)), [base], "warm-up")
    one = base.clone()
    one.n = a.n
    each = []
    for j in range(a.n):
        p = base.clone()
        p.seed = base.seed + j
        each.append(p)
    parallel, separate = run(llm, prompt, [one], "n"), run(llm, prompt, each, "separate")
    # Exact unless a different batch shape rounds a logit differently (the prefill of 1 prompt
    # against n prompts at once): then a sampled token may flip.
    same = sum(x == y for x, y in zip(parallel.pop("answers"), separate.pop("answers")))
    parallel["identical_answers"] = f"{same}/{a.n}"
    print(json.dumps({"model": a.model, "n": a.n, "prompt_tokens": a.prompt_tokens,
                      "max_tokens": a.max_tokens, "n_request": parallel, "separate_requests": separate},
                     indent=1))


if __name__ == "__main__":
    main()
