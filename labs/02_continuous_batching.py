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
#    the batch: how many engine steps each needed, how many places static batching left empty, and
#    how soon each gave requests their first token;
# 2. three runs of rising load, as in the classic experiment: **A** one request at a time, **B**
#    moderate arrivals, **C** rising until requests queue;
# 3. the **knee** of the load curve: the offered load past which extra load becomes waiting time
#    instead of throughput, and which part of a request's life absorbs it.
#
# Each headline result is checked on this run's own numbers: a line starting "Lesson shown" or
# "Lesson NOT shown in this run" follows the cell that measures it, and the last cell sums them up.
#
# **Run time** (`quick` preset, the default, on a 2-core laptop CPU): about 1.5 min on a quiet
# machine, up to 2 min on a busy one (measured: 1.3 and 1.5 min nearly quiet, 2.0 min with another
# program holding one of the two cores). The `full` preset (`MINSERVE_LAB_PRESET=full`) uses 4
# times the requests and the seats, and longer prompts and answers, sized for a GPU; its run time
# there has not been measured yet.
#
# **Against a server** (`MINSERVE_LAB_TARGET=http://host:port`, see the README's labs section):
# sections 2 and 4 (the workload; runs A, B and the load sweep C, exercise 3's knee) and the
# explore panel run over HTTP, on the server's own seats (its `max_num_seqs`; the lab asks for
# `SEATS` but cannot set it, and reads them from the server's `/metrics`), with queue times unknown
# to a client. The knee needs a server with fewer seats than the sweep's requests (32 in `quick`):
# start it with `--max-num-seqs 4` (vLLM's default of hundreds never makes a request wait, and the
# lab then says it found no knee). Section 3 (static batching's
# gate, step records, exercises 1 and 2) and exercise 4 (queue and prefill times) need the
# engine in this notebook, and are skipped with one line each.
#
# **Prerequisites:** [Lab 01](01_prefill_vs_decode.ipynb) (prefill and decode, and how the cost of a
# decode step grows with the number of requests in it).
#
# **Source files:** [`engine/scheduler.py`](../minserve/engine/scheduler.py) (continuous batching:
# who runs in each step, and who waits), [`lab/capacity.py`](../minserve/lab/capacity.py) (the
# static-batching gate used for comparison, the mixed workload, the achieved throughput and the
# load table), [`bench/arrivals.py`](../minserve/bench/arrivals.py) (when each request arrives),
# [`lab/workload.py`](../minserve/lab/workload.py) (how a workload is run and recorded),
# [`lab/hygiene.py`](../minserve/lab/hygiene.py) (warm-up and calibration), and this lab's
# exercises and rules in [`course/lab02.py`](course/lab02.py).

# %%
# Set-up check (the short form of `minserve doctor`): what this notebook runs on.
import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from minserve import lab
from course import lab02 as ex
from minserve.lab.capacity import achieved_rate
from minserve.workshop.doctor import format_checks, run_checks

P = lab.setup()  # also starts the clock and the load probe that lab.summary reports at the end
print(format_checks(run_checks(short=True), short=True))

# %% [markdown]
# ## 1. One engine with a few seats
#
# `max_num_seqs` is the number of requests the scheduler lets into the running batch at once: think
# of them as **seats**. In the `quick` preset the engine gets only a few, so that every seat is taken
# within seconds on a laptop CPU. A GPU server has hundreds, and reaches the same situation at a
# much higher load. Everything else is the preset's engine; prefix caching is off because the runs
# below send the same prompts again, and each run must pay for its own prefills.
#
# A fresh engine is slow the first time it meets a shape (a prompt length, a batch size), so the
# engine is warmed up on the shapes this lab measures before anything is timed: a lone prompt, the
# prompts of a whole static batch prefilled in one step, and decode steps of every batch size from
# one request to `SEATS`.

# %%
SEATS = P.pick(quick=4, full=16)
N = P.pick(quick=16, full=64, smoke=8)        # requests of the mixed workload
LONGEST_PROMPT = P.pick(quick=32, full=128)
LONGEST_ANSWER = P.pick(quick=32, full=256, smoke=16)
llm = lab.engine_for(P, max_num_seqs=SEATS, enable_prefix_caching=False,
                     warm_prompts=[LONGEST_PROMPT, SEATS * LONGEST_PROMPT],
                     warm_batches=range(1, SEATS + 1))
tok = llm.get_tokenizer()
print(P.describe())
lab01 = lab.load_baseline("01")

# %%
# needs the engine: the engine's configuration (seats, step budget, KV pool)
cfg = llm.llm_engine.config
print(f"engine: max_num_seqs={cfg.max_num_seqs} seats, max_num_batched_tokens="
      f"{cfg.max_num_batched_tokens} tokens per step, {llm.llm_engine.kv_spec.num_blocks} KV blocks")

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
reqs = lab.mixed_requests(tok, N, LONGEST_PROMPT, LONGEST_ANSWER, seed=0)
outs = [r.expected_output_len for r in reqs]
prompts = [r.prompt_len for r in reqs]
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

# %%
# needs the engine: the engine's configuration (its step budget)
# Each static batch's prompts are prefilled in one step (Exercise 1 relies on it).
assert all(sum(prompts[i:i + SEATS]) <= cfg.max_num_batched_tokens for i in range(0, N, SEATS))

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
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
static = lab.run_static(llm, reqs, SEATS, name="static batching")

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
continuous = lab.run_workload(llm, reqs, name="continuous batching")

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, layout="constrained")
lab.request_timeline(static, ax=ax1, title="static: a batch ends when its longest answer ends")
lab.request_timeline(continuous, ax=ax2, title="continuous: a free seat is refilled at the next step")
ax1.set_xlabel("")
plt.show()

# %% [markdown]
# The same story in one line per run: how many requests each engine step computed. A seat that
# computes nothing in a step is capacity thrown away.

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
s_use, c_use = lab.seat_use(static, SEATS), lab.seat_use(continuous, SEATS)
fewer_empty = c_use["empty_share"] < s_use["empty_share"]
fig, ax = plt.subplots(figsize=(9, 3.2))
for run, colour in ((static, "tab:red"), (continuous, "tab:green")):
    t, busy = lab.running_over_time(run)
    ax.step(t, busy, where="post", color=colour, label=run.name)
ax.axhline(SEATS, color="grey", ls=":", lw=1, label=f"seats ({SEATS})")
ax.set(xlabel="time since the run started (s)", ylabel="requests computed in the step",
       ylim=(0, SEATS + 0.6),
       title="Static batching leaves seats empty; continuous refills them" if fewer_empty
       else "Which run leaves seats empty?")
ax.legend(loc="lower left")
plt.show()

# %% [markdown]
# **Exercise 1.** How many engine steps did the static run need? Work it out from the output lengths
# `outs` (in arrival order, batches of `SEATS`) and the rule from lab 00: an answer of *n* tokens
# takes *n* steps when its prompt fits in one step. The check counts the steps in the run's records.

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
print(f"outs = {outs}; SEATS = {SEATS}")
static_steps = None  # your answer: a number of steps

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
q1 = ex.q1_static_steps(outs, SEATS, s_use["steps"])
q1.check(static_steps)
# q1.hint()
# q1.solution()

# %% [markdown]
# **Exercise 2.** The static run had `SEATS` seats in each of its steps: `SEATS x steps`
# seat-steps in all. Each request used one seat for as many steps as it has output tokens. What
# fraction of the seat-steps did the static run leave **empty**? (A number between 0 and 1.)

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
empty_share = None  # your answer: a fraction between 0 and 1

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
q2 = ex.q2_empty_seats(static, continuous, SEATS, outs)
q2.check(empty_share)
# q2.hint()
# q2.solution()

# %% [markdown]
# ### What the two runs did with their steps
#
# The step counts are exact: they would be the same on any machine, busy or not.

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
step_ms = {run.name: 1000 * run.steps.step_time_s.mean() for run in (static, continuous)}
per_step = {run.name: float(run.steps.batch.mean()) for run in (static, continuous)}
for run, use in ((static, s_use), (continuous, c_use)):
    print(f"{run.name}: {use['steps']} steps of {per_step[run.name]:.1f} requests on average, "
          f"{step_ms[run.name]:.0f} ms per step, {run.duration_s:.2f} s in all, "
          f"{use['empty_share']:.0%} of its seat-steps empty.")
steps_lesson = lab.lesson(
    "02-fewer-steps", "continuous batching did the same work in fewer engine steps than static "
    "batching, and left fewer seats empty",
    shown=c_use["steps"] < s_use["steps"] and fewer_empty,
    evidence=f"{c_use['steps']} steps against {s_use['steps']} ({c_use['steps'] / s_use['steps']:.0%}), "
             f"{c_use['empty_share']:.0%} of the seat-steps empty against {s_use['empty_share']:.0%}")

# %% [markdown]
# How much of the saving in steps shows up as *time* depends on how much more a step with more
# requests costs on this hardware (lab 01 measured it; the step times printed above show it for
# these two runs). On a GPU, where a decode step costs about the same for one request as for
# dozens, time follows the step count closely; on a laptop CPU much less so.
#
# What a user notices first is the wait for the first token. Under static batching a request waits
# for every batch ahead of it to finish its *longest* answer; under continuous batching it waits
# only for the first seat to free up. One pair of runs is one moment of a shared machine, so two
# more pairs are run below, the two sides alternating, and the lesson is judged on the median.

# %%
# needs the engine: a static-batching gate in front of the engine, and its step records (section 3)
with lab.LoadProbe() as pairs_probe:
    pairs = [(static, continuous)] + ex.alternate(llm, reqs, SEATS, repeats=2)
pairs_table = ex.batching_table(pairs)
display(pairs_table.round(2))
sooner, sooner_why = ex.sooner_evidence(pairs_table)
sooner_lesson = lab.lesson(
    "02-sooner", "continuous batching gave the same requests their first token sooner than static "
    "batching", shown=sooner, evidence=sooner_why,
    load=ex.busiest([run for pair in pairs for run in pair] + [pairs_probe]))

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
# These runs send the workload of section 2 twice over (the same `N` requests, then the same
# again): a run must last long enough, compared with one request, to show a steady state.
#
# **Throughput, measured while requests arrive.** A run of requests offered at a rate ends with a
# *drain*: after the last arrival the engine only finishes what it already has, its seats emptying
# one by one. "Finished requests / run time", the number benchmarks usually print, counts that
# drain, so even an engine that keeps up with every request seems to fall short of the load offered.
# This lab's **achieved** throughput is the rate at which requests got a seat while requests kept
# arriving ([`achieved_rate`](../minserve/lab/capacity.py)). In a steady state that *is* the
# throughput, since every request let in is a request finished later: while the engine keeps up,
# each request gets a seat as it arrives; once the seats are full, only when another one finishes.
#
# **Capacity.** With every request sent at once, work always waits for a seat, so the achieved
# throughput of such a run is about the most this engine can do with this workload: its
# **capacity**. Everything below is scaled from it, and a laptop CPU shared with other programs
# does not run at the same speed twice, so it is measured several times (`lab.calibrate`): the first
# run is dropped, and the lab scales from the median of the next ones and prints how far apart they
# were.

# %%
load_reqs = lab.make_requests(tok, prompts * 2, outs * 2, seed=0,
                              labels=[f"r{i:02d} ({o} out)" for i, o in enumerate(outs * 2)])


def seconds_per_request():
    """One all-at-once run: the time per request at full seats (1 / achieved throughput)."""
    run = lab.run_workload(llm, load_reqs, live=False, name="capacity: every request at once")
    return 1 / achieved_rate(run)


cal = lab.calibrate(seconds_per_request, name="time per request, every seat busy", repeats=3,
                    max_runs=6, tolerance=0.2)
CAPACITY = 1 / cal.median   # requests per second with work always waiting
print(f"Capacity: {CAPACITY:.2f} requests/s (one request finished every {1000 * cal.median:.0f} ms "
      f"with all {SEATS} seats busy).")

# %% [markdown]
# B offers a rate between what A manages one at a time and the capacity (their geometric mean):
# more than a one-at-a-time server could keep up with, less than the engine's limit. Arrivals come
# at fixed intervals (`burstiness=inf`), so that two runs differ only in their rate.
#
# **What to look for:** A's requests never wait and never share a step. B's requests overlap and
# share steps: compare what that costs each user (TPOT, their streaming speed) with what it gains
# the engine (requests and tokens per second).

# %%
A = lab.run_workload(llm, load_reqs, max_concurrency=1, name="A: one request at a time")

# %%
rate_A = achieved_rate(A)                              # req/s one at a time
rate_B = round(math.sqrt(rate_A * CAPACITY), 2)
B = lab.run_workload(llm, load_reqs, request_rate=rate_B, burstiness=math.inf,
                     name=f"B: {rate_B} requests/s at fixed intervals")


# %%
def row(run):
    k = run.key_numbers()
    return {"requests/s": achieved_rate(run), "output tokens/s": k["output_tok_per_s"],
            "median TTFT (ms)": k["median_ttft_ms"], "median TPOT (ms)": k["median_tpot_ms"],
            "p90 E2E (ms)": k["p90_e2e_ms"]}


ab = pd.DataFrame({"A: one at a time": row(A), "B: moderate arrivals": row(B)}).T
display(ab.round(1))
a_rate, b_rate = ab["requests/s"]
tpot_a, tpot_b = ab["median TPOT (ms)"]
print(f"Capacity with every request sent at once: {CAPACITY:.2f} requests/s. One at a time (A), "
      f"the engine served {a_rate:.2f} requests/s; B offered {rate_B:.2f} and achieved {b_rate:.2f} "
      f"({b_rate / a_rate:.1f}x A's rate), while the median TPOT went from {tpot_a:.0f} to "
      f"{tpot_b:.0f} ms ({tpot_b / tpot_a:.1f}x).")

# %% [markdown]
# ### Run C: rising until requests queue
#
# Now the same arrivals, faster and faster: B's rate, then loads from below the capacity measured
# above to more than twice it. For each load, the **achieved** throughput is set against the
# **offered** one, and the time requests spent in the queue (arrival to admission) against the
# offered load.
#
# **What to look for:** while the engine keeps up, achieved throughput equals the offered load (the
# points sit on the diagonal) and nobody queues. Past some load, the points leave the diagonal and
# queue time shoots up: the seats are full, and extra requests can only wait.
#
# The speed of a shared machine moves, between the calibration and the sweep and within it. So the
# cell checks its own results ([`settle_sweep`](course/lab02.py)): a load whose result its
# neighbours contradict (the engine fell short of it but kept up with a heavier one) is run again,
# and if the lightest load already fell short, or the heaviest did not, a lighter or a heavier load
# is added, so that the sweep brackets the knee. It prints what it did.

# %%
rates = ex.sweep_rates(rate_B, CAPACITY)


def run_at(rate):
    return lab.run_workload(llm, load_reqs, request_rate=rate, burstiness=math.inf, live=False,
                            name=f"C: {rate} requests/s")


with lab.LoadProbe() as sweep_probe:
    sweep = {rate_B: B, **lab.run_sweep(rates, run_at, title="C: rising load")}
    sweep, sweep_notes = ex.settle_sweep(sweep, run_at)
for note in sweep_notes:
    print(f"Note: {note}.")
table = lab.load_table(sweep)
table.round(2)

# %%
knee_shown, knee_why = ex.knee_evidence(table)
offered = table.index.to_numpy(float)
fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(offered, table["achieved req/s"], "o-", color="tab:green", label="achieved")
ax.plot([0, offered.max()], [0, offered.max()], ls=":", color="grey", label="achieved = offered")
ax.plot([0, offered.max()], [0, 0.9 * offered.max()], ls="--", color="black", lw=1,
        label="90 % of offered")
ax.axhline(CAPACITY, color="tab:red", lw=1, ls="--", label="capacity (all sent at once)")
ax.set(xlabel="offered load (requests/s)", ylabel="achieved throughput (requests/s)",
       xlim=(0, None), ylim=(0, None),
       title="Throughput follows the offered load, then levels off" if knee_shown
       else "Does throughput follow the offered load, and where does it stop?")
ax.legend(loc="upper left")
plt.show()
light_load = float(offered.min())
whole = float(table.loc[light_load, "whole-run req/s"])
waited_ms = table.loc[light_load, "median queue (ms)"]   # unknown over HTTP: a client sees no admission
print(f"At the lightest load, {light_load:.2f} requests/s, the median request waited "
      + (f"{waited_ms:.1f} ms" if np.isfinite(waited_ms) else "an unknown time (not visible over HTTP)")
      + f" for a seat and the engine achieved "
      f"{table.loc[light_load, 'achieved req/s']:.2f} requests/s. Counted as finished requests over the "
      f"whole run, drain included, the same run reads {whole:.2f} requests/s "
      f"({whole / light_load:.0%} of the load offered).")

# %%
queue_grew = table["median queue (ms)"].iloc[-1] > 10 * max(1.0, table["median queue (ms)"].iloc[0])
fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(offered, table["p90 queue (ms)"], "o-", color="tab:red", label="p90 queue time")
ax.plot(offered, table["median queue (ms)"], "o-", color="tab:orange", label="median queue time")
ax.plot(offered, table["median TTFT (ms)"], "x--", color="tab:blue", label="median TTFT")
ax.set(xlabel="offered load (requests/s)", ylabel="ms", xlim=(0, None),
       title="With more load, requests wait longer for a seat" if queue_grew
       else "Do requests wait longer for a seat as the load grows?")
ax.legend(loc="upper left")
plt.show()

# %% [markdown]
# **Exercise 3.** Name the knee of this run. The rule we use: *the knee is the lowest offered load
# of which the engine achieved less than 90 %* (the first point under the dashed line of the
# throughput plot). Up to there, extra load came out as extra throughput; from there on, part of it
# stays behind in the queue (achieved falls behind offered exactly when the queue builds up). Read
# it off the throughput plot, in requests per second: an *offered* load, on the x axis.

# %%
knee = None  # your answer: an offered load in requests/s

# %%
q3 = ex.q3_knee(table, CAPACITY)
q3.check(knee)
# q3.hint()
# q3.solution()
prev, knee_rate = ex.knee_rule(table)
if math.isnan(knee_rate):
    print("By the rule, this sweep has no knee: the engine kept up with every load offered.")
else:
    print(f"By the rule, this run's knee is at {knee_rate:.2f} requests/s "
          f"({knee_rate / CAPACITY:.2f}x the calibrated capacity), after {prev:.2f} requests/s, "
          "the last load the engine kept up with.")

# %%
knee_lesson = lab.lesson(
    "02-knee", "achieved throughput followed the offered load up to the knee and levelled off past it",
    shown=knee_shown, evidence=knee_why, load=ex.busiest(list(sweep.values()) + [sweep_probe]),
    calibration=cal, causes=ex.speed_causes(table, CAPACITY) + sweep_notes)

# %% [markdown]
# **Exercise 4.** A request's E2E latency has three parts: `"queue"` (arrival to admission),
# `"prefill"` (admission to its first token) and `"decode"` (first token to last). From the lightest
# load to the heaviest, which part's **share** of the E2E grew? (Shares, not seconds: on a shared
# machine a whole run can be slowed down by other programs, which stretches every part alike.)

# %%
# needs the engine: the engine's queue and prefill times (its request records)
light = sweep[min(sweep)].requests
heavy = sweep[max(sweep)].requests
shares = ex.latency_shares(light, heavy)
display(shares.round(3))
where = None  # your answer: "queue", "prefill" or "decode"

# %%
# needs the engine: the engine's queue and prefill times (its request records)
q4 = ex.q4_where_it_goes(light, heavy, SEATS)
q4.check(where)
# q4.hint()
# q4.solution()
queue_shown, queue_why = ex.queue_evidence(shares)
queue_lesson = lab.lesson(
    "02-queue", "past the knee, the extra latency was waiting for a seat: the queue's share of a "
    "request's life grew the most", shown=queue_shown, evidence=queue_why,
    load=ex.busiest([sweep[min(sweep)], sweep[max(sweep)]]))

# %% [markdown]
# ## 5. Explore
#
# The panel runs `lab.run_mixed(...)`: the same mixed workload, built from the sliders (the prompt
# and output sliders set the *longest* prompt and answer of the mix), on an engine with the seats and
# KV budget you choose; the engine sliders start at this notebook's engine's settings. Things to
# try: more seats (`max_num_seqs`), and then the request rate at which queueing starts; or a longer
# longest answer, which makes static batching waste more. For static batching, create the panel
# again with `batching="static"` added to `engine_args`. In CI no button is pressed, so the cell
# after it calls the function directly.

# %%
panel = lab.control_panel(run=lab.run_mixed, preset=P, engine=llm,
                          engine_args=dict(enable_prefix_caching=False),
                          num_requests=N, prompt_tokens=LONGEST_PROMPT, output_tokens=LONGEST_ANSWER)
panel

# %%
# needs the engine: a static-batching gate in front of the engine
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
    "capacity_req_per_s": round(CAPACITY, 3),
    "capacity_calibration": cal.as_dict(),
    "run_A": row(A),
    "run_B": row(B),
    "sweep": {f"{rate:g}": {k: round(float(v), 2) for k, v in r.items()} for rate, r in table.iterrows()},
    "knee_req_per_s": None if math.isnan(knee_rate) else knee_rate,
}

# %%
# needs the engine: the engine's records of section 3
baseline["static"] = {"steps": s_use["steps"], "empty_seat_share": round(s_use["empty_share"], 3),
                      **static.key_numbers()}
baseline["continuous"] = {"steps": c_use["steps"], "empty_seat_share": round(c_use["empty_share"], 3),
                          **continuous.key_numbers()}

# %%
baseline_path = lab.record_baseline("02", baseline)
if lab01 and "continuous" in baseline:   # section 3 ran (in process)
    b4 = lab01["decode_tok_per_s_by_batch"].get(str(SEATS))
    if b4:
        print(f"\nLab 01 decoded {b4:.0f} tokens/s with {SEATS} requests in every step; continuous "
              f"batching sustained {continuous.summary['output_throughput']:.0f} output tokens/s here, "
              "prefills and the last half-empty steps included.")

# %% [markdown]
# ## Summary
#
# What to take from this lab (whether this run showed each point is in its "Lesson" lines above,
# and in the last cell):
#
# - **Static batching** keeps a batch together until its longest member is done. With answers of
#   mixed length, many seats sit empty for much of each batch, and requests in later batches wait for
#   all of it.
# - **Continuous batching** rebuilds the batch at every step: a finished request's seat goes to a
#   waiting one at once. Same work, fewer steps; on hardware where a step costs about the same
#   whatever the batch (a GPU), that is also proportionally less time.
# - **Load.** One request at a time (A) leaves the engine's batching unused; moderate arrivals (B)
#   share it, trading some speed per request for throughput; past the **knee** (C) the seats are
#   full, throughput stops growing, and extra load becomes queue time.
# - **Measuring throughput.** Finished requests over the whole run include the drain at its end;
#   measure throughput while requests still arrive, and scale loads from a repeated calibration,
#   not from one run.
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

# %% [markdown]
# ## This run

# %%
run_summary = lab.summary("02")   # run time, the machine's load, the lessons this run showed
