"""Cost of metrics recording: engine step time with Prometheus metrics on and off.

The same offline workload runs on two engines that differ only in ``disable_log_stats``,
alternating on/off several times; we compare the median of the mean step time. Request timelines
are recorded in both (they are part of the engine); what is switched is the Prometheus updates.

    .venv/bin/python benchmarks/bench_metrics_overhead.py [--model smollm2-135m --runs 5]
"""

from __future__ import annotations

import argparse
import statistics

from minserve import LLM, SamplingParams


def mean_step_s(llm: LLM, prompts: list[list[int]]) -> float:
    eng = llm.llm_engine
    first = eng.num_steps
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    steps = [s for s in eng.step_stats if s.step >= first]
    return sum(s.step_time_s for s in steps) / len(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    a = ap.parse_args()
    engines = {on: LLM(a.model, disable_log_stats=not on, enable_prefix_caching=False) for on in (True, False)}
    prompts = [list(range(1000 + 50 * i, 1000 + 50 * i + 20 + 10 * i)) for i in range(a.requests)]
    times = {True: [], False: []}
    for _ in range(a.runs):
        for on in (True, False):
            times[on].append(mean_step_s(engines[on], prompts))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"\n{a.model}: mean step time, median of {a.runs} runs: metrics on {on * 1e3:.3f} ms, "
          f"off {off * 1e3:.3f} ms, overhead {100 * (on / off - 1):+.2f}% (target < 3%)")


if __name__ == "__main__":
    main()
