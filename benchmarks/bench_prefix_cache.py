"""Agent-style workload: a long shared system prompt plus a short unique suffix per request.

Reports, with prefix caching on and off in one run on the same model and CPU: TTFT of the first
(cold) request, median TTFT of the rest (warm), prefill tokens computed and saved, and the hit
rate. Requests are sent one after another, as an agent loop would, so TTFT is pure prefill time.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--system-tokens 1024 --requests 8]
"""

from __future__ import annotations

import argparse
import json
import pydoc
import statistics
import time
from pathlib import Path

from minserve import LLM, SamplingParams


def system_prompt_tokens(tokenizer, n: int) -> list[int]:
    # Real text available offline: the rendered documentation of a standard-library module.
    text = pydoc.render_doc("json", renderer=pydoc.plaintext)
    ids = tokenizer(text).input_ids
    return (ids * (n // len(ids) + 1))[:n]


def run(model: str, caching: bool, system: list[int], suffixes: list[list[int]]) -> dict:
    llm = LLM(model, enable_prefix_caching=caching, max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Warm-up on unrelated tokens of the same length, so the cold request measures prefill, not
    # first-call overheads (allocator growth, thread pools).
    llm.generate({"prompt_token_ids": list(range(100, 100 + len(system)))}, params, use_tqdm=False)
    warmup_steps = llm.llm_engine.num_steps
    ttfts = []
    for s in suffixes:
        out = llm.generate({"prompt_token_ids": system + s}, params, use_tqdm=False)[0]
        ttfts.append(out.metrics.ttft_s)
    steps = llm.llm_engine.steps_frame()
    steps = steps[steps.step >= warmup_steps]
    queried, hits = int(steps.prefix_cache_queries.sum()), int(steps.prefix_cache_hits.sum())
    return {"caching": caching, "ttft_cold_s": ttfts[0], "ttft_warm_median_s": statistics.median(ttfts[1:]),
            "prefill_tokens_computed": int(steps.num_prefill_tokens.sum()), "prefix_hit_tokens": hits,
            "hit_rate": hits / queried if queried else 0.0, "ttfts_s": ttfts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    a = ap.parse_args()
    tok = LLM(a.model, num_kv_blocks=8).get_tokenizer()
    system = system_prompt_tokens(tok, a.system_tokens)
    suffixes = [tok(f" Step {i}: the agent observes state {i * 7919 % 1000} and decides.").input_ids
                for i in range(a.requests)]
    t0 = time.time()
    on, off = run(a.model, True, system, suffixes), run(a.model, False, system, suffixes)
    print(f"\n{a.requests} requests, shared system prompt {a.system_tokens} tokens + ~{len(suffixes[0])}-token "
          f"suffix, {a.model}, fp32 CPU\n")
    print("| prefix caching | TTFT cold (ms) | TTFT warm, median (ms) | cold / warm | prefill tokens computed "
          "| prefill tokens saved | hit rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in (on, off):
        print(f"| {'on' if r['caching'] else 'off'} | {r['ttft_cold_s'] * 1e3:.0f} | {r['ttft_warm_median_s'] * 1e3:.0f} "
              f"| {r['ttft_cold_s'] / r['ttft_warm_median_s']:.1f}x | {r['prefill_tokens_computed']} "
              f"| {r['prefix_hit_tokens']} | {r['hit_rate']:.0%} |")
    print(f"\nwarm TTFT, caching off / on: {off['ttft_warm_median_s'] / on['ttft_warm_median_s']:.1f}x "
          f"(target: cold / warm >= 5x with caching on)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"on": on, "off": off, "wall_s": time.time() - t0}, indent=2))


if __name__ == "__main__":
    main()
