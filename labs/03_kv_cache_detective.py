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
# # Lab 03 — The KV-cache detective
#
# A model that loads has only proven one thing: its weights fit. Every request being served also
# keeps the keys and values of all its tokens, in every layer, for as long as it runs: the **KV
# cache**. That memory grows with the prompt, grows again with every generated token, and is
# multiplied by the number of requests running together. When it runs out, the engine has to make
# requests wait, or take memory back from one that is already running (a **preemption**), and users
# see it as latency.
#
# This lab is a detective exercise in six steps: start an engine with a deliberately small KV
# budget, then lengthen the prompts and raise the concurrency while watching KV usage, waiting
# requests, queue time and preemptions side by side, until latency gives way.
#
# **Goals.** By the end you will have:
#
# 1. computed the KV bytes per token from the model's shape, and checked it against what the
#    engine actually allocated;
# 2. predicted how many KV blocks a workload holds, and how many sequences fit in a budget
#    (with the serving-budget planner, `minserve.plan`), met the planner's **roofline** estimate of
#    how fast a step can be, and compared the plan with what the engine really ran;
# 3. followed workload shape to memory pressure, to scheduling (waiting, preemption), to latency,
#    and recorded the concurrency where latency starts to give way.
#
# The headline results are counted from the engine's records (blocks, preemptions, steps), not
# timed, so they hold on a busy machine too; each is checked on this run's numbers in a line
# starting "Lesson shown" or "Lesson NOT shown in this run", and the last cell sums them up.
#
# **Run time** (`quick` preset, the default, on a 2-core laptop CPU): about 20 s on a quiet
# machine, up to 40 s on a busy one (measured by `benchmarks/bench_lab_robustness.py`: 19-24 s
# quiet, 33-35 s with another process holding one of the two cores), plus loading the model the first time. The `full` preset
# (`MINSERVE_LAB_PRESET=full`) uses 8 times longer prompts and a larger budget, sized for a GPU;
# its run time there has not been measured yet.
#
# **Against a server** (`MINSERVE_LAB_TARGET=http://host:port`, see the README's labs section):
# the workloads of steps 2 to 5 run over HTTP, with the server's own KV pool and seats (the lab asks
# for `KV_BUDGET` but cannot set it), and their KV usage and preemptions come from its `/metrics`
# (the KV-usage figures, the per-run figure of steps 4 and 5); the planner, the roofline and the
# explore panel run too. The engine's configuration and K/V tensors (exercise 1), the block counts
# (exercise 2), the pressure table and everything built on it (exercises 4 and 5, step 6, the
# baseline) read the engine's own records, and are skipped with one line each.
#
# **Prerequisites:** [Lab 01](01_prefill_vs_decode.ipynb) (prefill and decode) and
# [Lab 02](02_continuous_batching.ipynb) (seats, queueing, the knee).
#
# **Source files:** [`engine/kv_cache.py`](../minserve/engine/kv_cache.py) (blocks, block tables,
# `plan_kv_cache`: how many blocks a budget buys), [`engine/scheduler.py`](../minserve/engine/scheduler.py)
# (admission, and preemption when blocks run out), [`engine/model_runner.py`](../minserve/engine/model_runner.py)
# (where the K and V tensors are allocated), [`plan/planner.py`](../minserve/plan/planner.py) (the
# serving-budget planner) and [`plan/budget.py`](../minserve/plan/budget.py) (its formulas and the
# roofline), [`lab/capacity.py`](../minserve/lab/capacity.py) (the tables and step counts used
# here), and this lab's exercises and rules in [`course/lab03.py`](course/lab03.py).

# %%
# Set-up check (the short form of `minserve doctor`): what this notebook runs on.
import dataclasses
import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from minserve import lab
from minserve.config import parse_bytes
from course import lab03 as ex
from minserve.plan import plan
from minserve.workshop.doctor import format_checks, run_checks

P = lab.setup()  # also starts the clock and the load probe that lab.summary reports at the end
print(format_checks(run_checks(short=True), short=True))

# %% [markdown]
# ## Step 1. Start one engine, with a small KV budget
#
# `kv_cache_memory` gives the engine a fixed number of bytes for its KV cache, exactly as a
# workshop gives each participant a share of one GPU. The engine cuts the budget into **blocks** of
# `block_size` token slots; a request's cache is a list of blocks, taken one at a time as it grows
# (the PagedAttention idea, see [`engine/kv_cache.py`](../minserve/engine/kv_cache.py)). The budget
# here is tiny on purpose, so that memory pressure shows up within seconds. Everything else is the
# preset's engine, except two things: the preset's own KV size (a block count, which would take
# precedence over a byte budget) is dropped, and prefix caching is off, so that every request
# computes and stores its own prompt. The engine is warmed up on the prompt lengths and batch sizes
# measured below before anything runs.

# %%
KV_BUDGET = P.pick(quick="20MiB", full="184MiB")
SHORT = P.pick(quick=16, full=64)     # prompt tokens in step 2
LONG = P.pick(quick=56, full=448)     # prompt tokens from step 3 on
OUT = P.pick(quick=32, full=64)       # output tokens of every request
C = 4                                 # requests at once, in steps 2 and 3
sweep_c = P.pick(quick=[1, 2, 4, 5, 6, 8], full=[1, 4, 8, 9, 10, 12, 16])  # steps 4 and 5
P3 = dataclasses.replace(P, engine_args={k: v for k, v in P.engine_args.items() if k != "num_kv_blocks"})
llm = lab.engine_for(P3, kv_cache_memory=KV_BUDGET, enable_prefix_caching=False,
                     warm_prompts=[SHORT, LONG, C * LONG], warm_batches=sweep_c)
tok = llm.get_tokenizer()
lab02 = lab.load_baseline("02")

# %%
# needs the engine: the engine's configuration (model shape, KV pool, seats)
eng = llm.llm_engine
mc = eng.model_config
spec = eng.kv_spec
BS, BLOCKS = spec.block_size, spec.num_blocks
SEATS = eng.config.max_num_seqs
print(P3.describe())
print(f"model {eng.config.model}: {mc.num_layers} layers, {mc.num_heads} attention heads, "
      f"{mc.num_kv_heads} KV heads, head_dim {mc.head_dim}, KV in {eng.config.dtype}")
print(f"KV budget {KV_BUDGET}: {BLOCKS} blocks of {BS} tokens = {spec.max_tokens} token slots; "
      f"max_num_seqs = {SEATS}")

# %% [markdown]
# ### How many bytes is one token?
#
# For every token, every layer stores one key vector and one value vector per **KV head**, each of
# `head_dim` numbers. Models with grouped-query attention have fewer KV heads than attention heads:
# several query heads share one key/value head, and the cache shrinks by that factor.
#
# **Exercise 1.** Using the numbers printed above, how many bytes of KV cache does one token take in
# this engine? (`KV in float32` means 4 bytes per number.)

# %%
bytes_per_token = None  # your answer, in bytes

# %%
# needs the engine: the engine's K and V tensors (exercise 1)
alloc = lab.kv_allocation(llm)
q1 = ex.q1_bytes_per_token(alloc, mc.num_heads)
q1.check(bytes_per_token)
# q1.hint()
# q1.solution()

# %% [markdown]
# The formula is a first-order estimate, and the engine's real allocation is what counts. The
# model runner allocated one K and one V tensor per layer, each `[blocks, block_size, kv_heads,
# head_dim]`; their sizes, added up:

# %%
# needs the engine: the engine's K and V tensors (exercise 1)
expected = alloc["num_blocks"] * alloc["block_size"] * alloc["formula_bytes_per_token"]
check = pd.DataFrame({
    "bytes": [alloc["formula_bytes_per_token"], alloc["bytes_per_token"], expected,
              alloc["tensor_bytes"], parse_bytes(KV_BUDGET)],
}, index=["formula: 2 x layers x kv_heads x head_dim x bytes", "engine.kv_spec.bytes_per_token",
          "blocks x block_size x formula", "K and V tensors allocated (runner.kv_caches)",
          f"kv_cache_memory = {KV_BUDGET}"])
display(check)
left, per_block = parse_bytes(KV_BUDGET) - expected, alloc["block_size"] * alloc["formula_bytes_per_token"]
formula_lesson = lab.lesson(
    "03-kv-formula", "the engine's K and V tensors take exactly what the formula says: blocks x "
    "block_size x bytes per token, and the budget is cut into whole blocks",
    shown=alloc["tensor_bytes"] == expected and 0 <= left < per_block,
    evidence=f"{alloc['num_blocks']} x {alloc['block_size']} x {alloc['formula_bytes_per_token']:,} = "
             f"{expected:,} bytes by the formula, {alloc['tensor_bytes']:,} bytes allocated; {left:,} "
             f"bytes of the {KV_BUDGET} budget left over, against {per_block:,} for one more block")

# %% [markdown]
# ## Step 2. A few short prompts: watch the KV usage
#
# Four requests at once, each with a short prompt and the same answer length. **What to look for:**
# in the live figure's right panel, KV usage climbs in steps as the answers grow (a request takes a
# new block every `block_size` tokens) and drops to zero when they finish.

# %%
short_run = lab.run_workload(llm, lab.make_requests(tok, SHORT, OUT, num_requests=C, seed=1),
                             name=f"step 2: {C} x ({SHORT} prompt + {OUT} output tokens)")

# %%
print(f"Peak KV usage of step 2: {short_run.state.kv_cache_usage.max():.0%} of the KV cache.")

# %%
# needs the engine: its KV pool size in blocks (step 2's peak, in blocks)
short_peak = int(round(short_run.steps.kv_cache_usage.max() * BLOCKS))
print(f"{C} short requests held at most {short_peak} of {BLOCKS} blocks "
      f"({short_peak / BLOCKS:.0%} of the KV cache).")

# %% [markdown]
# ## Step 3. Longer prompts, same concurrency
#
# Again four requests at once, with the same answer length; only the prompts are longer. Before
# running it, predict.
#
# **Exercise 2.** How many KV blocks will the four long-prompt requests hold at most, at the same
# time? Each has a prompt of `LONG` tokens and an answer of `OUT` tokens; blocks hold `BS` tokens.

# %%
# needs the engine: its block size and KV pool (exercise 2)
print(f"LONG = {LONG}, OUT = {OUT}, BS = {BS}, C = {C}")
peak_blocks = None  # your answer: a number of blocks

# %%
long_reqs = lab.make_requests(tok, LONG, OUT, num_requests=C, seed=C,
                              labels=[f"request {i}" for i in range(C)])
long_run = lab.run_workload(llm, long_reqs, name=f"step 3: {C} x ({LONG} prompt + {OUT} output tokens)")

# %%
print(f"Peak KV usage of step 3: {long_run.state.kv_cache_usage.max():.0%} of the KV cache "
      f"(step 2: {short_run.state.kv_cache_usage.max():.0%}), with the same {C} requests at once.")

# %%
# needs the engine: its KV pool size in blocks (exercise 2)
long_peak = int(round(long_run.steps.kv_cache_usage.max() * BLOCKS))
q2 = ex.q2_peak_blocks(C, LONG, OUT, BS, long_peak, BLOCKS)
q2.check(peak_blocks)
# q2.hint()
# q2.solution()
print(f"Short prompts: {short_peak} blocks at most; long prompts: {long_peak} blocks "
      f"({long_peak / BLOCKS:.0%} of the cache), with the same {C} requests at once.")

# %% [markdown]
# ## Planning: how many such requests fit?
#
# Before raising the concurrency, a plan. [`minserve.plan`](../minserve/plan/planner.py) computes a
# serving budget from the model's shape: weights, KV bytes per token, and how many sequences of a
# given length fit in a KV budget, in whole blocks as the engine allocates them.
#
# **Exercise 3.** How many sequences of `LONG + OUT` tokens fit at once in the `KV_BUDGET`? Work it
# out by hand first (bytes per token from Exercise 1; `KV_BUDGET` in bytes is printed below), then
# the check compares with the planner.

# %%
CONTEXT = LONG + OUT
print(f"KV_BUDGET = {KV_BUDGET} = {parse_bytes(KV_BUDGET):,} bytes; "
      f"a sequence of {LONG} + {OUT} = {CONTEXT} tokens; blocks of "
      f"{plan(P.model, hardware='this', kv_cache_memory=KV_BUDGET, context_len=CONTEXT).block_size} tokens")
planned_seqs = None  # your answer: a number of sequences

# %%
p = plan(P.model, hardware="this", kv_cache_memory=KV_BUDGET, context_len=CONTEXT)
q3 = ex.q3_planned_capacity(p, parse_bytes(KV_BUDGET))
q3.check(planned_seqs)
# q3.hint()
# q3.solution()

# %%
p.frame().loc[["KV per token", "KV budget", "KV blocks", f"max seqs at {CONTEXT:,} tokens"]]

# %% [markdown]
# ### The planner, and the roofline
#
# `plan(...)` ([`plan/planner.py`](../minserve/plan/planner.py), formulas in
# [`plan/budget.py`](../minserve/plan/budget.py)) answers the questions to settle before any load
# test: do the weights fit, how many sequences of a given length fit beside them, and how fast can
# a prefill or a decode step be *at best* on the hardware. The same table is on the command line,
# for this machine or for a GPU you do not have:
#
# ```
# minserve plan --model smollm2-135m --hardware h100 --precision bf16 --context-len 4096
# minserve plan --list-hardware
# ```
#
# (`--hardware this`, the default, is this machine: its memory bandwidth and matmul rate measured
# once and cached.)
#
# Its speed estimate is a **roofline**. A step cannot take less time than reading its bytes from
# memory (bytes / bandwidth), nor less than doing its arithmetic (FLOPs / matmul rate); the
# estimate is the larger of the two, and the step is called **memory-bound** or **compute-bound**
# after whichever it is. A decode step reads every weight of the model to produce one token per
# request: with a single request there is little arithmetic per byte read, so the reading sets the
# time. A prefill does a whole prompt's arithmetic on the same bytes, so the arithmetic can take
# over. Adding requests to a decode step adds arithmetic but reads the weights only once, which is
# why batching pays until the step turns compute-bound. (Lab 06 builds on this.)
#
# A roofline is a bound, not a prediction: a real step also pays for Python, for starting its
# kernels and for threads that do not share the work perfectly, so it takes longer, and on a
# laptop CPU the gap grows with the batch (lab 01 measured decode steps by batch size).

# %%
display(p.frame().loc[["hardware", "weights read per step", "prefill (1 prompt)", "decode, batch 1",
                       f"decode, batch {p.max_num_seqs}"]])
read_ms = 1000 * p.weight_bytes_per_step / p.bandwidth_bytes_per_s
print(f"On this machine as measured ({p.bandwidth_bytes_per_s / 1e9:.0f} GB/s, "
      f"{p.flops_per_s / 1e9:.0f} GFLOP/s in {p.dtype}), reading the weights once takes "
      f"{read_ms:.1f} ms. A decode step of one request is {p.decode_bound}-bound, at best "
      f"{1000 * p.decode_step_s:.1f} ms ({p.decode_tok_s:.0f} tokens/s); prefilling one "
      f"{CONTEXT}-token prompt is {p.prefill_bound}-bound, at best {1000 * p.prefill_s:.1f} ms."
      + (f" With {p.max_num_seqs} requests in the step, a decode step is {p.decode_bound_full}-bound, "
         f"at best {1000 * p.decode_step_s_full:.1f} ms for {p.max_num_seqs} tokens."
         if p.decode_step_s_full else ""))

# %% [markdown]
# ## Steps 4 and 5. Raise the concurrency, and watch everything together
#
# Now the long-prompt requests, sent `c` at a time for a rising `c` (each run is one wave of `c`
# requests; the run with `c = 4` is step 3's). The engine has `max_num_seqs` seats to spare, so the
# only thing that can run short is the KV cache.
#
# **What to look for:** the scheduler admits a request when its *prompt* fits in the free blocks.
# Its answer then grows, a block at a time, and when no block is free, the newest running request is
# **preempted**: its blocks go back to the pool, it returns to the front of the queue, and later
# recomputes its prompt and what it had generated so far. Below the planned capacity, nothing of
# that happens; above it, the pool runs out as the answers grow: watch the preemptions, the waiting
# requests and the KV usage together. The live figure shows the heaviest run.

# %%
def wave(c):
    if c == C:
        return long_run  # step 3 was this very run
    reqs = lab.make_requests(tok, LONG, OUT, num_requests=c, seed=c,
                             labels=[f"request {i}" for i in range(c)])
    return lab.run_workload(llm, reqs, live=c == max(sweep_c),
                            name=f"c = {c}: {c} x ({LONG} + {OUT} tokens)")


runs = lab.run_sweep(sweep_c, wave, title="rising concurrency")

# %%
# needs the engine: its step records and request timelines (the pressure table)
table = lab.pressure_table(runs, BLOCKS)
table.round(2)

# %%
fig, axes = plt.subplots(1, len(runs), figsize=(2.3 * len(runs), 2.8), sharey=True,
                         layout="constrained")
for ax, (c, run) in zip(axes, runs.items()):
    st = run.state   # after each engine step in process; each /metrics sample over HTTP
    ax.plot(st.t_s, 100 * st.kv_cache_usage, color="tab:purple")
    preempted = st.num_preemptions.diff().fillna(st.num_preemptions) > 0
    for x in st.t_s[preempted]:
        ax.axvline(x, color="tab:red", lw=1)
    n = int(st.num_preemptions.max()) if len(st) else 0
    ax.set(title=f"c = {c}: {n} preemption{'s' if n != 1 else ''}", xlabel="time (s)", ylim=(0, 105))
axes[0].set_ylabel("KV blocks in use (%)")
fig.suptitle("KV usage over each run, by concurrency, and its preemptions (red lines)")
plt.show()

# %% [markdown]
# The usage is recorded after each step. In a step that preempts, the victim's blocks are back in
# the pool before the record is taken, so a run can preempt without ever *showing* 100 %: the pool
# was full only at the instant a growing request asked for one more block.

# %% [markdown]
# **Exercise 4.** From the table, what is the **measured** capacity: the largest number of these
# requests the engine ran at once from start to finish, with no request waiting and none preempted?
# Compare it with the planned capacity from Exercise 3.

# %%
# needs the engine: the pressure table (exercise 4)
measured_seqs = None  # your answer: a number of sequences

# %%
# needs the engine: the pressure table (exercise 4)
q4 = ex.q4_measured_capacity(table)
q4.check(measured_seqs)
# q4.hint()
# q4.solution()
print(f"Planned: {p.max_num_seqs} sequences of {CONTEXT} tokens; measured: "
      f"{ex.measured_capacity(table)} ran at once without waiting or preemption.")

# %%
# needs the engine: the pressure table (exercise 4)
measured = ex.measured_capacity(table)
plan_lesson = lab.lesson(
    "03-capacity-plan", "the capacity the engine showed matches the plan: as many sequences as "
    "whole blocks allow ran at once without waiting or preemption",
    shown=measured == p.max_num_seqs,
    evidence=f"planned {p.max_num_seqs} sequences of {CONTEXT} tokens ({p.num_kv_blocks} blocks, "
             f"{p.blocks_per_seq} per sequence), measured {measured}")
shown, why = ex.pressure_evidence(table, p.max_num_seqs)
pressure_lesson = lab.lesson(
    "03-preemption", "past the KV capacity the engine preempts or makes requests wait, and below "
    "it never does", shown=shown, evidence=why)

# %% [markdown]
# The heaviest run, request by request: grey is waiting (in the queue before admission, and again
# after a preemption), orange the prefill, purple a recompute after a preemption, red crosses the
# preemptions.

# %%
# needs the engine: the engine's request timelines
top = max(runs)
lab.request_timeline(runs[top], title=f"c = {top}: who waited, who was preempted, who recomputed")
plt.show()

# %% [markdown]
# **Exercise 5.** In the heaviest run, what held the requests back: the `"kv cache"`, the seats
# (`"max_num_seqs"`), or `"compute"`?

# %%
# needs the engine: the pressure table (exercise 5)
limited_by = None  # your answer: "kv cache", "max_num_seqs" or "compute"

# %%
# needs the engine: the pressure table (exercise 5)
q5 = ex.q5_what_limited(table, top, SEATS)
q5.check(limited_by)
# q5.hint()
# q5.solution()

# %% [markdown]
# ## Step 6. Record where latency gives way
#
# Latency grows with concurrency for two reasons. One is ordinary: a step with more requests costs
# more on this CPU, so everyone streams a little slower (lab 01). The other is what this lab is
# about: a request that has to wait for blocks, or is preempted and must recompute, takes *more
# steps* than it needs. Counting steps separates the two, and does not depend on how busy this
# machine is: a request nobody delays needs exactly one step per output token after its prefill
# (`lab.extra_steps` counts the steps beyond that).
#
# Our rule for "latency began to deteriorate materially": **the lowest concurrency at which the
# slowest request was held up for more than 10 % of the steps it needs alone.**

# %%
# needs the engine: the pressure table (step 6: extra steps per request)
concs = np.array(list(runs))
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.plot(concs, table["median E2E (s)"], "o-", color="tab:blue", label="median request")
ax.plot(concs, table["slowest E2E (s)"], "o-", color="tab:red", label="slowest request")
ax.set(xlabel="requests at once (concurrency)", ylabel="E2E latency (s)", ylim=(0, None),
       title="Past the KV capacity, the slowest request parts from the rest")
ax.axvline(p.max_num_seqs, color="grey", ls=":", label=f"planned capacity ({p.max_num_seqs})")
ax.legend(loc="upper left")
plt.show()

worst = pd.DataFrame({c: {"slowest E2E / median": table.loc[c, "slowest E2E (s)"] / table.loc[c, "median E2E (s)"],
                          "most extra steps": table.loc[c, "most extra steps"],
                          "preemptions": table.loc[c, "preemptions"],
                          "max waiting": table.loc[c, "max waiting"]} for c in runs}).T
display(worst.round(2))
gives_way = ex.deterioration_point(table, OUT)
if gives_way is None:
    print("No concurrency in this sweep held a request up by more than 10 % of its steps.")
else:
    row = table.loc[gives_way]
    print(f"Latency began to give way at c = {gives_way}: the slowest request needed "
          f"{int(row['most extra steps'])} extra steps (it needs about {OUT} alone), with "
          f"{int(row['preemptions'])} preemption(s) and at most {int(row['max waiting'])} request(s) "
          f"waiting, at a peak KV usage of {row['peak KV (%)']:.0f} %. Planned capacity: "
          f"{p.max_num_seqs}; measured: {ex.measured_capacity(table)}.")
above = [c for c in runs if c > p.max_num_seqs]
gives_way_lesson = lab.lesson(
    "03-gives-way", "latency gives way at the first concurrency past the planned capacity: from "
    "there the slowest request is held up for extra steps", shown=bool(above) and gives_way == min(above),
    evidence=(f"planned capacity {p.max_num_seqs}; the slowest request was first held up by more than "
              f"10 % of its steps at c = {gives_way}" if gives_way is not None else
              f"planned capacity {p.max_num_seqs}; no concurrency of the sweep held a request up by "
              "more than 10 % of its steps"))

# %% [markdown]
# ## Explore
#
# The panel runs `lab.run_experiment(...)`: requests of one prompt and output length, sent at a
# rate or a concurrency you choose, to an engine with the KV budget (in blocks) and seats you choose.
# The engine sliders start at this notebook's engine's settings (its `BLOCKS` KV blocks, its seats).
# Try the same concurrency with a budget of a few blocks more or less than this lab's, or with
# shorter answers: where do preemptions start? In CI no button is pressed, so the cell after it
# calls the function directly, on this notebook's engine.

# %%
panel = lab.control_panel(preset=P3, engine=llm, engine_args=dict(enable_prefix_caching=False),
                          num_requests=6, prompt_tokens=LONG, output_tokens=OUT)
panel

# %%
explore = lab.run_experiment(P3, num_requests=2, prompt_tokens=SHORT, output_tokens=8, live=False,
                             kv_cache_memory=KV_BUDGET, enable_prefix_caching=False)  # same engine
explore.percentiles()

# %% [markdown]
# ## Record your baseline

# %%
# needs the engine: the engine's records of steps 1 to 6 (the baseline)
baseline = {
    "kv_budget": KV_BUDGET,
    "kv_blocks": BLOCKS,
    "block_size": BS,
    "kv_bytes_per_token": alloc["bytes_per_token"],
    "kv_tensor_bytes": alloc["tensor_bytes"],
    "short_prompt_peak_blocks": short_peak,
    "long_prompt_peak_blocks": long_peak,
    "context_tokens": CONTEXT,
    "planned_capacity": p.max_num_seqs,
    "measured_capacity": ex.measured_capacity(table),
    "latency_gives_way_at_concurrency": gives_way,
    "sweep": {str(c): {k: round(float(v), 3) for k, v in r.items()} for c, r in table.iterrows()},
}
baseline_path = lab.record_baseline("03", baseline)
if lab02:
    knee02 = lab02.get("knee_req_per_s")
    limit = ex.what_limited(table.loc[top], SEATS)
    print(f"\nIn lab 02 the engine had {lab02['seats']} seats and plenty of KV cache: queueing "
          f"began when the seats were full" + (f" (knee at {knee02} requests/s)" if knee02 else "")
          + f". Here it had {SEATS} seats, and at c = {top} what held requests back was: {limit}; "
          f"{ex.measured_capacity(table)} sequences of {CONTEXT} tokens ran at once untroubled.")

# %% [markdown]
# ## Summary
#
# What to take from this lab (whether this run showed each point is in its "Lesson" lines above,
# and in the last cell):
#
# - **KV bytes per token** = 2 x layers x KV heads x head_dim x bytes per number. The engine's
#   allocation matches it exactly, in whole blocks: budget // (bytes per token x block size).
# - KV usage grows with **prompt length**, with every **generated token**, and with the number of
#   requests running together. A budget that holds the weights and a few requests says nothing
#   about a few more.
# - **Planned capacity** counts whole blocks per sequence. Compare it with what the engine really ran
#   at once (Exercise 4): past that, it had to make requests wait or preempt them.
# - The planner's **roofline** bounds a step's time by its bytes read and its arithmetic, whichever
#   takes longer: a decode step of a few requests is memory-bound, so more requests in it cost
#   little until the arithmetic takes over.
# - The chain to follow: **workload shape → KV pressure → scheduling (waiting, preemption,
#   recompute) → latency**. Past the capacity, the slowest requests pay for everyone: they wait, or
#   lose their cache and compute it again.
#
# This run's numbers are in the cells above and in `labs/results/03.json`.
#
# ## Stretch goals
#
# - Send the step-4 requests at a steady rate instead of all at once (`request_rate=` in
#   `lab.run_workload`): requests that start at different times finish at different times, so the
#   cache need not be full of long sequences at once. Is the measured capacity higher?
# - Turn prefix caching back on and give the requests a shared prefix
#   (`lab.make_requests(..., prefixes=[...])`): shared blocks are stored once. How many more
#   requests fit? (Lab 04 is about this.)
# - Plan the same model on a GPU: `plan(P.model, hardware="h100", precision="bf16",
#   context_len=4096)`. How many 4096-token sequences fit beside the weights?
# - Read `Scheduler._reserve` and `Scheduler._preempt` in
#   [`engine/scheduler.py`](../minserve/engine/scheduler.py): why is the *newest* request the one
#   preempted?

# %% [markdown]
# ## This run

# %%
run_summary = lab.summary("03")   # run time, the machine's load, the lessons this run showed
