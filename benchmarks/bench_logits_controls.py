"""What one request's logits controls cost the other requests of its batch (issue 20 items 2, 3).

(a) Heavy controls: 8 greedy requests decode together; in the "with" runs two of them carry a
    full-vocabulary ``allowed_token_ids`` and a full-vocabulary ``logit_bias``. The figure is the
    decode step time, which is every neighbour's inter-token latency.
(b) Poison requests: 8 neighbours decode while a request arrives every ``--every`` steps. "poison"
    arrivals leave themselves no token to sample at their second output token (only " the" is
    allowed and "the the" is a bad word); "harmless" arrivals are the same request without the bad
    word, stopped after 2 tokens, so both do the same model work and the difference is what a
    failure costs the neighbours (before the fix: the step was rerun request by request).

Conditions alternate within each of ``--runs`` repetitions. Each run's figure for (a) is its median
decode-step time; for (b) the mean and the 90th percentile of every step while arrivals come (a
failure hits one step in ``--every``, which a median would hide); the tables give the median over
runs, and each ratio is taken within a repetition before the median (so a load that comes and goes
on a shared machine slows the compared conditions alike). Engine-level, in-process, so HTTP is out of it.
The same script runs against an older checkout for a before/after (``PYTHONPATH=/tmp/old``: it
uses only add_request / step).

    .venv/bin/python benchmarks/bench_logits_controls.py [--model smollm2-135m --runs 5 --steps 32]
"""

from __future__ import annotations

import argparse
import statistics

from minserve import LLM, SamplingParams

THE = 260  # " the" in SmolLM2's tokenizer (smollm2-135m, tiny-llama)


def _prompt(i: int) -> dict:
    return {"prompt_token_ids": list(range(1000 + 37 * i, 1064 + 37 * i))}


def _decode_steps(eng, first_step: int) -> list[float]:
    return [s.step_time_s for s in eng.step_stats if s.step >= first_step and s.num_prefill_tokens == 0]


def heavy_controls_run(llm: LLM, steps: int, heavy: bool) -> float:
    """Median decode-step time of a batch of 8, two of them with full-vocabulary controls."""
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    plain = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    params = [plain] * 8
    if heavy:
        params[6] = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True,
                                   allowed_token_ids=list(range(vocab)))
        params[7] = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True,
                                   logit_bias=dict.fromkeys(range(vocab), 0.5))
    first = eng.num_steps
    for i, p in enumerate(params):
        eng.add_request(f"n{i}", _prompt(i), p)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(_decode_steps(eng, first)[1:])  # the first decode step warms up


def poison_run(llm: LLM, steps: int, every: int, arrivals: str, run: int) -> tuple[float, float, int]:
    """Mean and p90 step time of 8 neighbours while a request arrives every ``every`` steps; and
    how many arrivals failed."""
    eng = llm.llm_engine
    for i in range(8):
        eng.add_request(f"n{i}", _prompt(i), SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    eng.step()
    while eng.step_stats[-1].num_prefill_tokens:  # the neighbours' prefill is not part of the figure
        eng.step()
    times, failed = [], 0
    for k in range(steps):
        if arrivals != "none" and k % every == 0:
            bad = arrivals == "poison"
            eng.add_request(f"a{run}-{k}", {"prompt_token_ids": [THE] * 8}, SamplingParams(
                temperature=0, max_tokens=6 if bad else 2, allowed_token_ids=[THE],
                bad_words=["the the"] if bad else None))
        eng.step()
        times.append(eng.step_stats[-1].step_time_s)
        failed += len(eng.last_step_failures)
    eng.abort_request([f"n{i}" for i in range(8)])
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.mean(times), statistics.quantiles(times, n=10)[-1], failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--every", type=int, default=4, help="(b): a request arrives every this many steps")
    a = ap.parse_args()
    llm = LLM(a.model, max_num_seqs=16, enable_prefix_caching=False)
    heavy_controls_run(llm, 4, True)  # warm-up: kernels, allocator, the first full-vocab tensors
    heavy = {False: [], True: []}
    arrivals = {"none": [], "harmless": [], "poison": []}
    p90 = {"none": [], "harmless": [], "poison": []}
    failures = 0
    for r in range(a.runs):
        for h in ((False, True) if r % 2 == 0 else (True, False)):
            heavy[h].append(heavy_controls_run(llm, a.steps, h))
        for kind in (("none", "harmless", "poison") if r % 2 == 0 else ("poison", "harmless", "none")):
            t, q, f = poison_run(llm, a.steps, a.every, kind, r)
            arrivals[kind].append(t)
            p90[kind].append(q)
            failures += f if kind == "poison" else 0
    def ratio(xs, base):
        return statistics.median(x / b for x, b in zip(xs, base))

    med = {k: statistics.median(v) * 1e3 for k, v in heavy.items()}
    print(f"\n{a.model}, medians of {a.runs} runs of {a.steps} decode steps (ms per step = a neighbour's ITL)")
    print("| (a) batch of 8 | step ms | ratio |\n|---|---:|---:|")
    print(f"| 8 plain | {med[False]:.2f} | 1.00 |")
    print(f"| 6 plain + full-vocab allowed_token_ids + full-vocab logit_bias | {med[True]:.2f} | "
          f"{ratio(heavy[True], heavy[False]):.2f} |")
    med = {k: statistics.median(v) * 1e3 for k, v in arrivals.items()}
    q = {k: statistics.median(v) * 1e3 for k, v in p90.items()}
    print(f"\n| (b) 8 neighbours, a request every {a.every} steps | mean step ms | vs harmless | "
          f"p90 step ms | vs harmless |\n|---|---:|---:|---:|---:|")
    for kind in ("none", "harmless", "poison"):
        print(f"| {kind} | {med[kind]:.2f} | {ratio(arrivals[kind], arrivals['harmless']):.2f} | {q[kind]:.2f} | "
              f"{ratio(p90[kind], p90['harmless']):.2f} |")
    per_run = -(-a.steps // a.every)
    print(f"\npoison arrivals that failed: {failures} of {per_run * a.runs}")


if __name__ == "__main__":
    main()
