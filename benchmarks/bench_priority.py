"""Interactive TTFT idle vs under a flood of batch requests, scheduling_policy "fcfs" vs "priority".

One process, one engine per policy (``--model``, default smollm2-135m: the real default model, so
step times are the ones a user sees; tiny-llama, random weights, runs the same scheduling in a
fraction of the time and is what ``--quick`` uses). Engines are driven step by step in-process,
the way the HTTP server's engine thread drives them, with the server's priority mapping
(``minserve.server.app.engine_priority``: interactive = class rank 0, batch = rank 1).

1. **Idle.** ``--interactive`` short requests (``--interactive-prompt`` random tokens, 16 greedy
   output tokens), one at a time on an empty engine.
2. **Flood.** ``--batch`` requests (``--batch-prompt`` random tokens, ``--batch-output`` tokens
   each, class batch) are queued at once; then one interactive request arrives every
   ``--interval`` seconds of wall time, ``--interactive`` in all. An arrival is stamped at the
   moment it was due (``arrival_time``), which usually falls inside a running step, as it would
   on a server; it joins at the next step. The phase ends when the last interactive request has
   finished; the batch requests still in the engine are aborted (counted in the table).

TTFT = first token time − arrival, from the engine's request records. The table gives p50 / p99
TTFT per policy and phase and the flood p99 as a multiple of the idle p99 of the same engine.

    .venv/bin/python benchmarks/bench_priority.py            # smollm2-135m, ~2-3 min on 2 cores
    .venv/bin/python benchmarks/bench_priority.py --quick    # tiny-llama, ~20 s
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from minserve import SamplingParams
from minserve.engine.llm_engine import LLMEngine
from minserve.server.app import engine_priority

TARGET = 10.0  # flood p99 / idle p99 under "priority": "within a small multiple of idle"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="smollm2-135m (default) or tiny-llama (--quick)")
    ap.add_argument("--batch", type=int, default=120, help="batch requests in the flood")
    ap.add_argument("--batch-prompt", type=int, default=96)
    ap.add_argument("--batch-output", type=int, default=None, help="output tokens per batch request (64)")
    ap.add_argument("--interactive", type=int, default=None, help="interactive requests per phase (30)")
    ap.add_argument("--interactive-prompt", type=int, default=32)
    ap.add_argument("--interval", type=float, default=None, help="seconds between interactive arrivals")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="fcfs,priority", help="comma-separated, run in this order")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/priority.json")
    a = ap.parse_args()
    a.model = a.model or ("tiny-llama" if a.quick else "smollm2-135m")
    a.batch_output = a.batch_output or (32 if a.quick else 64)
    a.interactive = a.interactive or (20 if a.quick else 30)
    a.interval = a.interval or (0.05 if a.quick else 0.3)
    return a


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def ttfts_ms(eng: LLMEngine, ids: list[str]) -> list[float]:
    rec = {r.request_id: r for r in eng.finished_requests}
    return [1000 * (rec[i].timeline.first_token_s - rec[i].timeline.arrival_s) for i in ids]


def run_policy(a, policy: str, rng: random.Random) -> dict:
    eng = LLMEngine.from_engine_args(a.model, max_num_seqs=a.max_num_seqs,
                                     max_num_batched_tokens=a.max_num_batched_tokens,
                                     scheduling_policy=policy, max_request_records=100_000)
    vocab = eng.model_config.vocab_size
    prio_i = engine_priority(eng, "interactive", 0)
    prio_b = engine_priority(eng, "batch", 0)
    inter = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = SamplingParams(temperature=0, max_tokens=a.batch_output, ignore_eos=True)

    def prompt(n):
        return [rng.randrange(100, vocab) for _ in range(n)]

    # warm-up: first steps build kernels and caches
    eng.add_request("warm", prompt(a.interactive_prompt), inter)
    while eng.has_unfinished_requests():
        eng.step()

    idle_ids = []
    for i in range(a.interactive):
        rid = f"idle-{i}"
        eng.add_request(rid, prompt(a.interactive_prompt), inter, priority=prio_i)
        while eng.has_unfinished_requests():
            eng.step()
        idle_ids.append(rid)

    preempt0 = eng.scheduler.num_preemptions
    t0 = time.perf_counter()
    for i in range(a.batch):
        eng.add_request(f"batch-{i}", prompt(a.batch_prompt), batch, priority=prio_b)
    offset = eng.output_processor.clock_offset_s
    flood_ids, next_at, done = [], t0 + a.interval, set()
    while len(done) < a.interactive:
        now = time.perf_counter()
        while len(flood_ids) < a.interactive and next_at <= now:
            rid = f"flood-{len(flood_ids)}"
            eng.add_request(rid, prompt(a.interactive_prompt), inter, priority=prio_i,
                            arrival_time=next_at + offset)  # when it was due: maybe mid-step
            flood_ids.append(rid)
            next_at += a.interval
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, next_at - time.perf_counter()))
            continue
        for o in eng.step():
            if o.finished and o.request_id.startswith("flood-"):
                done.add(o.request_id)
    flood_s = time.perf_counter() - t0
    left = [r for r in eng.requests if r.startswith("batch-")]
    batch_tokens = a.batch * a.batch_output - sum(a.batch_output - eng.requests[r].num_output_tokens
                                                   for r in left)
    eng.abort_request(left)
    idle, flood = ttfts_ms(eng, idle_ids), ttfts_ms(eng, flood_ids)
    return {"policy": policy, "idle_ms": idle, "flood_ms": flood, "flood_s": flood_s,
            "batch_unfinished": len(left), "batch_tokens_done": batch_tokens,
            "preemptions": eng.scheduler.num_preemptions - preempt0}


def main() -> None:
    a = parse_args()
    t0 = time.time()
    runs = [run_policy(a, p, random.Random(a.seed)) for p in a.policies.split(",")]
    lines = [f"{a.model}, max_num_seqs={a.max_num_seqs}, max_num_batched_tokens={a.max_num_batched_tokens}; "
             f"flood: {a.batch} batch requests x ({a.batch_prompt} prompt + {a.batch_output} output) tokens, "
             f"{a.interactive} interactive ({a.interactive_prompt} + 16) every {a.interval} s; "
             f"{platform.processor() or platform.machine()}",
             "",
             "| policy | idle p50 / p99 TTFT (ms) | flood p50 / p99 TTFT (ms) | flood p99 / idle p99 "
             "| phase (s) | batch tokens done / aborted reqs | preemptions |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        i50, i99, f50, f99 = (pct(r["idle_ms"], 50), pct(r["idle_ms"], 99),
                              pct(r["flood_ms"], 50), pct(r["flood_ms"], 99))
        r.update(idle_p50_ms=i50, idle_p99_ms=i99, flood_p50_ms=f50, flood_p99_ms=f99, ratio=f99 / i99)
        lines.append(f"| {r['policy']} | {i50:.0f} / {i99:.0f} | {f50:.0f} / {f99:.0f} | {f99 / i99:.1f}x "
                     f"| {r['flood_s']:.1f} | {r['batch_tokens_done']} / {r['batch_unfinished']} "
                     f"| {r['preemptions']} |")
    for pr in (r for r in runs if r["policy"] == "priority"):
        verdict = "ok" if pr["ratio"] <= TARGET else "MISSED"
        lines += ["", f"priority: flood p99 = {pr['ratio']:.1f}x idle p99 (target <= {TARGET:.0f}x): {verdict}"]
    table = "\n".join(lines)
    print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs, "table": table,
                                       "wall_s": time.time() - t0}, indent=2))


if __name__ == "__main__":
    main()
