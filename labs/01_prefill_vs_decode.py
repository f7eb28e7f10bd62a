# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
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
# **Run time:** about 2 minutes on a 2-core laptop CPU in the `quick` preset (the default). The
# `full` preset (`MINSERVE_LAB_PRESET=full`) uses prompts up to 8000 tokens and batches up to 64,
# sized for a GPU box; it has not been timed on one yet. The last cell prints how long this run took.
#
# **Prerequisites:** [Lab 00](00_tour.ipynb) (TTFT, TPOT, `step()`, chunked prefill).
#
# **Source files:** [`engine/scheduler.py`](../minserve/engine/scheduler.py) (decodes first, then
# prompt chunks within the step budget), [`engine/model_runner.py`](../minserve/engine/model_runner.py)
# (one forward pass per step), [`metrics/frames.py`](../minserve/metrics/frames.py) (the TTFT and
# TPOT definitions), [`lab/workload.py`](../minserve/lab/workload.py) (how the workloads are run).

# %%
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from minserve import lab
from course import lab01 as ex

t_lab = time.perf_counter()
P = lab.setup()
try:  # the short checks of `minserve doctor`
    from minserve.workshop.doctor import format_checks, run_checks
    print(format_checks(run_checks(short=True), short=True), end="\n\n")
except ImportError:
    lab.environment_summary()
# Prefix caching is off in this lab: it repeats prompts, and every run must pay their full
# prefill (lab 04 turns caching on and measures what it saves). Everything else is the preset's.
llm = lab.engine_for(P, enable_prefix_caching=False)
tok = llm.get_tokenizer()
cfg = llm.llm_engine.config
BUDGET = cfg.max_num_batched_tokens
print(P.describe())
print(f"engine: max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens={BUDGET}, "
      f"{llm.llm_engine.kv_spec.num_blocks} KV blocks of {cfg.block_size} tokens")
lab00 = lab.load_baseline("00")

# %% [markdown]
# ## 1. Slow start: TTFT grows with the prompt
#
# Prompts of different lengths, sent **one at a time** (`max_concurrency=1`), so nothing queues and
# no request shares a step with another: each TTFT is that prompt's own prefill plus the first
# token. Every request asks for the same 16 output tokens, and each length runs twice (a shared
# machine has hiccups; two points per length show how big they are).
#
# **What to look for:** in the live figure, the TTFT dots climb with each longer prompt while the
# TPOT crosses stay level. Below, TTFT against prompt length is close to a straight line: a fixed
# cost per step plus a cost per prompt token.

# %%
prompt_lens = P.pick(quick=[32, 256, 512, 768], full=[64, 1024, 2048, 4096, 8000])
single = lab.run_workload(llm, lab.make_requests(tok, prompt_lens * 2, output_tokens=16, seed=1),
                          max_concurrency=1, name="one request at a time")

# %%
r1 = single.requests
a, b = ex.prefill_fit(r1)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
ax1.plot(r1.prompt_tokens, r1.ttft_s * 1000, "o", color="tab:orange")
grid = np.linspace(0, r1.prompt_tokens.max(), 50)
ax1.plot(grid, (a + b * grid) * 1000, color="black", lw=1, alpha=0.6)
ax1.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="TTFT grows with prompt length")
ax2.plot(r1.prompt_tokens, r1.tpot_s * 1000, "x", color="tab:blue", ms=8)
ax2.set(xlabel="prompt tokens", ylabel="TPOT (ms)", ylim=(0, None),
        title="TPOT against prompt length: does it move?")
plt.show()
med = r1.groupby("prompt_tokens")[["ttft_s", "tpot_s"]].median()  # per length, the median of its runs
lo, hi = med.iloc[0], med.iloc[-1]
print(f"From {med.index[0]} to {med.index[-1]} prompt tokens (medians), TTFT went from "
      f"{lo.ttft_s * 1000:.0f} ms to {hi.ttft_s * 1000:.0f} ms ({hi.ttft_s / lo.ttft_s:.1f}x), while "
      f"TPOT went from {lo.tpot_s * 1000:.1f} to {hi.tpot_s * 1000:.1f} ms "
      f"({(hi.tpot_s / lo.tpot_s - 1) * 100:+.0f} %).")

# %% [markdown]
# The fitted line says TTFT ≈ *a* + *b* × prompt tokens. Its slope *b* is the cost of one more
# prompt token, so 1 / *b* is how many prompt tokens per second this machine prefills.
#
# **Exercise 1.** From the plot (or the table `r1`), estimate the prefill speed in prompt tokens per
# second. Two points far apart are enough.

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
#
# **What to look for:** a decode step must read every weight of the model once, whatever the batch;
# one more request adds only a little arithmetic. So TPOT (each user's wait per token) rises slowly,
# while the engine's total tokens per second rises almost in proportion to the batch.

# %%
batches = P.pick(quick=[1, 2, 4, 8, 16], full=[1, 4, 16, 64])
out_len = P.pick(quick=32, full=64)
batch_runs = lab.run_sweep(
    batches,
    lambda n: lab.run_workload(llm, lab.make_requests(tok, 32, out_len, num_requests=n, seed=100 + n),
                               live=False, name=f"batch {n}"),
    title="batch sweep")
table = pd.DataFrame({
    "batch": batches,
    "mean TPOT (ms)": [batch_runs[n].requests.tpot_s.mean() * 1000 for n in batches],
    "decode tokens/s (steps)": [ex.decode_rate_from_steps(batch_runs[n]) for n in batches],
}).set_index("batch")
table.round(1)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
ax1.plot(table.index, table["mean TPOT (ms)"], "o-", color="tab:blue")
ax1.set(xscale="log", xlabel="requests decoding together (log scale)", ylabel="TPOT (ms)",
        ylim=(0, None), title="TPOT against the running batch")
ax1.set_xticks(batches, [str(n) for n in batches])
ax2.plot(table.index, table["decode tokens/s (steps)"], "o-", color="tab:green")
ax2.set(xscale="log", xlabel="requests decoding together (log scale)", ylabel="output tokens/s",
        ylim=(0, None), title="decode throughput grows with the batch")
ax2.set_xticks(batches, [str(n) for n in batches])
plt.show()
b1, bn = batches[0], batches[-1]
print(f"From batch {b1} to {bn}: TPOT x{table['mean TPOT (ms)'][bn] / table['mean TPOT (ms)'][b1]:.1f}, "
      f"tokens/s x{table['decode tokens/s (steps)'][bn] / table['decode tokens/s (steps)'][b1]:.1f}.")

# %% [markdown]
# **Exercise 2.** At the largest batch, how many output tokens per second did the engine produce in
# total? Work it out from the batch size and the mean TPOT (the check compares it with the engine's
# step records).

# %%
decode_tok_per_s = None  # your answer, in tokens/s

# %%
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
# | B alone | B's own TTFT and TPOT, the reference |
# | A then B | both arrive together, A first (so A's TTFT here is what its prefill costs alone) |
# | B then A | B arrives first; A arrives 0.3 s later, while B is decoding |
#
# **What to look for:** in "A then B", B's tiny prompt waits while A's chunks take whole steps.
# In "B then A", B starts fast, but the steps it shares with A's prompt chunks are as slow as those
# chunks, so B's tokens stall.

# %%
LONG = P.pick(quick=3 * 512, full=3 * 2048)
question = "What is our support phone number? Answer in one line.\n"
A = lab.make_requests(tok, LONG, 16, labels=["A: summarize (RAG)"], seed=7,
                      prefixes=["Summarize the following policy document in three sentences.\n\n"])[0]
B = lab.make_requests(tok, len(tok(question).input_ids), 32, labels=["B: short question"],
                      prefixes=[question])[0]
print(f"A: {A.prompt_len} prompt tokens, {A.expected_output_len} output tokens; "
      f"B: {B.prompt_len} prompt tokens ({B.prompt!r}), {B.expected_output_len} output tokens")

scenarios = {
    "B alone": dict(requests=[B]),
    "A then B": dict(requests=[A, B]),                      # both at t = 0, A first
    # A fixed interval (burstiness=inf) of 0.3 s: B is sent at 0.3 s, A at 0.6 s.
    "B then A": dict(requests=[B, A], request_rate=1 / 0.3, burstiness=math.inf),
}
runs = lab.run_sweep(scenarios, lambda name: lab.run_workload(llm, live=False, name=name,
                                                              **scenarios[name]),
                     title="two employees")
rows = []
for name, run in runs.items():
    for _, r in run.requests.iterrows():
        rows.append({"run": name, "request": r.label, "TTFT (ms)": r.ttft_s * 1000,
                     "queue (ms)": r.queue_s * 1000, "TPOT (ms)": r.tpot_s * 1000,
                     "longest gap between tokens (ms)": r.itl_max_s * 1000, "E2E (s)": r.e2e_s})
two = pd.DataFrame(rows).set_index(["run", "request"])
two.round(1)

# %%
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 4.2), layout="constrained")
lab.request_timeline(runs["A then B"], ax=ax1, title="A then B: B waits for A's prompt chunks")
lab.request_timeline(runs["B then A"], ax=ax2, title="B then A: B's decode shares steps with A's chunks")
plt.show()
b_alone = runs["B alone"].by_label(B.scenario)
b_behind_a = runs["A then B"].by_label(B.scenario)
b_before_a = runs["B then A"].by_label(B.scenario)
print(f"B's TTFT: {b_alone.ttft_s * 1000:.0f} ms alone, {b_behind_a.ttft_s * 1000:.0f} ms behind A "
      f"({b_behind_a.ttft_s / b_alone.ttft_s:.0f}x), {b_before_a.ttft_s * 1000:.0f} ms when it came first.")
print(f"B's TPOT: {b_alone.tpot_s * 1000:.0f} ms alone, {b_behind_a.tpot_s * 1000:.0f} ms behind A, "
      f"{b_before_a.tpot_s * 1000:.0f} ms when A's prompt arrived during its decode "
      f"({b_before_a.tpot_s / b_alone.tpot_s:.1f}x).")

# %% [markdown]
# The gaps between B's tokens in "B then A" show where the time went: most gaps are one decode
# step, and a few are as long as one of A's prompt chunks (the orange bars on A's row above).

# %%
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
a_chunks[a_chunks.request == A.scenario]

# %% [markdown]
# **Exercise 3.** In the "A then B" run, did B suffer a `"slow start"` or a `"slow generation"`?
#
# **Exercise 4.** And in the "B then A" run?

# %%
a_then_b = None  # your answer: "slow start" or "slow generation"
b_then_a = None  # your answer: "slow start" or "slow generation"

# %%
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
print(f"A's prompt: {A.prompt_len} tokens; step budget: {BUDGET} tokens")
steps_queued = None  # your answer: a number of steps

# %%
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
# speed you measured in section 1, so that the RAG prompts' prefill keeps the engine busy about
# half of the time on *this* machine.
#
# **What to look for:** a short question that arrives while no RAG prompt is being prefilled is
# served as fast as before; one that arrives during a RAG prefill waits for it, or shares its slow
# steps. So the middle of the distribution moves less than the top, and the mean, pulled by a few
# slow requests, describes neither. The CDF shows where the two runs part.

# %%
n_mix = P.pick(quick=12, full=60)
rag_len = P.pick(quick=512, full=4096)
# One RAG prompt in 4 requests; its prefill takes about rag_len * b seconds (b: section 1's slope).
# Aim for RAG prefill busy ~half the time: rate = 4 * 0.5 / (rag_len * b), capped at 50 req/s.
rate = min(50.0, 4 * 0.5 / (rag_len * b))
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

# %% [markdown]
# What did the slow ones have in common? Per request, TTFT next to its circumstances: the time it
# queued, its prompt length, the running batch during its decode, and the KV cache usage over its
# life (see [`lab/correlate.py`](../minserve/lab/correlate.py)); r is Pearson's correlation. One
# question to ask: did the slowest short questions wait in the *queue*, or in the *step* they ran in?

# %%
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
panel = lab.control_panel(preset=P, engine_args=dict(enable_prefix_caching=False),
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
    "prefill_fixed_ms": round(1000 * a, 1),
    "tpot_ms_by_batch": {int(n): round(v, 2) for n, v in table["mean TPOT (ms)"].items()},
    "decode_tok_per_s_by_batch": {int(n): round(v, 1) for n, v in table["decode tokens/s (steps)"].items()},
    "two_employees_ms": {f"{run} / {req}": {"ttft": round(r["TTFT (ms)"], 1), "tpot": round(r["TPOT (ms)"], 1)}
                         for (run, req), r in two.iterrows()},
    "short_ttft_ms": {name: {k: round(v, 1) for k, v in row.items()} for name, row in pct.iterrows()},
}
baseline_path = lab.record_baseline("01", baseline)
print(f"This notebook ran in {time.perf_counter() - t_lab:.0f} s (preset {P.name!r}, {P.device}).")
if lab00:
    print(f"\nLab 00 measured a lone request's TPOT at {lab00['tour_stream_tpot_ms']:.1f} ms; "
          f"batch 1 here: {table['mean TPOT (ms)'][batches[0]]:.1f} ms.")

# %% [markdown]
# ## Summary
#
# - **Prefill** cost grows with the prompt: TTFT is roughly a fixed step cost plus a cost per prompt
#   token. Long prompts mean a *slow start*.
# - **Decode** cost grows with the running batch, but slowly: a step reads the weights once for the
#   whole batch, so more requests decoding together means many more tokens per second for a small
#   increase in each one's TPOT.
# - Requests interfere through the steps they share. A short request behind a long prompt waits for
#   that prompt's chunks (slow start); a long prompt arriving during a short request's decode makes
#   the shared steps slow (slow generation). Which one you see depends on the order.
# - Averages hide this. Look at distributions, and at latency next to what the engine was doing.
#
# This run's numbers are in the cells above and in `labs/results/01.json`.
#
# ## Stretch goals
#
# - Rerun section 3 with `lab.engine_for(P, enable_prefix_caching=False, max_num_batched_tokens=128)`.
#   How do B's TTFT behind A and B's worst gap change? What does a smaller budget cost A?
# - `enable_chunked_prefill=False` makes a prompt run in one step (it must then fit in the budget).
#   What happens to B's longest gap in "B then A" when A's whole prompt is a single step?
# - Point section 4 at a server: start `minserve serve` (or use a shared one) and pass
#   `base_url="http://host:port"` to `lab.run_workload` instead of `llm`. Which plots still work,
#   and which need the engine's own records?
