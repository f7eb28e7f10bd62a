# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 01 — Prefill and decode: the two personalities of a request
#
# Every request is served in two phases. **Prefill** reads the whole prompt in one go (or in a few
# chunks) and fills the KV cache; it ends with the first output token. **Decode** then produces the
# answer one token per engine step, reusing the cache. The two phases cost different things, so a
# request can feel slow in two different ways: it takes long to *start* (TTFT), or it streams
# slowly once started (TPOT). This lab measures both, and what each one depends on.
#
# **Goals.** By the end you will have measured, on this machine:
#
# 1. that TTFT grows with the prompt length (prefill work), and by how much per token;
# 2. that TPOT grows with the number of requests decoding together, far slower than the batch —
#    so batching multiplies throughput;
# 3. the "two employees" case: a long RAG prompt and a short question sharing the engine, in both
#    orders — one order gives the short question a *slow start*, the other a *slow generation*;
# 4. why a latency distribution tells more than its average.
#
# **Run time:** about 1 minute quiet, up to 2.5 minutes on a busy machine (measured on a 2-core CPU
# in the `quick` preset, the default, by `benchmarks/bench_lab_robustness.py`: 1.1-1.2 min quiet,
# 2.1 min with another process holding one of the two cores). The `full` preset (`MINSERVE_LAB_PRESET=full`) uses prompts up to 8000 tokens and
# batches up to 64, sized for a GPU box; it has not been timed on one yet. The last cell prints
# how long this run took, how busy the machine was, and which of the lab's lessons this run showed.
#
# **Lessons are checked, not assumed.** Each headline measurement is followed by a line saying
# whether this run showed it ("Lesson shown: ...") or not, with the numbers, and when not, the
# cause it can measure (other programs taking the CPU, repeated runs that disagree) and how to get
# a clean run. On a workshop box shared by a room, expect some of them to say so.
#
# **Against a server** (`MINSERVE_LAB_TARGET=http://host:port`, see the README's labs section):
# sections 1, 2, 4 and 5 run over HTTP (client-side TTFT and TPOT, the server's `/metrics`); the
# engine's configuration, exercise 2's check, section 3 (the step budget, prompt chunks and queued
# steps of "two employees") and the correlation grid read the engine's own records, and are skipped
# with one line each. The engine arguments (prefix caching off) are then the server's to set.
#
# **Prerequisites:** [Lab 00](00_tour.ipynb) (TTFT, TPOT, `step()`, chunked prefill).
#
# **Source files:** [`engine/scheduler.py`](../minserve/engine/scheduler.py) (decodes first, then
# prompt chunks within the step budget), [`engine/model_runner.py`](../minserve/engine/model_runner.py)
# (one forward pass per step), [`metrics/frames.py`](../minserve/metrics/frames.py) (the TTFT and
# TPOT definitions), [`lab/workload.py`](../minserve/lab/workload.py) (how the workloads are run).

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from minserve import lab
from course import lab01 as ex

P = lab.setup()  # quiet logs, figure style, the preset; starts the clock lab.summary reads
try:  # the short checks of `minserve doctor`
    from minserve.workshop.doctor import format_checks, run_checks
    print(format_checks(run_checks(short=True), short=True), end="\n\n")
except ImportError:
    lab.environment_summary()
# Prefix caching is off in this lab: it repeats prompts, and every run must pay their full
# prefill (lab 04 turns caching on and measures what it saves). Everything else is the preset's.
# The lab's sizes, one value per preset (see each section):
prompt_lens = P.pick(quick=[16, 64, 256, 512, 768], full=[64, 1024, 2048, 4096, 8000], smoke=[16, 128, 512])
batches = P.pick(quick=[1, 2, 4, 8, 16], full=[1, 4, 16, 64], smoke=[1, 4, 16])
# A fresh engine can pay for the first use of each shape (measured on one host: a first 300-token
# prefill 3.8 s, the next 0.9 s; on another, 0.1 s more at most). engine_for runs each prompt
# length and decode batch measured below once, unmeasured.
llm = lab.engine_for(P, enable_prefix_caching=False, warm_prompts=sorted({*prompt_lens, 32}),
                     warm_batches=batches)
tok = llm.get_tokenizer()
print(P.describe())
lab00 = lab.load_baseline("00")

# %%
# needs the engine: the engine's configuration (step budget, KV pool)
cfg = llm.llm_engine.config
BUDGET = cfg.max_num_batched_tokens
print(f"engine: max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens={BUDGET}, "
      f"{llm.llm_engine.kv_spec.num_blocks} KV blocks of {cfg.block_size} tokens")

# %% [markdown]
# ## 1. Slow start: TTFT grows with the prompt
#
# Prompts of different lengths, sent **one at a time** (`max_concurrency=1`), so nothing queues and
# no request shares a step with another: each TTFT is that prompt's own prefill plus the first
# token. Every request asks for the same 16 output tokens, and each length runs three times, the
# lengths taking turns (a shared machine has hiccups: the median of three shrugs one off, and the
# three points per length show how big the hiccups were).
#
# **What to look for:** in the live figure, the TTFT dots should climb with each longer prompt,
# while the TPOT crosses move far less (a decode step reads the prompt's keys and values too, so
# they may rise a little). Below, TTFT against prompt length should be close to a straight line: a
# part that does not grow with the prompt, plus a cost per prompt token.

# %%
single = lab.run_workload(llm, lab.make_requests(tok, prompt_lens * 3, output_tokens=16, seed=1),
                          max_concurrency=1, name="one request at a time")

# %%
r1 = single.requests
med = ex.ttft_medians(r1)           # per length: the median of its runs
a, b = ex.prefill_fit(r1)           # the line through those medians
ttft_shown, ttft_evidence = ex.ttft_lesson(r1)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
ax1.plot(r1.prompt_tokens, r1.ttft_s * 1000, "o", color="tab:orange", alpha=0.5, label="each run")
ax1.plot(med.index, med.ttft_s * 1000, "_", color="black", ms=14, mew=2, label="median")
grid = np.linspace(0, r1.prompt_tokens.max(), 50)
ax1.plot(grid, (a + b * grid) * 1000, color="black", lw=1, alpha=0.6)
ax1.set(xlabel="prompt tokens", ylabel="TTFT (ms)",
        title="TTFT grows with prompt length" if ttft_shown else "Does TTFT grow with prompt length?")
ax1.legend()
ax2.plot(r1.prompt_tokens, r1.tpot_s * 1000, "x", color="tab:blue", ms=8)
ax2.set(xlabel="prompt tokens", ylabel="TPOT (ms)", ylim=(0, None),
        title="TPOT against prompt length: does it move?")
plt.show()
lo, hi = med.iloc[0], med.iloc[-1]
ttft_x, tpot_x = hi.ttft_s / lo.ttft_s, hi.tpot_s / lo.tpot_s
print(f"From {med.index[0]} to {med.index[-1]} prompt tokens (medians), TTFT went from "
      f"{lo.ttft_s * 1000:.0f} ms to {hi.ttft_s * 1000:.0f} ms ({ttft_x:.1f}x), and TPOT from "
      f"{lo.tpot_s * 1000:.1f} to {hi.tpot_s * 1000:.1f} ms ({tpot_x:.2f}x).")
lesson_ttft = lab.lesson("01-ttft-grows", "TTFT grows with the prompt length, close to a straight "
                         "line: prefill work is a cost per prompt token",
                         shown=ttft_shown, evidence=ttft_evidence, load=single.load)
(med[["runs"]].assign(**{"median TTFT (ms)": 1000 * med.ttft_s, "median TPOT (ms)": 1000 * med.tpot_s})
 .round(1))

# %% [markdown]
# The fitted line says TTFT ≈ *a* + *b* × prompt tokens. Its slope *b* is the cost of one more
# prompt token, so 1 / *b* is how many prompt tokens per second this machine prefills. Its
# intercept *a* is the part of a TTFT that does not grow with the prompt, when there is one: the
# next cell says what this run's line shows.

# %%
print(ex.describe_fit(r1, load=single.load))

# %% [markdown]
# **Exercise 1.** From the plot (or the table `med` of medians per length), estimate the prefill
# speed in prompt tokens per second. Two lengths far apart are enough.

# %%
prefill_tok_per_s = None  # your answer, in tokens/s

# %%
q1 = ex.q1_prefill_rate(single)
q1.check(prefill_tok_per_s)
# q1.hint()
# q1.solution()

# %% [markdown]
# ## 2. Slow generation: TPOT grows with the running batch
#
# Now the other phase. Short prompts (32 tokens) so prefill is negligible, 32 output tokens each,
# and a growing number of requests sent **together**: 1, then 2, 4, ... They prefill in one step and
# then decode side by side, one token each per step. Only the batch size changes between runs.
# Each batch size runs at least twice (`lab.calibrate`, more runs while they disagree by over 20 %):
# the table shows the median TPOT and how far the runs were apart.
#
# **What to look for:** a decode step must read every weight of the model once, whatever the batch;
# one more request adds some arithmetic. If the weights dominated, TPOT (each user's wait per
# token) would hardly move and the engine's total tokens per second would grow with the batch; if
# the per-request arithmetic dominated, TPOT would grow in proportion to the batch and throughput
# would stay flat. Look where this machine sits.

# %%
out_len = P.pick(quick=32, full=64, smoke=16)
batch_runs = {}                      # the last run of each batch size (its records feed exercise 2)


def tpot_at(n):
    """Calibrated mean TPOT of n requests decoding together."""
    def once():
        run = lab.run_workload(llm, lab.make_requests(tok, 32, out_len, num_requests=n, seed=100 + n),
                               live=False, name=f"batch {n}")
        batch_runs[n] = run
        return float(run.requests.tpot_s.mean())
    # The engine is warm (engine_for), so no run is thrown away; two that agree are enough.
    return lab.calibrate(once, name=f"TPOT at batch {n}", repeats=2, max_runs=4, tolerance=0.2,
                         discard_first=False, echo=False)


with lab.LoadProbe() as sweep_probe:
    batch_cals = lab.run_sweep(batches, tpot_at, title="batch sweep")
table = pd.DataFrame({
    "batch": batches,
    "mean TPOT (ms)": [1000 * batch_cals[n].median for n in batches],
    "runs": [len(batch_cals[n].samples) for n in batches],
    "spread (%)": [100 * batch_cals[n].spread for n in batches],
    "decode tokens/s (steps)": [ex.decode_rate_from_steps(batch_runs[n]) for n in batches],
}).set_index("batch")
table.round(1)

# %%
b1, bn = batches[0], batches[-1]
tpot_shown, tpot_evidence = ex.tpot_lesson({n: batch_cals[n].median for n in batches})
rate_x = table["decode tokens/s (steps)"][bn] / table["decode tokens/s (steps)"][b1]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
ax1.plot(table.index, table["mean TPOT (ms)"], "o-", color="tab:blue")
ax1.plot(table.index, table["mean TPOT (ms)"][b1] * table.index / b1, ":", color="grey",
         label="if TPOT grew with the batch")
ax1.set(xscale="log", yscale="log", xlabel="requests decoding together (log scale)",
        ylabel="TPOT (ms, log scale)",
        title="TPOT grows far slower than the batch" if tpot_shown else "How fast does TPOT grow with the batch?")
ax1.set_xticks(batches, [str(n) for n in batches])
ax1.legend()
ax2.plot(table.index, table["decode tokens/s (steps)"], "o-", color="tab:green")
ax2.set(xscale="log", xlabel="requests decoding together (log scale)", ylabel="output tokens/s",
        ylim=(0, None), title="decode throughput grows with the batch" if rate_x > 1
        else "does decode throughput grow with the batch?")
ax2.set_xticks(batches, [str(n) for n in batches])
plt.show()
print(f"From batch {b1} to {bn}: TPOT x{batch_cals[bn].median / batch_cals[b1].median:.1f}"
      + (f", tokens/s x{rate_x:.1f}." if np.isfinite(rate_x) else " (tokens/s: no step records over HTTP)."))
least_settled = max(batch_cals.values(), key=lambda c: c.spread)   # the batch size whose runs agreed least
lesson_tpot = lab.lesson("01-tpot-batch", "TPOT grows far slower than the batch, so batching "
                         "multiplies the engine's tokens per second", shown=tpot_shown,
                         evidence=tpot_evidence, load=sweep_probe.load, calibration=least_settled)

# %% [markdown]
# **Exercise 2.** At the largest batch, how many output tokens per second did the engine produce in
# total? Work it out from the batch size and the mean TPOT (the check compares it with the engine's
# step records).

# %%
decode_tok_per_s = None  # your answer, in tokens/s

# %%
# needs the engine: the engine's step records (the decode rate this check compares with)
q2 = ex.q2_decode_throughput(batch_runs)
q2.check(decode_tok_per_s)
# q2.hint()
# q2.solution()

# %% [markdown]
# ## 3. Two employees
#
# Employee A asks for a summary of a long policy document that retrieval pasted into the prompt
# (a RAG prompt); employee B asks for the support phone number, a prompt of a few tokens. Both
# answers are short. Counting them as "two requests" hides everything that matters: A's prompt is
# far more prefill work than B's (the cell below prints both lengths). Three runs, on the same engine:
#
# | run | what happens |
# | --- | --- |
# | B alone | B's own TTFT and TPOT, the reference (run a few times: `lab.calibrate`) |
# | A then B | both arrive together, A first (so A's TTFT here is what its prefill costs alone) |
# | B then A | B arrives first; A arrives a quarter of the way into B's decode (timed from "B alone") |
#
# **What to look for:** in "A then B", B's tiny prompt waits while A's chunks take whole steps.
# In "B then A", B starts fast, but the steps it shares with A's prompt chunks are as slow as those
# chunks, so B's tokens stall.

# %%
# needs the engine: the engine's step budget and request timelines (section 3)
LONG = ex.long_prompt_tokens(BUDGET)   # two and a half step budgets (exercise 5 says why)
question = "What is our support phone number? Answer in one line.\n"
A = lab.make_requests(tok, LONG, 16, labels=["A: summarize (RAG)"], seed=7,
                      prefixes=["Summarize the following policy document in three sentences.\n\n"])[0]
B = lab.make_requests(tok, len(tok(question).input_ids), 32, labels=["B: short question"],
                      prefixes=[question])[0]
print(f"A: {A.prompt_len} prompt tokens, {A.expected_output_len} output tokens; "
      f"B: {B.prompt_len} prompt tokens ({B.prompt!r}), {B.expected_output_len} output tokens")

b_alone_runs = []


def b_alone_e2e():
    run = lab.run_workload(llm, [B], live=False, name="B alone")
    b_alone_runs.append(run)
    return float(run.by_label(B.scenario).e2e_s)


cal_b = lab.calibrate(b_alone_e2e, name="B alone, end to end", repeats=3, max_runs=6, tolerance=0.2)
# The reference: the run nearest the median. A arrives a quarter of the way into B's decode.
ref = min(b_alone_runs[1:], key=lambda r: abs(r.by_label(B.scenario).e2e_s - cal_b.median))
row = ref.by_label(B.scenario)
delay = row.ttft_s + 0.25 * (row.e2e_s - row.ttft_s)
print(f"A will arrive {1000 * delay:.0f} ms after B in 'B then A'")
scenarios = {
    "A then B": dict(requests=[A, B]),                      # both at t = 0, A first
    # A fixed interval (burstiness=inf): B is sent after one delay, A after two.
    "B then A": dict(requests=[B, A], request_rate=1 / delay, burstiness=math.inf),
}
runs = {"B alone": ref, **lab.run_sweep(scenarios, lambda name: lab.run_workload(
    llm, live=False, name=name, **scenarios[name]), title="two employees")}
rows = []
for name, run in runs.items():
    for _, r in run.requests.iterrows():
        rows.append({"run": name, "request": r.label, "TTFT (ms)": r.ttft_s * 1000,
                     "queue (ms)": r.queue_s * 1000, "TPOT (ms)": r.tpot_s * 1000,
                     "longest gap between tokens (ms)": r.itl_max_s * 1000, "E2E (s)": r.e2e_s})
two = pd.DataFrame(rows).set_index(["run", "request"])
two.round(1)

# %%
# needs the engine: the engine's step budget and request timelines (section 3)
b_alone = runs["B alone"].by_label(B.scenario)
b_behind_a = runs["A then B"].by_label(B.scenario)
b_before_a = runs["B then A"].by_label(B.scenario)
start_shown, start_evidence = ex.slow_start_lesson(b_alone, b_behind_a)
gen_shown, gen_evidence = ex.slow_generation_lesson(b_alone, b_before_a)
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 4.2), layout="constrained")
lab.request_timeline(runs["A then B"], ax=ax1, title="A then B: B waits for A's prompt chunks"
                     if start_shown else "A then B: does B wait for A's prompt chunks?")
lab.request_timeline(runs["B then A"], ax=ax2, title="B then A: B's decode shares slow steps with A's chunks"
                     if gen_shown else "B then A: do A's chunks slow B's decode?")
plt.show()
print(f"B's TTFT: {b_alone.ttft_s * 1000:.0f} ms alone, {b_behind_a.ttft_s * 1000:.0f} ms behind A "
      f"({b_behind_a.ttft_s / b_alone.ttft_s:.1f}x), {b_before_a.ttft_s * 1000:.0f} ms when it came first.")
print(f"B's TPOT: {b_alone.tpot_s * 1000:.1f} ms alone, {b_behind_a.tpot_s * 1000:.1f} ms behind A, "
      f"{b_before_a.tpot_s * 1000:.1f} ms when A's prompt arrived during its decode "
      f"({b_before_a.tpot_s / b_alone.tpot_s:.1f}x).")
lesson_start = lab.lesson("01-slow-start", "a short request behind a long prompt gets a slow start: "
                          "its TTFT grows far more than its TPOT", shown=start_shown,
                          evidence=start_evidence, load=runs["A then B"].load, calibration=cal_b)
lesson_generation = lab.lesson("01-slow-generation", "a long prompt arriving during a short request's "
                               "decode slows its generation: its TPOT grows, its TTFT does not",
                               shown=gen_shown, evidence=gen_evidence, load=runs["B then A"].load,
                               calibration=cal_b)

# %% [markdown]
# The gaps between B's tokens in "B then A" show where the time went. **What to look for:** if A's
# prompt slowed B, most gaps are one decode step and a few are as long as one of A's prompt chunks
# (the orange bars on A's row above).

# %%
# needs the engine: the engine's step budget and request timelines (section 3)
ba = runs["B then A"]
times = np.array(b_before_a.token_times_s)
alone_times = np.array(b_alone.token_times_s)
fig, ax = plt.subplots(figsize=(9, 3.2))
ax.plot(np.arange(1, len(times)), np.diff(times) * 1000, "o-", ms=4, label="B, while A arrives")
ax.plot(np.arange(1, len(alone_times)), np.diff(alone_times) * 1000, "o-", ms=4, alpha=0.6,
        label="B alone")
ax.set(xlabel="token number", ylabel="gap before this token (ms)", yscale="log",
       title="B's inter-token gaps: the long ones are steps shared with A's prompt chunks")
ax.legend()
plt.show()
a_chunks = lab.chunk_table(ba)
a_chunks = a_chunks[a_chunks.request == A.scenario]
gaps, gaps_alone = np.diff(times), np.diff(alone_times)
chunk_ms = 1000 * (a_chunks.end_s - a_chunks.start_s)
long_gaps = int((gaps >= 0.5 * chunk_ms.min() / 1000).sum()) if len(chunk_ms) else 0
print(f"B's gaps: median {1000 * np.median(gaps):.1f} ms (alone {1000 * np.median(gaps_alone):.1f} ms), "
      f"longest {1000 * gaps.max():.0f} ms; A's prompt chunk steps took "
      f"{chunk_ms.min():.0f}-{chunk_ms.max():.0f} ms, and {long_gaps} of B's {len(gaps)} gaps were at "
      "least half as long as the shortest of them.")
a_chunks

# %% [markdown]
# **Exercise 3.** In the "A then B" run, did B suffer a `"slow start"` or a `"slow generation"`?
#
# **Exercise 4.** And in the "B then A" run?

# %%
# needs the engine: the engine's step budget and request timelines (section 3)
a_then_b = None  # your answer: "slow start" or "slow generation"
b_then_a = None  # your answer: "slow start" or "slow generation"

# %%
# needs the engine: the engine's step budget and request timelines (section 3)
q3 = ex.q3_a_then_b(b_alone, b_behind_a)
q3.check(a_then_b)
q4 = ex.q4_b_then_a(b_alone, b_before_a)
q4.check(b_then_a)
# q3.hint(); q4.hint()
# q3.solution(); q4.solution()

# %% [markdown]
# **Exercise 5.** In "A then B", for how many engine steps did B sit in the queue before the
# scheduler admitted it? Work it out from A's prompt length and the step budget (the scheduler in
# [`engine/scheduler.py`](../minserve/engine/scheduler.py) schedules running requests' chunks
# first, then admits waiting ones while budget is left); the check counts the steps in the records.

# %%
# needs the engine: the engine's step budget and request timelines (section 3)
print(f"A's prompt: {A.prompt_len} tokens; step budget: {BUDGET} tokens")
steps_queued = None  # your answer: a number of steps

# %%
# needs the engine: the engine's step budget and request timelines (section 3)
ab = runs["A then B"]
st = ab.steps
queued = int(((st.t_s >= b_behind_a.arrival_s)
              & (st.t_s + st.step_time_s <= b_behind_a.first_scheduled_s)).sum())
q5 = ex.q5_steps_queued(A.prompt_len, BUDGET, queued)
q5.check(steps_queued)
# q5.hint()
# q5.solution()

# %% [markdown]
# ## 4. Distributions, not averages
#
# Short questions are most of the traffic; a few RAG prompts come with them. Two runs with the same
# arrival times (Poisson, same seed) differ in one thing only: in "short + RAG", every fourth request
# carries a long document instead of a short question. The request rate is set from the prefill
# speed you measured in section 1, so that the RAG prompts' prefill keeps the engine busy about a
# third of the time on *this* machine: most short questions should then arrive while no RAG
# prompt is being prefilled.
#
# **What to look for:** a short question that arrives while no RAG prompt is being prefilled should
# be served as fast as before; one that arrives during a RAG prefill waits for it, or shares its
# slow steps. If so, the middle of the distribution moves less than the top, and the mean, pulled
# by a few slow requests, describes neither. The CDF shows where the two runs part.

# %%
n_mix = P.pick(quick=12, full=60, smoke=8)
rag_len = P.pick(quick=512, full=4096, smoke=256)
# One RAG prompt in 4 requests; its prefill takes about rag_len * b seconds (b: section 1's slope).
# Aim for RAG prefill busy about a third of the time: rate = 4 * (1/3) / (rag_len * b), capped at
# 50 req/s. (At half the time, half the short questions meet a RAG prefill and the median moves
# with the tail; with other programs slowing the engine, the queue then grows without end.)
rate = min(50.0, 4 / 3 / (rag_len * b))
print(f"one RAG prompt ({rag_len} tokens) prefills in about {rag_len * b:.2f} s here: "
      f"offering {rate:.2f} requests/s")
is_rag = [i % 4 == 3 for i in range(n_mix)]
mixed = lab.make_requests(tok, [rag_len if r else 32 for r in is_rag], 16, seed=3,
                          labels=["RAG" if r else "short" for r in is_rag])
# The same arrival times; the RAG slots carry short prompts too, labelled apart so that both runs
# compare the very same short questions.
short_only = lab.make_requests(tok, 32, 16, num_requests=n_mix, seed=3,
                               labels=["short (in a RAG slot)" if r else "short" for r in is_rag])
dist = lab.run_sweep(["short only", "short + RAG"],
                     lambda name: lab.run_workload(llm, short_only if name == "short only" else mixed,
                                                   request_rate=rate, seed=0, live=name != "short only",
                                                   name=name),
                     title="distributions")

# %%
shorts = {name: run.requests[run.requests.label == "short"] for name, run in dist.items()}
pct = lab.compare_distributions(shorts, metric="ttft_s")
plt.show()
pct

# %%
lo_run, hi_run = pct.loc["short only"], pct.loc["short + RAG"]
print(f"Short questions' TTFT: mean {lo_run['mean']:.0f} -> {hi_run['mean']:.0f} ms, "
      f"median {lo_run['p50']:.0f} -> {hi_run['p50']:.0f} ms, p90 {lo_run['p90']:.0f} -> {hi_run['p90']:.0f} ms.")
tail_shown, tail_evidence = ex.tail_lesson(pct)
lesson_tail = lab.lesson("01-tail", "a few long prompts in the traffic move the slow end of the short "
                         "questions' TTFT (p90) more than its middle (median)", shown=tail_shown,
                         evidence=tail_evidence, load=dist["short + RAG"].load)

# %% [markdown]
# What did the slow ones have in common? Per request, TTFT next to its circumstances: the time it
# queued, its prompt length, the running batch during its decode, and the KV cache usage over its
# life (see [`lab/correlate.py`](../minserve/lab/correlate.py)); r is Pearson's correlation. One
# question to ask: did the slowest short questions wait in the *queue*, or in the *step* they ran in?

# %%
# needs the engine: the engine's request timelines (queue time, running batch, KV usage)
corr = lab.correlation_grid(dist["short + RAG"])
plt.show()
mixed_short = dist["short + RAG"].requests.query("label == 'short'")
worst = mixed_short.loc[mixed_short.ttft_s.idxmax()]
print(f"The slowest short question: TTFT {worst.ttft_s * 1000:.0f} ms, of which "
      f"{worst.queue_s * 1000:.0f} ms in the queue and {worst.prefill_s * 1000:.0f} ms from admission "
      f"to its first token (its prefill, in steps shared with whatever else was running).")

# %% [markdown]
# ## 5. Explore
#
# The panel below runs the same experiment as `lab.run_experiment(...)` with the values on its
# sliders (rate, concurrency, prompt and output length, `max_num_seqs`, the step budget, the KV
# budget). Try a long prompt with many requests at once, then the same with a smaller step budget.
# In CI no button is pressed, so the cell after it calls the function directly.

# %%
panel = lab.control_panel(preset=P, engine_args=dict(enable_prefix_caching=False), engine=llm,
                          num_requests=6, prompt_tokens=256, output_tokens=16)
panel

# %%
explore = lab.run_experiment(P, num_requests=3, prompt_tokens=128, output_tokens=16, live=False,
                             enable_prefix_caching=False)  # the notebook's engine: same arguments
explore.percentiles()

# %% [markdown]
# ## 6. Record your baseline

# %%
baseline = {
    "prefill_tok_per_s": round(1 / b, 1),
    "prefill_fixed_ms": round(1000 * max(a, 0.0), 1),   # a negative intercept is no cost (see section 1)
    "prefill_fit_r2": round(ex.fit_r2(r1), 4),
    "tpot_ms_by_batch": {int(n): round(v, 2) for n, v in table["mean TPOT (ms)"].items()},
    "decode_tok_per_s_by_batch": {int(n): round(v, 1) for n, v in table["decode tokens/s (steps)"].items()},
    "short_ttft_ms": {name: {k: round(v, 1) for k, v in row.items()} for name, row in pct.iterrows()},
}

# %%
# needs the engine: the engine's records of section 3 (two employees)
baseline["two_employees_ms"] = {f"{run} / {req}": {"ttft": round(r["TTFT (ms)"], 1), "tpot": round(r["TPOT (ms)"], 1)}
                                for (run, req), r in two.iterrows()}

# %%
baseline_path = lab.record_baseline("01", baseline)
if lab00:
    print(f"\nLab 00 measured a lone request's TPOT at {lab00['tour_stream_tpot_ms']:.1f} ms; "
          f"batch 1 here: {table['mean TPOT (ms)'][batches[0]]:.1f} ms.")

# %% [markdown]
# ## Summary
#
# The mechanisms this lab is about:
#
# - **Prefill** computes the whole prompt (in chunks of at most the step budget) and ends with the
#   first token: its work grows with the prompt, and a long prompt means a *slow start*.
# - **Decode** reads every weight once per step for the whole running batch and gives each request
#   one token; how much a bigger batch costs each request is what section 2 measured.
# - Requests interfere through the steps they share: a short request behind a long prompt waits for
#   that prompt's chunks; a long prompt arriving during a short request's decode puts its chunks in
#   the steps that decode shares. Which one a request meets depends on the order.
# - An average mixes the requests that met a long prompt with those that did not: look at
#   distributions, and at latency next to what the engine was doing.
#
# What this run showed of them, in its own numbers (and in `labs/results/01.json`):

# %%
summary = lab.summary("01")

# %% [markdown]
# ## Stretch goals
#
# - Rerun section 3 with `lab.engine_for(P, enable_prefix_caching=False, max_num_batched_tokens=128)`.
#   How do B's TTFT behind A and B's worst gap change? What does a smaller budget cost A?
# - `enable_chunked_prefill=False` makes a prompt run in one step (it must then fit in the budget).
#   What happens to B's longest gap in "B then A" when A's whole prompt is a single step?
# - Point section 4 at a server: start `minserve serve` (or use a shared one) and pass
#   `base_url="http://host:port"` to `lab.run_workload` instead of `llm`. Which plots still work,
#   and which need the engine's own records?
# - Prefill is bound by arithmetic, batch-1 decode by bytes. Test that on a CPU with AMX: rebuild
#   the engine with `lab.engine_for(P, enable_prefix_caching=False, fp32_matmul_precision="high")`
#   (float32 weights kept; products of 16 rows or more run as three bf16 products on the tiles, at
#   about twice the float32 rate: `benchmarks/bench_roofline.py` measures both) and rerun sections
#   1 and 2. Before you run it, predict which of the per-token prefill cost and the batch-1 TPOT
#   moves, and what happens at batch 16. (On a CPU without AMX the setting changes nothing, and the
#   engine's log says why.)
