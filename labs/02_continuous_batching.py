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
# # Lab 02 — Continuous batching: sharing the engine, and where it saturates
#
# A serving engine rarely has one user. How it lets many requests share the model decides both how
# much work it gets through and how long each user waits. The simple way is **static batching**:
# gather a few requests, run them together until *every one* of them is done, then take the next
# few. minserve, like vLLM, batches **continuously** instead: it rebuilds the batch at every engine
# step, so a request that finishes gives its place to a waiting one at once.
#
# Batching is not free capacity, though. Once every place in the batch is taken, more load cannot
# make the engine go faster: it only makes requests wait. This lab finds that point on this machine.
#
# **Goals.** By the end you will have measured, on this machine:
#
# 1. static and continuous batching on the same mixed workload, with the same number of places in
#    the batch: how many engine steps each needed, and how many places static batching left empty;
# 2. three runs of rising load, as in the classic experiment: **A** one request at a time, **B**
#    moderate arrivals, **C** rising until requests queue;
# 3. the **knee** of the load curve: the offered load past which extra load becomes waiting time
#    instead of throughput, and which part of a request's life absorbs it.
#
# **Run time:** about 1 minute on a 2-core laptop CPU in the `quick` preset (the default), longer
# while other programs share the CPU. The `full` preset (`MINSERVE_LAB_PRESET=full`) uses 4 times
# the requests and the seats, and longer prompts and answers, sized for a GPU; its run time there
# has not been measured yet.
#
# **Prerequisites:** [Lab 01](01_prefill_vs_decode.ipynb) (prefill and decode, and how the cost of a
# decode step grows with the number of requests in it).
#
# **Source files:** [`engine/scheduler.py`](../minserve/engine/scheduler.py) (continuous batching:
# who runs in each step, and who waits), [`lab/capacity.py`](../minserve/lab/capacity.py) (the
# static-batching gate used for comparison, the mixed workload, the load table),
# [`bench/arrivals.py`](../minserve/bench/arrivals.py) (when each request arrives),
# [`lab/workload.py`](../minserve/lab/workload.py) (how a workload is run and recorded).

# %%
# Set-up check (the short form of `minserve doctor`): what this notebook runs on.
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from minserve import lab
from course import lab02 as ex
from minserve.workshop.doctor import format_checks, run_checks

t_lab = time.perf_counter()
P = lab.setup()
print(format_checks(run_checks(short=True), short=True))

# %% [markdown]
# ## 1. One engine with a few seats
#
# `max_num_seqs` is the number of requests the scheduler lets into the running batch at once: think
# of them as **seats**. In the `quick` preset the engine gets only a few, so that every seat is taken
# within seconds on a laptop CPU. A GPU server has hundreds, and reaches the same situation at a
# much higher load. Everything else is the preset's engine; prefix caching is off because the runs
# below send the same prompts again, and each run must pay for its own prefills.

# %%
SEATS = P.pick(quick=4, full=16)
llm = lab.engine_for(P, max_num_seqs=SEATS, enable_prefix_caching=False)
tok = llm.get_tokenizer()
cfg = llm.llm_engine.config
print(P.describe())
print(f"engine: max_num_seqs={cfg.max_num_seqs} seats, max_num_batched_tokens="
      f"{cfg.max_num_batched_tokens} tokens per step, {llm.llm_engine.kv_spec.num_blocks} KV blocks")
lab01 = lab.load_baseline("01")

# %% [markdown]
# ## 2. A mixed workload
#
# Real traffic mixes short and long answers: most questions get a sentence, a few get a page. The
# workload below draws each answer's length from such a mix (one request in five gets a long answer)
# and keeps the prompts short, so that this lab is about decoding together, not about prefill. The
# same requests, in the same order, are used in every run of this lab.
#
# **What to look for:** static batching takes the requests in groups of `SEATS`, in this order. Each
# group keeps the engine until its longest answer is done.

# %%
N = P.pick(quick=16, full=64)
LONGEST_PROMPT = P.pick(quick=32, full=128)
LONGEST_ANSWER = P.pick(quick=32, full=256)
reqs = lab.mixed_requests(tok, N, LONGEST_PROMPT, LONGEST_ANSWER, seed=0)
outs = [r.expected_output_len for r in reqs]
prompts = [r.prompt_len for r in reqs]
# Each static batch's prompts are prefilled in one step (Exercise 1 relies on it).
assert all(sum(prompts[i:i + SEATS]) <= cfg.max_num_batched_tokens for i in range(0, N, SEATS))

batch_of = [i // SEATS for i in range(N)]
fig, ax = plt.subplots(figsize=(9, 3.2))
ax.bar(range(N), outs, color=[plt.cm.tab10(b % 10) for b in batch_of])
for b in range(0, N, SEATS):
    longest = max(outs[b:b + SEATS])
    ax.hlines(longest, b - 0.4, min(b + SEATS, N) - 0.6, color="black", lw=1.5)
ax.set(xlabel="request (in arrival order; colour: its static batch)", ylabel="output tokens",
       title="Each static batch lasts as long as its longest answer (black line)")
plt.show()
print(f"{N} requests, {sum(outs)} output tokens in all: median answer {int(np.median(outs))} "
      f"tokens, longest {max(outs)}; prompts of {min(prompts)} to {max(prompts)} tokens.")

# %% [markdown]
# ## 3. Static and continuous batching
#
# Two runs of the same workload, all `N` requests sent at once, on the same engine with the same
# seats. Only the rule that lets a request in differs:
#
# | run | who may start a request, and when |
# | --- | --- |
# | static | a gate in front of the engine ([`StaticBatcher`](../minserve/lab/capacity.py)) lets the next `SEATS` requests in only when the engine is empty |
# | continuous | the engine's own scheduler: at every step, a free seat goes to the oldest waiting request |
#
# **What to look for:** in the live figure, the running count of the static run drops as short
# answers finish and jumps back only when the whole batch is done; the continuous run keeps every
# seat busy until the queue runs dry. In the timelines below, grey is time spent waiting for a seat.

# %%
static = lab.run_static(llm, reqs, SEATS, name="static batching")

# %%
continuous = lab.run_workload(llm, reqs, name="continuous batching")

# %%
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, layout="constrained")
lab.request_timeline(static, ax=ax1, title="static: a batch ends when its longest answer ends")
lab.request_timeline(continuous, ax=ax2, title="continuous: a free seat is refilled at the next step")
ax1.set_xlabel("")
plt.show()

# %% [markdown]
# The same story in one line per run: how many requests each engine step computed. A seat that
# computes nothing in a step is capacity thrown away.

# %%
s_use, c_use = lab.seat_use(static, SEATS), lab.seat_use(continuous, SEATS)
fig, ax = plt.subplots(figsize=(9, 3.2))
for run, colour in ((static, "tab:red"), (continuous, "tab:green")):
    t, busy = lab.running_over_time(run)
    ax.step(t, busy, where="post", color=colour, label=run.name)
ax.axhline(SEATS, color="grey", ls=":", lw=1, label=f"seats ({SEATS})")
ax.set(xlabel="time since the run started (s)", ylabel="requests computed in the step",
       ylim=(0, SEATS + 0.6), title="Static batching leaves seats empty; continuous refills them")
ax.legend(loc="lower left")
plt.show()

step_ms = {run.name: 1000 * run.steps.step_time_s.mean() for run in (static, continuous)}
for run, use in ((static, s_use), (continuous, c_use)):
    ttft = run.requests.ttft_s
    print(f"{run.name}: {use['steps']} steps, {run.duration_s:.1f} s, "
          f"{run.summary['output_throughput']:.0f} output tokens/s; TTFT mean "
          f"{1000 * ttft.mean():.0f} ms, p90 {1000 * ttft.quantile(0.9):.0f} ms.")
print(f"Continuous batching needed {c_use['steps'] / s_use['steps']:.0%} of the static run's steps "
      f"and {continuous.duration_s / static.duration_s:.0%} of its time: a step averaged "
      f"{step_ms['continuous batching']:.0f} ms with full seats against "
      f"{step_ms['static batching']:.0f} ms in the static run, where steps often carried fewer "
      "requests.")

# %% [markdown]
# The step counts are exact: they would be the same on any machine. How much of the saving shows
# up as time depends on how much more a step with more requests costs on this hardware (lab 01
# measured it; the step times printed above show it for this run). On a GPU, where a decode step
# costs about the same for one request as for dozens, time follows the step count closely; on a
# busy laptop CPU much less so.
#
# **Exercise 1.** How many engine steps did the static run need? Work it out from the output lengths
# `outs` (in arrival order, batches of `SEATS`) and the rule from lab 00: an answer of *n* tokens
# takes *n* steps when its prompt fits in one step. The check counts the steps in the run's records.

# %%
print(f"outs = {outs}; SEATS = {SEATS}")
static_steps = None  # your answer: a number of steps

# %%
q1 = ex.q1_static_steps(outs, SEATS, s_use["steps"])
q1.check(static_steps)
# q1.hint()
# q1.solution()

# %% [markdown]
# **Exercise 2.** The static run had `SEATS` seats in each of its steps: `SEATS x steps`
# seat-steps in all. Each request used one seat for as many steps as it has output tokens. What
# fraction of the seat-steps did the static run leave **empty**? (A number between 0 and 1.)

# %%
empty_share = None  # your answer: a fraction between 0 and 1

# %%
q2 = ex.q2_empty_seats(static, continuous, SEATS, outs)
q2.check(empty_share)
# q2.hint()
# q2.solution()

# %% [markdown]
# ## 4. Raising the load: runs A, B and C
#
# So far every request arrived at once. A service sees requests arrive over time, and the question
# becomes: *how much load can it take before users notice?* Three runs answer it, on the same
# requests and the same engine; only the arrival pattern changes.
#
# | run | traffic | what it tells |
# | --- | --- | --- |
# | A | one request at a time: the next is sent when the previous one is done | the latency of a request that never shares the engine, and the throughput of a one-at-a-time server |
# | B | requests arriving at a moderate, steady rate | whether throughput improves with sharing, and what sharing costs each request |
# | C | the same arrivals at rising rates, until requests queue | where extra load stops producing throughput and turns into waiting |
#
# The rates of B and C are set from measurements. The continuous run above had every request sent
# at once, so it always had work waiting: its throughput is about the most this engine can do with
# this workload (its **capacity**). B offers a rate between what A manages one at a time and that
# capacity (their geometric mean): more than a one-at-a-time server could keep up with, less than
# the engine's limit. Arrivals come at fixed intervals (`burstiness=inf`), so that two runs differ
# only in their rate.
#
# **What to look for:** A's requests never wait and never share a step. B's requests overlap and
# share steps: compare what that costs each user (TPOT, their streaming speed) with what it gains
# the engine (requests and tokens per second).

# %%
A = lab.run_workload(llm, reqs, max_concurrency=1, name="A: one request at a time")

# %%
CAPACITY = continuous.summary["request_throughput"]  # req/s with work always waiting
rate_A = A.summary["request_throughput"]               # req/s one at a time
rate_B = round(math.sqrt(rate_A * CAPACITY), 2)
B = lab.run_workload(llm, reqs, request_rate=rate_B, burstiness=math.inf,
                     name=f"B: {rate_B} requests/s at fixed intervals")


# %%
def row(run):
    k = run.key_numbers()
    return {"requests/s": run.summary["request_throughput"], "output tokens/s": k["output_tok_per_s"],
            "median TTFT (ms)": k["median_ttft_ms"], "median TPOT (ms)": k["median_tpot_ms"],
            "p90 E2E (ms)": k["p90_e2e_ms"]}

ab = pd.DataFrame({"A: one at a time": row(A), "B: moderate arrivals": row(B)}).T
display(ab.round(1))
a_rate, b_rate = ab["requests/s"]
print(f"Capacity with every request sent at once: {CAPACITY:.2f} requests/s. One at a time (A), "
      f"the engine served {a_rate:.2f} requests/s; B offered {rate_B:.2f} and served {b_rate:.2f} "
      f"({b_rate / a_rate:.1f}x A's rate), while the median TPOT went from "
      f"{ab['median TPOT (ms)'].iloc[0]:.0f} to {ab['median TPOT (ms)'].iloc[1]:.0f} ms.")

# %% [markdown]
# ### Run C: rising until requests queue
#
# Now the same arrivals, faster and faster: from B's rate to two and a half times the capacity
# measured above, each rate about the same factor above the last (B is the first point). For each
# rate, the **achieved** throughput (requests finished per second over the whole run) is set against
# the **offered** one, and the time requests spent in the queue (arrival to admission) against the
# offered load.
#
# **What to look for:** while the engine keeps up, achieved throughput equals the offered load (the
# points sit on the diagonal) and nobody queues. Past some load, the points leave the diagonal and
# queue time shoots up: the seats are full, and extra requests can only wait. (This machine may be
# shared: a point far off the trend of its neighbours was usually slowed down by other programs;
# rerun the cell to see.)

# %%
POINTS = P.pick(quick=4, full=6)  # rates after B's
top = 2.5 * CAPACITY
rates = [round(rate_B * (top / rate_B) ** (k / POINTS), 2) for k in range(1, POINTS + 1)]


def run_at(rate):
    return lab.run_workload(llm, reqs, request_rate=rate, burstiness=math.inf, live=False,
                            name=f"C: {rate} requests/s")


sweep = {rate_B: B, **lab.run_sweep(rates, run_at, title="C: rising load")}
table = lab.load_table(sweep)
# This machine is shared, and its speed moves: if the engine kept up with every load this time
# (or fell short only at the heaviest), go higher, at most twice, so that the sweep always reaches
# past the knee (the rule of Exercise 3).
for _ in range(2):
    if ex.knee_rule(table)[1] < max(sweep):  # NaN (no knee yet) compares False
        break
    extra = round(1.6 * max(sweep), 2)
    sweep[extra] = run_at(extra)
    table = lab.load_table(sweep)
table.round(2)

# %%
offered = table.index.to_numpy(float)
fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(offered, table["achieved req/s"], "o-", color="tab:green", label="achieved")
ax.plot([0, offered.max()], [0, offered.max()], ls=":", color="grey", label="achieved = offered")
ax.plot([0, offered.max()], [0, 0.9 * offered.max()], ls="--", color="black", lw=1,
        label="90 % of offered")
ax.axhline(CAPACITY, color="tab:red", lw=1, ls="--", label="all sent at once (capacity estimate)")
ax.set(xlabel="offered load (requests/s)", ylabel="achieved throughput (requests/s)",
       xlim=(0, None), ylim=(0, None), title="Throughput follows the offered load, then stops")
ax.legend(loc="upper left")
plt.show()
best = table["achieved req/s"].max()
print(f"Achieved throughput levelled off at {best:.2f} requests/s; the all-at-once run gave "
      f"{CAPACITY:.2f}." + (" That estimate runs a little low: its last seconds drain the queue "
                            "with seats emptying one by one." if best > CAPACITY else ""))

# %%
fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(offered, table["p90 queue (ms)"], "o-", color="tab:red", label="p90 queue time")
ax.plot(offered, table["median queue (ms)"], "o-", color="tab:orange", label="median queue time")
ax.plot(offered, table["median TTFT (ms)"], "x--", color="tab:blue", label="median TTFT")
ax.set(xlabel="offered load (requests/s)", ylabel="ms", xlim=(0, None),
       title="Past the knee, extra load turns into waiting")
ax.legend(loc="upper left")
plt.show()

# %% [markdown]
# **Exercise 3.** Name the knee of this run. The rule we use: *the knee is the lowest offered load
# of which the engine achieved less than 90 %* (the first point under the dashed line of the
# throughput plot). Up to there, extra load came out as extra throughput; from there on, part of it
# stays behind in the queue, as the queue-time plot shows. Read it off the throughput plot, in
# requests per second (the x axis).

# %%
knee = None  # your answer: an offered load in requests/s

# %%
q3 = ex.q3_knee(table)
q3.check(knee)
# q3.hint()
# q3.solution()
prev, knee_rate = ex.knee_rule(table)
print(f"By the rule, this run's knee is at {knee_rate:.2f} requests/s "
      f"({knee_rate / CAPACITY:.1f}x the capacity measured with every request sent at once).")

# %% [markdown]
# **Exercise 4.** A request's E2E latency has three parts: `"queue"` (arrival to admission),
# `"prefill"` (admission to its first token) and `"decode"` (first token to last). From the lightest
# load (B) to the heaviest, which part's **share** of the E2E grew? (Shares, not seconds: on a shared
# machine a whole run can be slowed down by other programs, which stretches every part alike.)

# %%
light = sweep[min(sweep)].requests
heavy = sweep[max(sweep)].requests
display(ex.latency_shares(light, heavy).round(3))
where = None  # your answer: "queue", "prefill" or "decode"

# %%
q4 = ex.q4_where_it_goes(light, heavy, SEATS)
q4.check(where)
# q4.hint()
# q4.solution()

# %% [markdown]
# ## 5. Explore
#
# The panel runs `lab.run_mixed(...)`: the same mixed workload, built from the sliders (the prompt
# and output sliders set the *longest* prompt and answer of the mix), on an engine with the seats and
# KV budget you choose. Things to try: more seats (`max_num_seqs`), and then the request rate at
# which queueing starts; or a longer longest answer, which makes static batching waste more. For
# static batching, create the panel again with `batching="static"` added to `engine_args`.
# In CI no button is pressed, so the cell after it calls the function directly.

# %%
panel = lab.control_panel(run=lab.run_mixed, preset=P, engine_args=dict(enable_prefix_caching=False),
                          num_requests=N, prompt_tokens=LONGEST_PROMPT, output_tokens=LONGEST_ANSWER,
                          max_num_seqs=SEATS)
panel

# %%
explore = lab.run_mixed(P, batching="static", num_requests=SEATS, prompt_tokens=LONGEST_PROMPT,
                        output_tokens=16, max_num_seqs=SEATS, enable_prefix_caching=False,
                        live=False)  # the notebook's engine: same arguments
explore.percentiles()

# %% [markdown]
# ## 6. Record your baseline

# %%
baseline = {
    "seats": SEATS,
    "requests": N,
    "output_tokens": int(sum(outs)),
    "static": {"steps": s_use["steps"], "empty_seat_share": round(s_use["empty_share"], 3),
               **static.key_numbers()},
    "continuous": {"steps": c_use["steps"], "empty_seat_share": round(c_use["empty_share"], 3),
                   **continuous.key_numbers()},
    "capacity_req_per_s": round(CAPACITY, 3),
    "run_A": row(A),
    "run_B": row(B),
    "sweep": {f"{rate:g}": {k: round(float(v), 2) for k, v in r.items()} for rate, r in table.iterrows()},
    "knee_req_per_s": knee_rate,
}
baseline_path = lab.record_baseline("02", baseline)
if lab01:
    b4 = lab01["decode_tok_per_s_by_batch"].get(str(SEATS))
    if b4:
        print(f"\nLab 01 decoded {b4:.0f} tokens/s with {SEATS} requests in every step; continuous "
              f"batching sustained {continuous.summary['output_throughput']:.0f} output tokens/s here, "
              "prefills and the last half-empty steps included.")
print(f"This notebook ran in {time.perf_counter() - t_lab:.0f} s (preset {P.name!r}, {P.device}).")

# %% [markdown]
# ## Summary
#
# - **Static batching** keeps a batch together until its longest member is done. With answers of
#   mixed length, most seats sit empty for much of each batch, and requests in later batches wait for
#   all of it.
# - **Continuous batching** rebuilds the batch at every step: a finished request's seat goes to a
#   waiting one at once. Same work, fewer steps; on hardware where a step costs about the same
#   whatever the batch (a GPU), that is also proportionally less time.
# - **Load.** One request at a time (A) leaves the engine's batching unused; moderate arrivals (B)
#   share it, trading some speed per request for throughput; past the **knee** (C) the seats are
#   full, throughput stops growing, and extra load becomes queue time: latency keeps growing with
#   the load while throughput does not.
# - The extra latency past the knee is mostly *waiting*, not slower computing: look at queue time,
#   not only at TTFT.
#
# This run's numbers are in the cells above and in `labs/results/02.json`.
#
# ## Stretch goals
#
# - Rerun the sweep with Poisson arrivals (`burstiness=1`) instead of fixed intervals. At the same
#   average rate, does queueing start at a lower load? Why would bursts queue even below capacity?
# - Double the seats (`lab.engine_for(P, max_num_seqs=2 * SEATS, enable_prefix_caching=False)`) and
#   run A/B/C again. How far does the knee move, and does it move in proportion? (Lab 01's
#   decode tokens/s by batch size is a hint.)
# - Put the static gate in front of a server-like arrival process: `lab.run_static(llm, reqs, SEATS,
#   request_rate=rate_B, burstiness=math.inf)`. How does static batching's TTFT at B's rate compare
#   with continuous batching's?
# - Read `Scheduler.schedule` in [`engine/scheduler.py`](../minserve/engine/scheduler.py): where does
#   a finished request's seat become available to a waiting one?
