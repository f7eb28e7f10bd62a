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
# # Lab 07 — Overload and goodput: what to do with more traffic than you can serve
#
# Continuous batching makes a server efficient, not infinite. Past a certain offered load (the
# *knee*) every extra request only waits. The server stays busy, but its answers arrive later and
# later, and at some point they arrive after the user stopped caring. What
# matters then is **goodput**: requests per second answered *within their service-level objective*
# (SLO). This lab pushes a real HTTP server past its knee, with and without admission control, and
# looks at what each request got back.
#
# **Goals.** By the end you will have:
#
# 1. measured throughput and goodput against offered load, and read off the knee;
# 2. seen what a bounded waiting room changes: refused requests get a `429` with `Retry-After` in
#    milliseconds instead of a long wait, and the requests let in still meet the SLO;
# 3. watched the server recover after a burst, with and without admission control;
# 4. predicted what the deadline model (`x-deadline-ms`) computes, and seen both ways a deadline ends
#    a request: shed at the door (`429`) or aborted in the queue (`504 deadline_exceeded`);
# 5. protected interactive traffic from a batch flood with per-class budgets (`x-priority-class`).
#
# **Run time:** about 1 minute on a quiet 2-core CPU in the `quick` preset (the default), up to 1.5
# minutes with one core taken by another process (measured on this project's 2-core machine: 0.8 to
# 1.1 min quiet, 1.0 to 1.5 min busy; `MINSERVE_LAB_CI=1` changes no size): a
# small server (4 seats), short prompts and answers, tens of requests per run. Every run is sized in
# units of the service time measured at the start, so a busy or a faster machine changes the run
# time, not the shape of the results; the last cell prints this run's time. The `full` preset
# (`MINSERVE_LAB_PRESET=full`) uses 16 seats, longer prompts and answers and longer runs, sized for
# a GPU box (not timed there yet).
#
# **Lessons, checked.** Each headline result (goodput below throughput past the knee, the bounded
# waiting room's goodput, recovery after a burst, the `504` path, per-class budgets) is checked on
# this run's own numbers right after the cell that measures it: the notebook prints "Lesson shown"
# with the evidence, or "Lesson NOT shown in this run" with the cause it measured (other processes'
# CPU use, the spread of the calibration, a change of the machine's speed) and how to get a clean run.
#
# **Against a server** (`MINSERVE_LAB_TARGET=http://host:port`, see the README's labs section):
# sections 1 and 2 (service time, the load sweep, exercises 1 and 2) and the explore panel (7) run
# against that server as it is, with its own seats and admission policy. Sections 3 to 6 compare
# admission policies, deadline models and class budgets on servers this notebook starts with each
# setting, which a client of a shared server cannot change: they are skipped with one line each.
#
# **Prerequisites:** [Lab 00](00_tour.ipynb) and [Lab 01](01_prefill_vs_decode.ipynb) (TTFT, TPOT,
# batching); the docs' [serving over HTTP](../docs/serving/index.md) page.
#
# **Source files:** [`server/admission.py`](../minserve/server/admission.py) (classification,
# per-class budgets, shedding), [`server/deadlines.py`](../minserve/server/deadlines.py) (the
# deadline model), [`server/async_engine.py`](../minserve/server/async_engine.py) (expiry after
# admission), [`server/app.py`](../minserve/server/app.py) (the life of a request),
# [`bench/metrics.py`](../minserve/bench/metrics.py) (goodput as `vllm bench serve` defines it),
# [`lab/local_server.py`](../minserve/lab/local_server.py) (the server in this notebook) and
# [`lab/traffic.py`](../minserve/lab/traffic.py) (the load, with headers, and what came back).

# %%
# Set-up check: what this notebook runs on (and quiet engine logs, shared figure style).
import math

import httpx
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import display

from minserve import lab
from minserve.lab import traffic as tr
from minserve.workshop.doctor import format_checks, run_checks
from course import lab07 as ex
from minserve.server import AdmissionConfig, ClassLimits

P = lab.setup()
print(format_checks(run_checks(short=True), short=True))  # the short form of `minserve doctor`

# %%
# A small server, so that its knee sits at a load this machine can offer in seconds. Prefix
# caching is off: every request pays its whole prefill, as in lab 01. The engine is warmed up on
# the shapes this lab runs (its prompt length; a lone request and a full batch) before anything
# is measured: the first steps of a fresh engine pay for first use.
SEATS = P.pick(quick=4, full=16)            # max_num_seqs: requests decoding at once
IN_TOKENS = P.pick(quick=32, full=256)      # prompt tokens per request
OUT_TOKENS = P.pick(quick=8, full=64)       # output tokens per request
llm = lab.engine_for(P, max_num_seqs=SEATS, enable_prefix_caching=False,
                     warm_prompts=[IN_TOKENS], warm_batches=[1, SEATS])
tok = llm.get_tokenizer()
print(P.describe())
print(f"engine: {SEATS} seats; each request: {IN_TOKENS} prompt tokens, {OUT_TOKENS} output tokens")
lab01 = lab.load_baseline("01")

# %% [markdown]
# ## 1. A server in the notebook, and what it can do
#
# `lab.local_server.serve` starts the same FastAPI app as `minserve serve` (`create_app`) around
# the notebook's engine, with uvicorn on a free local port in a background thread. While it runs,
# its engine thread owns the engine; the notebook talks to it over HTTP like any client. The first
# server has **no admission limits**: every request is let into the waiting room.
#
# To size the experiments to this machine, two full batches arrive at once: how long does one
# request take, start to finish, when every seat is busy (its *service time*), and so how many
# requests per second can the server finish? Every rate, window and objective below is scaled
# from that number, so it is measured several times (`lab.calibrate`,
# [`lab/hygiene.py`](../minserve/lab/hygiene.py)): the first run of a fresh server pays for first use
# and is dropped, and the lab scales from the median of the next runs and prints how far apart they
# were. ([`course/lab07.py`](course/lab07.py), `ServiceTime`, is the measurement.)

# %%
OPEN = AdmissionConfig(interactive=ClassLimits(max_queued_requests=None),
                       batch=ClassLimits(max_queued_requests=None))
srv = lab.local_server.serve(llm, admission=OPEN)
print(srv)
service = ex.ServiceTime(srv.base_url, lab.make_requests(tok, IN_TOKENS, OUT_TOKENS,
                                                         num_requests=2 * SEATS, seed=1), SEATS)
cal = lab.calibrate(service, name="service time (one request, all seats busy)", repeats=3,
                    max_runs=6, tolerance=0.2)
service_s = cal.median                               # one request, start to finish, seats full
capacity = SEATS / service_s                         # requests per second with every seat busy
tpot_full_s = service.kept(service.tpot_s, cal)      # TPOT at a full batch, same runs
decode_full_s = service.kept(service.decode_s, cal)  # E2E - TTFT at a full batch, same runs
service.runs[-1].show()                              # the last calibration run, as it went

# %% [markdown]
# Everything below is sized in units of that service time, so the experiments have the same shape
# on any machine. The service-level objective too: the first token within 1.5 service times (a
# request that finds a full batch waiting ahead of it waits about one service time for a seat), and
# later tokens at most three times slower than at a full batch here. Users are not infinitely
# patient: a client with no complete answer after four service times gives up and closes the
# connection (the server then aborts the request). Between the objective and the patience there is
# room for answers that come, but come too late to count.

# %%
SLO = tr.SLO(ttft_ms=round(1500 * service_s, -1), tpot_ms=round(3000 * tpot_full_s, -1))
PATIENCE_S = 4 * service_s                       # a user gives up after four service times
print(f"One request takes {1000 * service_s:.0f} ms start to finish with all {SEATS} seats busy "
      f"(TPOT {1000 * tpot_full_s:.0f} ms), so the server finishes about {SEATS} / "
      f"{service_s:.2f} s = {capacity:.2f} requests/s: its nominal capacity.")
print(f"SLO for this lab: {SLO}. A user gives up after {PATIENCE_S:.1f} s.")

# %% [markdown]
# ## 2. Past the knee without admission control
#
# Offered load rises in steps, as multiples of the nominal capacity; each step sends requests for
# two service times (Poisson arrivals), to impatient users as above. Every step runs twice, back to
# back, with the same requests at the same times: once on the open server, once on a server whose
# waiting room holds at most `SEATS` requests. Only the admission policy differs; this section looks
# at the open server.
#
# **What to look for:** throughput rises with the offered load and then stops rising near the
# capacity. Goodput rises with it at first; past the knee the queue grows, more and more answers come
# after the objective, and users who give up leave behind work that counts for nothing, so goodput
# should fall below throughput and away from it.

# %%
BOUNDED = AdmissionConfig(interactive=ClassLimits(max_queued_requests=SEATS),
                          batch=ClassLimits(max_queued_requests=SEATS))
POLICIES = {"none": OPEN, "bounded queue": BOUNDED}
if not lab.needs_engine("a server per admission policy, started here"):
    POLICIES = {"none": OPEN}   # a shared server: its own policy only ("none" in the tables below)
MULTS = P.pick(quick=[0.5, 1.0, 2.0, 4.0], full=[0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
WINDOW_S = P.pick(quick=2, full=6, smoke=1) * service_s   # arrivals per step, in service times


def load_step(point):
    mult, policy = point
    rate = round(mult * capacity, 2)
    n = max(4, round(rate * WINDOW_S))
    seed = int(100 * mult)  # the same requests and arrival times for both policies
    reqs = lab.make_requests(tok, IN_TOKENS, OUT_TOKENS, num_requests=n, seed=seed)
    server = lab.local_server.serve(llm, admission=POLICIES[policy])
    return tr.offer(server.base_url, tr.calls(reqs, request_rate=rate, seed=seed, label="requests"), slo=SLO,
                    patience_s=PATIENCE_S, live=False, name=f"{rate:g} req/s, admission: {policy}")


points = [(m, policy) for m in MULTS for policy in POLICIES]
with lab.LoadProbe() as sweep_probe:             # other processes' CPU use during the sweep
    results = lab.run_sweep(points, load_step, title="load steps")
rows = []
for (mult, policy), res in results.items():
    g = res.goodput(SLO)
    ok = res.requests[res.requests.outcome == "ok"]
    rows.append({"admission": policy, "offered (req/s)": round(mult * capacity, 2),
                 "throughput (req/s)": round(g["throughput_rps"], 2),
                 "goodput (req/s)": round(g["goodput_rps"], 2), "offered": g["offered"],
                 "answered": g["answered"], "good": g["good"], "shed": g["shed"],
                 "gave up": int((res.requests.outcome == "gave up").sum()),
                 "p90 TTFT (ms)": round(1000 * ok.ttft_s.quantile(0.9), 0) if len(ok) else math.nan,
                 "duration (s)": round(res.duration_s, 2)})
table = pd.DataFrame(rows)
sweep = table[table.admission == "none"].set_index("offered (req/s)").drop(columns="admission")
# A measured cause, should a lesson below not show: did the machine's speed change after the
# calibration? Past the capacity every seat is busy, as in the calibration: compare decode times.
PAST = [m for m in MULTS if m > 1]
drift = ex.speed_drift(decode_full_s, [results[m, p].requests for m in PAST for p in POLICIES])
sweep

# %%
past_rows = sweep[sweep.index > 1.01 * capacity]          # the loads above the nominal capacity
good_past, answered_past = int(past_rows.good.sum()), int(past_rows.answered.sum())
falls = good_past < answered_past
fig, ax = plt.subplots(figsize=(7.5, 3.8))
x = sweep.index.to_numpy(float)
ax.plot(x, sweep["throughput (req/s)"], "o-", color="tab:blue", label="throughput (answered)")
ax.plot(x, sweep["goodput (req/s)"], "s-", color="tab:green", label=f"goodput ({SLO})")
ax.axhline(capacity, ls=":", color="grey", label="nominal capacity")
ax.set(xlabel="offered load (req/s)", ylabel="requests per second", ylim=(0, None),
       title=("No admission control: past the knee, goodput falls below throughput" if falls else
              "No admission control: does goodput fall below throughput past the knee?"))
ax.legend(fontsize=8)
plt.show()
lab.lesson("07-goodput", "past the knee, goodput falls below throughput: the open server answers "
           "requests too late to count",
           shown=falls,
           evidence=f"At {' and '.join(f'{r:g}' for r in past_rows.index)} req/s offered (above the "
                    f"capacity of {capacity:.2f}), the open server answered {answered_past} requests "
                    f"and {good_past} of them met the SLO",
           load=sweep_probe.load, calibration=cal, causes=drift)
top = sweep.index.max()
row = sweep.loc[top]
best_thr = sweep["throughput (req/s)"].max()
print(f"Throughput peaked at {best_thr} req/s (nominal capacity {capacity:.2f}). At {top} req/s "
      f"offered, the open server answered {row['throughput (req/s)']} req/s and "
      f"{row['goodput (req/s)']} req/s within the SLO ({int(row['good'])} of {int(row['answered'])} "
      f"answers in time); {int(row['gave up'])} of {int(row['offered'])} users gave up waiting.")

# %% [markdown]
# **Exercise 1.** What was the goodput of the open server at the highest offered load, in requests
# per second? Work it out from the table's counts rather than reading the goodput column.
#
# **Exercise 2.** Where is the knee: at which offered load (one of the table's values) did goodput
# peak?

# %%
goodput_at_top = None  # your answer, in req/s
knee_rate = None       # your answer: one of the offered loads, in req/s

# %%
q1 = ex.q1_goodput(sweep, top)
q1.check(goodput_at_top)
q2 = ex.q2_knee(sweep)
q2.check(knee_rate)
# q1.hint(); q2.hint()
# q1.solution(); q2.solution()

# %% [markdown]
# ## 3. Admission control: a bounded waiting room
#
# The second server of each step admits a request only while fewer than `SEATS` requests wait for a
# seat (`ClassLimits(max_queued_requests=SEATS)`); any other request is **shed at once** with
# `429 Too Many Requests` and a `Retry-After` header, the server's estimate of when a seat frees up
# ([`server/admission.py`](../minserve/server/admission.py)).
#
# **What to look for:** past the knee the bounded server refuses part of the load, and what it does
# let in should still meet the SLO (a request admitted waits at most about one service time for a
# seat), so its goodput should stay near the capacity instead of collapsing.

# %%
# needs the engine: a server with a bounded waiting room, started here (section 3)
bounded = table[table.admission == "bounded queue"].set_index("offered (req/s)").drop(columns="admission")
gp_open, gp_bounded = float(sweep.loc[top, "goodput (req/s)"]), float(bounded.loc[top, "goodput (req/s)"])
keeps = gp_bounded > gp_open
fig, ax = plt.subplots(figsize=(7.5, 3.8))
ax.plot(x, sweep["goodput (req/s)"], "s-", color="tab:red", label="no admission control")
ax.plot(x, bounded["goodput (req/s)"], "s-", color="tab:green", label=f"waiting room of {SEATS}")
ax.axhline(capacity, ls=":", color="grey", label="capacity (calibration)")
ax.set(xlabel="offered load (req/s)", ylabel="goodput (req/s)", ylim=(0, None),
       title=("A bounded waiting room keeps more goodput past the knee" if keeps else
              "Does a bounded waiting room keep more goodput past the knee?"))
ax.legend(fontsize=8)
plt.show()
lab.lesson("07-bounded-room", "past the knee, a bounded waiting room keeps more goodput than the "
           "open server",
           shown=keeps,
           evidence=f"At {top:g} req/s offered: goodput {gp_bounded:.2f} req/s with a waiting room of "
                    f"{SEATS} ({bounded.loc[top, 'good']} answers in time, {bounded.loc[top, 'shed']} "
                    f"shed, in {bounded.loc[top, 'duration (s)']:.1f} s) against {gp_open:.2f} req/s "
                    f"without admission control ({sweep.loc[top, 'good']} in time, "
                    f"{sweep.loc[top, 'gave up']} gave up, in {sweep.loc[top, 'duration (s)']:.1f} s)",
           load=sweep_probe.load, calibration=cal, causes=drift)
bounded

# %% [markdown]
# The two runs at the highest load, as the live view drew them: the latency of answered requests
# (the dashed line is the TTFT objective), what each request got, and the server's queue.

# %%
# needs the engine: a server with a bounded waiting room, started here (section 3)
top_mult = MULTS[-1]
results[(top_mult, "none")].show()
results[(top_mult, "bounded queue")].show()

# %% [markdown]
# What did the refused requests get, and how fast? **What to look for:** a shed request should learn
# within milliseconds that it should come back later (or go to another replica); a request that
# waited on the open server until its user gave up learned nothing, after a long wait, and may have
# used the server's time while it waited.

# %%
# needs the engine: a server with a bounded waiting room, started here (section 3)
shed_run = results[(top_mult, "bounded queue")].requests
open_run = results[(top_mult, "none")].requests
shed = shed_run[shed_run.outcome == "shed"]
display(shed.groupby(["status", "error_code", "retry_after_s"]).size().rename("requests").to_frame())
gave_up = open_run[open_run.outcome == "gave up"]
if len(shed):
    print(f"A shed request had its answer (429) after {1000 * shed.e2e_s.median():.0f} ms (median); "
          f"the server suggested retrying after {shed.retry_after_s.median():.0f} s.")
else:
    print("The bounded server shed no request at this load in this run.")
if len(gave_up):
    print(f"On the open server, {len(gave_up)} users gave up after {PATIENCE_S:.1f} s without an answer.")
print("One refusal, as the client saw it:", shed.error.iloc[0] if len(shed) else "(none shed)")

# %% [markdown]
# ## 4. Recovery after a burst
#
# A burst of six service times' worth of requests arrives at once, then traffic returns to normal:
# one request every half service time, a light load. How long until those later requests are
# served within the objective again? Same traffic on both servers.
#
# **What to look for:** on the open server the burst becomes a backlog, and every request that
# arrives after it waits behind it until it drains (or its users give up). The bounded server sheds
# most of the burst at the door, so the requests after it should be served within the objective much
# sooner.

# %%
# needs the engine: two servers with different admission policies, started here (section 4)
BURST = 6 * SEATS                   # six service times of work, all at once
AFTER = P.pick(quick=12, full=16)   # then one request every half service time
burst_reqs = lab.make_requests(tok, IN_TOKENS, OUT_TOKENS, num_requests=BURST, seed=31)
after_reqs = lab.make_requests(tok, IN_TOKENS, OUT_TOKENS, num_requests=AFTER, seed=32)
burst_calls = tr.merge(tr.calls(burst_reqs, label="burst"),
                       tr.calls(after_reqs, request_rate=2 / service_s, burstiness=math.inf,
                                label="later"))
recovery = {}
with lab.LoadProbe() as burst_probe:
    for policy in POLICIES:
        server = lab.local_server.serve(llm, admission=POLICIES[policy])
        recovery[policy] = tr.offer(server.base_url, burst_calls, slo=SLO, patience_s=PATIENCE_S,
                                    name=f"burst of {BURST}, admission: {policy}")


# %%
# needs the engine: two servers with different admission policies, started here (section 4)
def recovered_at(res):
    # The send time of the first later request from which on every one met the SLO.
    r = res.requests.query("label == 'later'").sort_values("send_s")
    good = SLO.met(r).to_numpy()
    for k in range(len(r)):
        if good[k:].all():
            return float(r.send_s.iloc[k])
    return math.inf


rec = {p: recovered_at(res) for p, res in recovery.items()}
sooner = rec["bounded queue"] < rec["none"]
fig, ax = plt.subplots(figsize=(7.5, 3.6))
for policy, color in zip(POLICIES, ("tab:red", "tab:green")):
    r = recovery[policy].requests.query("label == 'later'")
    ok = r[r.outcome == "ok"]
    ax.plot(ok.send_s, 1000 * ok.ttft_s, "o-", color=color, label=f"admission: {policy}")
    lost = r[r.outcome != "ok"]
    if len(lost):
        ax.scatter(lost.send_s, [1000 * PATIENCE_S] * len(lost), marker="x", color=color,
                   label=f"admission: {policy}, no answer ({', '.join(sorted(set(lost.outcome)))})")
ax.axhline(SLO.ttft_ms, ls="--", color="grey", label="TTFT objective")
ax.set(xlabel="sent at (s after the burst)", ylabel="TTFT (ms)", ylim=(0, None),
       title=("After a burst: the bounded server is back within the objective sooner" if sooner else
              "After a burst: which server is back within the objective sooner?"))
ax.legend(fontsize=8)
plt.show()
when = {p: (f"from the request sent at {t:.1f} s on" if math.isfinite(t) else "not within this run")
        for p, t in rec.items()}
lab.lesson("07-recovery", "after a burst, the bounded waiting room serves the requests that come "
           "next within the objective sooner than the open server",
           shown=sooner,
           evidence=f"Later requests met the SLO again {when['bounded queue']} with the bounded "
                    f"waiting room, {when['none']} without admission control",
           load=burst_probe.load, calibration=cal,
           causes=ex.speed_drift(decode_full_s, [r.requests for r in recovery.values()]))
for p in rec:
    print(f"admission {p}: burst outcomes: {recovery[p].counts().loc['burst'].to_dict()}")

# %% [markdown]
# ## 5. Deadlines: `x-deadline-ms`
#
# A client can say how long the whole answer may take: the header `x-deadline-ms` (or the body
# field `deadline_ms`). Admission then predicts when the request would finish if admitted now, and
# sheds it at once (`429`, reason `deadline`) if the prediction misses. The model is stated in
# [`server/deadlines.py`](../minserve/server/deadlines.py):
#
#     start     = when a seat frees and the prompts ahead are prefilled (0 on an idle server)
#     predicted = start + prompt_tokens * p + max_tokens * d
#
# where `p` (seconds of prefill per prompt token) and `d` (seconds per decode step) are moving
# averages of the engine's recent steps. A fresh server starts from priors; a few requests teach it
# this machine's speed.

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
srv = lab.local_server.serve(llm, admission=AdmissionConfig())   # default budgets, deadlines on
tr.offer(srv.base_url, tr.calls(lab.make_requests(tok, IN_TOKENS, OUT_TOKENS, num_requests=2 * SEATS,
                                                  seed=41)), live=False)   # let it measure p and d
p_s_per_token = srv.admission.prefill_s_per_token
d_s_per_step = srv.admission.decode_s_per_step
print(f"The server is idle now. Its model: p = {p_s_per_token * 1000:.3g} ms per prompt token, "
      f"d = {d_s_per_step * 1000:.3g} ms per decode step.")

# %% [markdown]
# **Exercise 3.** The server is idle. A request arrives with `IN_TOKENS` prompt tokens and
# `max_tokens = OUT_TOKENS` (values below). What completion time, in milliseconds, does admission
# predict for it?

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
print(f"prompt tokens = {IN_TOKENS}, max_tokens = {OUT_TOKENS}")
predicted_ms = None  # your answer, in ms

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
from minserve.server.admission import Ticket

model_s = srv.admission.predict_s(Ticket("you", "interactive", IN_TOKENS, OUT_TOKENS))
q3 = ex.q3_deadline_prediction(IN_TOKENS, OUT_TOKENS, p_s_per_token, d_s_per_step, model_s)
q3.check(predicted_ms)
# q3.hint()
# q3.solution()

# %% [markdown]
# Now two requests to the idle server, one with a deadline at half that prediction and one at twice
# it (not streamed, so the status code is the whole story):

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
def ask(deadline_ms):
    r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                   headers={"x-deadline-ms": f"{deadline_ms:.0f}"},
                   json={"model": srv.model_name, "prompt": lab.text_of_length(tok, IN_TOKENS, seed=5),
                         "max_tokens": OUT_TOKENS, "ignore_eos": True})
    err = (r.json().get("error") or {}) if r.status_code != 200 else {}
    return {"x-deadline-ms": round(deadline_ms), "status": r.status_code,
            "Retry-After": r.headers.get("retry-after"), "code": err.get("code"),
            "message": (err.get("message") or "")[:110]}


deadline_demo = pd.DataFrame([ask(0.5 * 1000 * model_s), ask(2.0 * 1000 * model_s)])
display(deadline_demo)
verdict = {429: "refused at the door (429)", 200: "admitted and answered (200)"}
print(f"With a deadline of half the prediction the request was "
      f"{verdict.get(deadline_demo.status[0], f'answered {deadline_demo.status[0]}')}; with twice "
      f"the prediction it was {verdict.get(deadline_demo.status[1], f'answered {deadline_demo.status[1]}')}.")

# %% [markdown]
# The prediction can also be wrong in the other direction. Until a server has measured its steps,
# its rates are priors; here a server starts with priors that call every step nearly free, so it
# admits a whole burst of three full batches with a deadline of half a service time, which no
# request can really meet. The deadline still holds after admission: a request still **queued** when
# its deadline passes is aborted before it runs. A non-streamed client gets `504` with code
# `deadline_exceeded`; a streamed one has already received its `200` headers, so it gets an error
# event with that code, then `[DONE]`. Requests already running are left to finish: their seat and
# prefill are paid for.
#
# **What to look for:** the first `SEATS` requests take the seats at once and finish, late; the
# others are still waiting for a seat when the deadline passes, half a service time in, and expire.

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
optimist = AdmissionConfig(prior_prefill_s_per_token=1e-6, prior_decode_s_per_step=1e-4,
                           ewma_alpha=1e-9)   # rates pinned at the priors for the demo
DEADLINE_MS = round(500 * service_s)          # half a service time: only the seated can start
srv = lab.local_server.serve(llm, admission=optimist)
with lab.LoadProbe() as late_probe:
    late = tr.offer(srv.base_url, tr.calls(lab.make_requests(tok, IN_TOKENS, OUT_TOKENS,
                                                             num_requests=3 * SEATS, seed=51),
                                           deadline_ms=DEADLINE_MS),
                    name="optimistic model: a burst with deadlines", live=False)
display(srv.admission_counts())
expired = late.requests[late.requests.outcome == "expired"]
finished = late.requests[late.requests.outcome == "ok"]
deadline_lesson = lab.lesson(
    "07-deadline-504", "a deadline also holds after admission: a request still queued when it passes "
    "is aborted (504 deadline_exceeded) before it takes a seat",
    shown=len(expired) > 0,
    evidence=f"{len(expired)} of {len(late.requests)} requests admitted with x-deadline-ms "
             f"{DEADLINE_MS} expired in the queue"
             f"{' (code ' + str(expired.error_code.iloc[0]) + ')' if len(expired) else ''}; "
             f"{len(finished)} had a seat and were left to finish"
             + (f", the last after {1000 * finished.e2e_s.max():.0f} ms" if len(finished) else ""),
    load=late_probe.load, calibration=cal)

# %% [markdown]
# ## 6. Protecting interactive traffic from a batch flood
#
# Admission classifies every request: `x-priority-class: interactive | batch` (or vLLM's `priority`
# field: 0 or less is interactive, above 0 is batch; with API keys, the key may cap the class). Each
# class has **its own waiting room**. minserve's engine itself serves requests in arrival order, so
# the classes are protected at the door: a flood can fill the batch waiting room, never the
# interactive one.
#
# A batch job floods the server at 2.5 times its capacity while a few interactive users send a
# request every half service time. Same traffic on two servers: classes with unbounded waiting
# rooms, then a batch waiting room of 2 (interactive: `2 * SEATS`).
#
# **What to look for:** on the first server the interactive requests queue behind the batch backlog.
# On the second, batch requests beyond the small waiting room are shed, and interactive TTFT should
# stay near the objective.

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
CLASSES = AdmissionConfig(interactive=ClassLimits(max_queued_requests=2 * SEATS),
                          batch=ClassLimits(max_queued_requests=2))
FLOOD_S = P.pick(quick=2, full=6) * service_s      # the flood lasts this long ...
batch_reqs = lab.make_requests(tok, IN_TOKENS, OUT_TOKENS, num_requests=round(2.5 * capacity * FLOOD_S),
                               seed=61)                 # ... at 2.5x the capacity
inter_reqs = lab.make_requests(tok, IN_TOKENS, OUT_TOKENS, num_requests=P.pick(quick=4, full=12), seed=62)
flood_calls = tr.merge(
    tr.calls(batch_reqs, request_rate=2.5 * capacity, seed=6, label="batch", priority_class="batch"),
    tr.calls(inter_reqs, request_rate=2 / service_s, burstiness=math.inf, label="interactive",
             priority_class="interactive"))
flood = {}
with lab.LoadProbe() as flood_probe:
    for name, cfg in (("shared waiting room", OPEN), ("per-class budgets", CLASSES)):
        server = lab.local_server.serve(llm, admission=cfg)
        flood[name] = tr.offer(server.base_url, flood_calls, slo=SLO, live=name == "per-class budgets",
                               name=f"batch flood, {name}")

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
p90 = {name: 1000 * res.requests.query("label == 'interactive' and outcome == 'ok'").ttft_s.quantile(0.9)
       for name, res in flood.items()}
protected = bool(p90["per-class budgets"] < p90["shared waiting room"])
fig, ax = plt.subplots(figsize=(7.5, 3.6))
for (name, res), color in zip(flood.items(), ("tab:red", "tab:green")):
    r = res.requests.query("label == 'interactive' and outcome == 'ok'")
    ax.plot(r.send_s, 1000 * r.ttft_s, "o-", color=color, label=name)
ax.axhline(SLO.ttft_ms, ls="--", color="grey", label="TTFT objective")
ax.set(xlabel="sent at (s)", ylabel="interactive TTFT (ms)", ylim=(0, None),
       title=("Per-class budgets keep interactive requests out of the batch backlog" if protected else
              "Do per-class budgets keep interactive requests out of the batch backlog?"))
ax.legend(fontsize=8)
plt.show()
outcomes = pd.concat({name: res.counts() for name, res in flood.items()}).fillna(0).astype(int)
display(outcomes)
classes_lesson = lab.lesson(
    "07-classes", "per-class budgets keep interactive requests out of a batch flood's backlog",
    shown=protected,
    evidence=f"Interactive p90 TTFT {p90['per-class budgets']:.0f} ms with per-class budgets "
             f"against {p90['shared waiting room']:.0f} ms with one shared waiting room "
             f"(TTFT objective {SLO.ttft_ms:.0f} ms)",
    load=flood_probe.load, calibration=cal,
    causes=ex.speed_drift(decode_full_s, [r.requests for r in flood.values()]))

# %% [markdown]
# **Exercise 4.** On the server with per-class budgets, which class did admission shed:
# `"interactive"`, `"batch"`, `"both"` or `"neither"`?

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
shed_class = None  # your answer

# %%
# needs the engine: servers started here with a deadline model and class budgets (sections 5 and 6)
q4 = ex.q4_shed_class(flood["per-class budgets"].counts())
q4.check(shed_class)
# q4.hint()
# q4.solution()

# %% [markdown]
# ## 7. Explore
#
# The panel sends a load to a server with a bounded waiting room (the same `BOUNDED` policy as
# above), through `lab.traffic.experiment`, the plain function the next cell also calls. Engine
# settings are the server's (disabled, showing the notebook engine's real values: `SEATS` seats);
# vary the rate, the number of requests and the lengths. To
# try another admission policy, start a server with it (`lab.local_server.serve(llm,
# admission=...)`) and pass its `base_url`.

# %%
srv = lab.local_server.serve(llm, admission=BOUNDED)
panel = lab.control_panel(run=tr.experiment, preset=P, base_url=srv.base_url, engine=llm,
                          num_requests=16, request_rate=round(2 * capacity, 1),
                          prompt_tokens=IN_TOKENS, output_tokens=OUT_TOKENS)
panel

# %%
explore = tr.experiment(P, base_url=srv.base_url, num_requests=4 * SEATS, request_rate=2 * capacity,
                        prompt_tokens=IN_TOKENS, output_tokens=OUT_TOKENS, slo=SLO, live=False)
print(explore)
explore.percentiles()

# %% [markdown]
# ## 8. Record your baseline

# %%
baseline = {
    "seats": SEATS, "capacity_rps": round(capacity, 3), "service_ms": round(1000 * service_s, 1),
    "calibration": cal.as_dict(), "patience_s": round(PATIENCE_S, 3),
    "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms},
    "sweep": {policy: {str(r["offered (req/s)"]): {"throughput": r["throughput (req/s)"],
                                                   "goodput": r["goodput (req/s)"]}
                       for _, r in table[table.admission == policy].iterrows()}
              for policy in POLICIES},
    "knee_rps": float(sweep["goodput (req/s)"].idxmax()),
}

# %%
# needs the engine: the records of sections 4 and 6
baseline["recovered_at_s"] = {p: (None if math.isinf(t) else round(t, 2)) for p, t in rec.items()}
baseline["interactive_p90_ttft_ms"] = {k: round(v, 1) for k, v in p90.items()}

# %%
baseline_path = lab.record_baseline("07", baseline)
tpot_by_batch = (lab01 or {}).get("tpot_ms_by_batch", {})
if str(SEATS) in tpot_by_batch:
    print(f"\nLab 01 measured a TPOT of {tpot_by_batch[str(SEATS)]:.0f} ms with {SEATS} requests "
          f"decoding in process; through this lab's server at a full batch it was "
          f"{1000 * tpot_full_s:.0f} ms (over HTTP, with the server's threads on the same CPU, and "
          "at another moment of this machine's load).")

# %% [markdown]
# ## Summary
#
# What this lab set out to show; the lessons above, and the last cell, say which of these this run
# showed on its own numbers.
#
# - Past the knee, more offered load buys no more throughput, and goodput falls below it: the queue
#   grows, answers arrive after the objective, and users give up. Client timeouts then decide who
#   gets served, and the server does work nobody waits for.
# - A bounded waiting room turns overload into fast, explicit refusals: `429` with `Retry-After`,
#   while the requests it admits wait at most about one service time. That keeps goodput up past
#   the knee, and after a burst it brings the server back within the objective sooner.
# - A deadline (`x-deadline-ms`) lets admission refuse what it predicts will be late; the deadline
#   also holds after admission (`504 deadline_exceeded` for a request still queued when it passes).
#   The prediction is only as good as its rates and counts the output at `max_tokens`.
# - Priority classes have separate budgets, so a batch flood fills its own waiting room and sheds
#   its own requests, and interactive users keep their latency.
#
# This run's numbers are above and in `labs/results/07.json`.
#
# ## Stretch goals
#
# - Give the batch clients manners: resend a shed request after its `Retry-After`. (Build the calls
#   again from `shed` with `send_s` set to their send time plus the suggested wait, and offer them.)
#   How much of the batch work gets done, and does interactive TTFT stay low?
# - Use deadlines as the overload policy instead of a queue bound: send every request of the sweep
#   with `deadline_ms=SLO.ttft_ms + OUT_TOKENS * SLO.tpot_ms` on a server with
#   `AdmissionConfig()`. How does its goodput compare with the bounded waiting room?
# - Add a tenant quota (`AdmissionConfig(tenant_max_inflight=2)`) and two API keys
#   (`lab.local_server.serve(llm, auth=Auth({...}))`, see lab 04): can one tenant still take all the
#   seats?
# - Point `tr.offer` at a vLLM server: which headers does it ignore, and what does its overload look
#   like?

# %% [markdown]
# ## This run

# %%
run_summary = lab.summary("07")   # run time, the machine's load, the lessons this run showed
