"""A shortest-job-first scheduler against FCFS, on lab 07's traffic with a mix of answer lengths.

Lab 07 offers a small server (4 seats) requests of 32 prompt tokens and 8 output tokens, then a
burst. Here a quarter of the burst asks for 8x longer answers, as a chat service sees beside
summaries. FCFS serves the burst in arrival order, so every short answer queued behind a long one
waits for it; SJF admits the request with the fewest tokens left to compute first. With
``ignore_eos`` the output length is known (``max_tokens``); a real server would use a predicted
length. SJF never preempts for a shorter arrival here (``may_preempt`` stays False): no churn.

The policy is a :class:`~minserve.SchedulingPolicy` registered under a name
(``minserve.register_scheduling_policy``), then used like a built-in: ``scheduling_policy="sjf"``.
Prints mean and p90 TTFT and E2E per policy, in seconds and in engine steps (steps do not depend
on the machine's speed). ``--quick``: fewer requests.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import minserve
from minserve import LLMEngine, SamplingParams, SchedulingPolicy
from minserve.lab.workload import make_requests

SEATS, IN_TOKENS, OUT_TOKENS = 4, 32, 8  # lab 07's quick preset


class ShortestJobFirst(SchedulingPolicy):
    name = "sjf"

    def key(self, req) -> tuple:
        # Tokens still to compute: the rest of the prompt, then the rest of the answer.
        left = req.num_prompt_tokens + req.max_tokens - req.num_computed_tokens
        return (left, req.arrival_s, req.request_id)


def serve(policy: str, requests) -> dict:
    """All ``requests`` arrive at once (lab 07's burst); per request TTFT and E2E."""
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=SEATS, max_num_batched_tokens=256,
                                        num_kv_blocks=256, scheduling_policy=policy)
    for i in range(2 * SEATS):  # the first steps of each batch shape pay set-up (kernels, threads)
        engine.add_request(f"warm-up-{i}", requests[0].prompt, SamplingParams(max_tokens=4 * (i % SEATS + 1)))
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    for r in requests:
        engine.add_request(r.request_id, r.prompt, SamplingParams(temperature=0, max_tokens=r.expected_output_len,
                                                                  ignore_eos=True))
    first, done, step = {}, {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step, now = step + 1, time.perf_counter() - t0
        for o in outputs:
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = (step, now)
            if o.finished:
                done[o.request_id] = (step, now)
    return {"ttft": first, "e2e": done}


def summary(times: dict, ids) -> dict:
    steps = np.array([times[i][0] for i in ids])
    secs = np.array([times[i][1] for i in ids])
    return {"mean_steps": steps.mean(), "p90_steps": np.percentile(steps, 90),
            "mean_s": secs.mean(), "p90_s": np.percentile(secs, 90)}


def main(quick: bool = False) -> dict:
    n = 16 if quick else 48
    rng = np.random.default_rng(0)
    lengths = rng.permutation([OUT_TOKENS * 8] * (n // 4) + [OUT_TOKENS] * (n - n // 4)).tolist()
    engine_tok = LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=8).tokenizer
    requests = make_requests(engine_tok, IN_TOKENS, lengths, seed=7)
    short = [r.request_id for r in requests if r.expected_output_len == OUT_TOKENS]
    long = [r.request_id for r in requests if r.expected_output_len != OUT_TOKENS]
    minserve.register_scheduling_policy("sjf", ShortestJobFirst)
    results = {}
    for policy in ("fcfs", "sjf"):
        run = serve(policy, requests)
        every = [r.request_id for r in requests]
        results[policy] = {f"{m}_{who}": summary(run[m], ids) for m in ("ttft", "e2e")
                           for who, ids in (("all", every), ("short", short), ("long", long))}
    print(f"{n} requests at once ({len(short)} of {OUT_TOKENS} tokens, {n - len(short)} of {OUT_TOKENS * 8}), "
          f"{SEATS} seats")
    for metric in ("ttft_all", "e2e_all", "e2e_short", "e2e_long"):
        for policy, r in results.items():
            s = r[metric]
            print(f"{metric:9s} {policy:4s}  mean {s['mean_steps']:5.1f} steps ({s['mean_s'] * 1000:6.0f} ms)  "
                  f"p90 {s['p90_steps']:5.1f} steps ({s['p90_s'] * 1000:6.0f} ms)")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    main(ap.parse_args().quick)
