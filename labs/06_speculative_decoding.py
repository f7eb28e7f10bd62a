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
# # Lab 06 — Speculative decoding: guess several tokens, let the model check them in one pass
#
# A request decodes one token per forward pass of the model, and every pass waits for the one
# before it: the next token depends on the last. At batch 1 on this CPU that pass spends most of its
# time bringing the weights in from memory, while the arithmetic units are mostly idle. Speculative
# decoding puts them to work. Something cheap *guesses* the next `k` tokens, the model (the
# *target*) computes all `k + 1` positions in a single pass, and the request keeps the guesses up to
# the first one the model disagrees with. A good guess turns one pass into several tokens; a bad one
# costs a somewhat longer pass and nothing else, because every token kept is the model's own choice.
#
# The guesser used here needs no second model: **prompt lookup** (vLLM's `ngram` method) finds the
# request's last few tokens (four, or fewer down to a single one) earlier in its own text, prompt and
# answer so far, and proposes whatever followed them there. That is excellent when the answer repeats
# the prompt (fixing a document, editing code) and mostly wrong in free conversation.
#
# **Goals.** By the end you will have:
#
# 1. seen on the planner's roofline why checking `k` extra positions costs far less than `k` extra
#    steps at batch 1, and why that stops being true in a large batch;
# 2. confirmed that speculation never changes what the model writes (greedy: keep a guess while it
#    equals the model's choice; sampling: rejection sampling keeps the model's distribution), and
#    watched rejection sampling do it on a toy vocabulary;
# 3. measured acceptance rate, tokens per target step and speed-up on three workloads (copy, code,
#    chat) and for `k` = 2, 4 and 6;
# 4. built the model *speed-up ≈ E(a, k) / c* and held it against the run, then read the
#    per-position acceptance curve to see where it is wrong;
# 5. found the batch size at which speculation stops paying here, and watched the adaptive rule
#    switch it off on chat.
#
# **Run time:** about 1.5 minutes on a quiet 2-core CPU in the `quick` preset (the default), up to
# 2.5 minutes with one core taken by another process; under `MINSERVE_LAB_CI=1` (one prompt per
# workload, batch sizes 1 and 64) about 1 minute quiet, up to 2 busy (measured on this project's
# 2-core machine: 1.5 and 2.5 min, CI 0.7 to 0.9 and 1.6 to 1.8 min). The last cell prints this
# run's time. The `full` preset (`MINSERVE_LAB_PRESET=full`) uses longer answers, more prompts and
# batches up to 128, sized for a GPU box (not timed there yet).
#
# **Lessons, checked.** The timing results this lab is about (speculation pays on copy, stops
# paying in a large batch, the adaptive rule drops chat's proposals) are checked on this run's own
# numbers right after the cell that measures them: the notebook prints "Lesson shown" with the
# evidence, or "Lesson NOT shown in this run" with the cause it measured (other processes' CPU use)
# and how to get a clean run. Token counts and outputs do not depend on the machine's load; times do.
#
# **Against a server** (`MINSERVE_LAB_TARGET=http://host:port`): this lab builds its own engines
# (it compares proposers and their acceptance counts, one engine per proposer), so it runs in the
# notebook even when `MINSERVE_LAB_TARGET` is set; nothing in it goes to the server.
#
# **Prerequisites:** [Lab 00](00_tour.ipynb) (engine steps), [Lab 01](01_prefill_vs_decode.ipynb)
# (TPOT against batch size) and [Lab 03](03_kv_cache_detective.ipynb) (the planner and its
# roofline).
#
# **Source files:** [`spec/ngram.py`](../minserve/spec/ngram.py) (`NgramProposer.propose`: the
# lookup), [`spec/verify.py`](../minserve/spec/verify.py) (`accept_one_hot` and
# `rejection_sample`: what a verify step keeps), [`spec/adaptive.py`](../minserve/spec/adaptive.py)
# (`AdaptiveSpeculation`: propose only while it pays),
# [`engine/llm_engine.py`](../minserve/engine/llm_engine.py) (`_propose`) and
# [`engine/scheduler.py`](../minserve/engine/scheduler.py) (`_proposals`, and
# `update_from_output`, which rolls back what was refused),
# [`metrics/spec.py`](../minserve/metrics/spec.py) (the `vllm:spec_decode_*` counters),
# [`plan/budget.py`](../minserve/plan/budget.py) (`decode_step`: the roofline), and
# [`course/lab06.py`](course/lab06.py) (this lab's workloads and its
# side-by-side measurement).

# %%
# Set-up check: what this notebook runs on (and quiet engine logs, shared figure style).
import gc
import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from minserve import SamplingParams, lab
from course import lab06 as ex
from minserve.spec.verify import rejection_sample
from minserve.workshop.doctor import format_checks, run_checks

P = lab.setup()
print(format_checks(run_checks(short=True), short=True))  # the short form of `minserve doctor`

# %% [markdown]
# Sizes for this run. Each is given per preset; under `MINSERVE_LAB_CI=1` (what `make test` sets)
# there are fewer prompts and batch sizes, so that CI runs the whole lab in about half the time.

# %%
CI = lab.is_ci()
# (48 output tokens under CI too: with fewer, the adaptive rule of section 8 has too few steps on
# chat to show what it does.)
MAX_TOKENS = P.pick(quick=48, full=256)                  # output tokens per request
GROUPS = 1 if CI else P.pick(quick=2, full=4)            # prompts per workload, one at a time
K = 4                                                    # proposals per step, unless said otherwise
K_VALUES = [2, 4, 6]
K_BATCH = max(K_VALUES)                                  # proposals per step in the batch sweep
BATCHES = [1, 64] if CI else P.pick(quick=[1, 4, 16, 64], full=[1, 8, 32, 64, 128])
# Output tokens per request in the batch sweep: enough that, after the last prompt of a batch of 64
# is prefilled, both engines still decode the whole batch for a few steps (the verify cost is read
# there; with fewer, the speculative engine's requests finish while the batch is still filling).
BATCH_TOKENS = P.pick(quick=24, full=64)
# Room for the largest batch: seats, and KV blocks for its prompts, answers and proposals.
ENGINE = dict(max_num_seqs=max(BATCHES), num_kv_blocks=P.pick(quick=768, full=None))

# Both warmed up on the batch sizes this lab decodes (the first steps of a shape pay for first use).
plain = ex.make_engine(P, warm_batches=BATCHES, **ENGINE)         # decodes one token per step
spec = ex.make_engine(P, k=K, warm_batches=BATCHES, **ENGINE)     # the same, plus speculative_config
tok = plain.get_tokenizer()
print(P.describe())
print(f"this lab's engines: the preset's arguments with {ENGINE}")
print(f"speculative_config = {ex.spec_config(K)}")
lab01 = lab.load_baseline("01")

# %% [markdown]
# ## 1. Why checking a few guesses costs far less than making them one by one
#
# A decode step multiplies every weight matrix of the model by the rows of its batch: one row per
# token being computed. With a single row, each weight is fetched from memory and used for one
# multiply-add, so the step's time is set by how fast memory delivers the weights (lab 03's planner
# calls that step *memory-bound*). Add rows and the weights are still fetched once; only the
# arithmetic grows. Until the arithmetic takes longer than the fetching, extra rows cost almost
# nothing.
#
# A verify step of a lone request with `k` proposals is a step of `k + 1` rows: on the roofline, it
# should cost little more than a plain step. A batch of `B` requests already has `B` rows, and
# verifying `k` proposals for each makes `B(k + 1)`. Once a step is *compute-bound*, its time grows
# with its rows, so the verify step costs up to `k + 1` plain steps, which the accepted guesses can
# no longer repay.
#
# **What to look for:** the planner's step time (the roofline of [`plan/budget.py`](../minserve/plan/budget.py),
# with this machine's measured bandwidth and matmul rate) is flat for a few rows and then climbs in
# a straight line. The markers show a plain step and its verify step at batch 1 and at the largest
# batch of this lab.

# %%
rows = np.unique(np.geomspace(1, 8 * max(BATCHES) * (K + 1), 60).astype(int))
curve = ex.roofline_curve(P.model, rows)
roof, hw = ex.roofline_costs(P.model, BATCHES, K)
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.plot(curve["rows"], curve["memory (ms)"], ls="--", color="tab:purple", label="reading the weights")
ax.plot(curve["rows"], curve["compute (ms)"], ls="--", color="tab:orange", label="arithmetic")
ax.plot(curve["rows"], curve["step (ms)"], color="black", lw=2, label="step (the larger of the two)")
for b, color in ((1, "tab:green"), (max(BATCHES), "tab:red")):
    r = roof.set_index("batch").loc[b]
    ax.scatter([r["plain rows"], r["verify rows"]], [r["plain step (ms)"], r["verify step (ms)"]],
               color=color, zorder=3, s=40,
               label=f"batch {b}: plain ({r['plain rows']} row{'s' if b > 1 else ''}) and verify ({r['verify rows']} rows)")
ax.set(xscale="log", yscale="log", xlabel="rows in one forward pass", ylabel="step time (ms, log scale)",
       title="A step costs the same until its arithmetic outgrows the weight reads")
ax.legend(fontsize=8)
plt.show()
b1, bN = roof.iloc[0], roof.iloc[-1]
print(f"On this machine as measured ({hw.bandwidth_bytes_per_s / 1e9:.0f} GB/s, "
      f"{hw.fp32_flops_per_s / 1e9:.0f} GFLOP/s in fp32), the roofline prices a verify step with k = {K} "
      f"at {b1['verify cost (plain steps)']:.2f} plain steps at batch 1, and at "
      f"{bN['verify cost (plain steps)']:.2f} plain steps at batch {int(bN['batch'])}.")
roof.round(2)

# %% [markdown]
# The roofline is a bound computed from two measured rates; real kernels fall short of it, by more
# for some row counts than for others. The next sections measure what a verify step really costs
# here, and section 7 puts the two side by side.
#
# ## 2. Verification keeps the model's own output
#
# **Greedy requests.** Row `i` of a verify step computes the model's choice for the position after
# the first `i` proposals. The request keeps proposals for as long as each one equals the model's
# choice at its row. At the first mismatch it takes the model's choice instead and drops the rest;
# if all `k` match, the last row's choice comes as a bonus. So a verify step yields between 1 and
# `k + 1` tokens, and every one of them is the token plain greedy decoding would have produced
# there (`accept_one_hot` in [`spec/verify.py`](../minserve/spec/verify.py)). The refused positions'
# KV entries are rolled back by the scheduler; nothing unverified is kept.
#
# **Sampled requests.** If the guesses come from a draft distribution `q`, a proposal `d` is kept
# with probability `min(1, p(d) / q(d))`, where `p` is the model's distribution at that position;
# when it is refused, the replacement is drawn from what is left, `max(0, p - q)` normalized. The
# two ways of producing a token add up to exactly `p` for every token, whatever `q` is: a poor
# guesser lowers how often proposals are kept, never what the text looks like in distribution.
# Prompt lookup has no distribution, so the engine treats its guess as certain (`q` one-hot): the
# rule becomes "draw `x` from `p`; keep the guess if `x` equals it". (A seeded request draws the
# noise for its j-th token from a generator seeded by its seed and j, so with lookup proposals
# its sampled text is exactly the text it gets without speculation.)
#
# **What to look for:** below, a deliberately bad draft distribution `q` on a six-token vocabulary
# proposes one token at a time, and `rejection_sample` (the engine's function) decides. The tokens
# that come out should follow the target `p`, not `q`.

# %%
N_SAMPLES = 2000 if CI else 20000
g = torch.Generator().manual_seed(0)
p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])   # the target model's distribution
q = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])   # a draft that mostly guesses wrong
counts = np.zeros(len(p))
kept = 0
for _ in range(N_SAMPLES):
    d = int(torch.multinomial(q, 1, generator=g))          # the draft proposes d ~ q
    out = rejection_sample(torch.stack([p, p]), q[None], [d], generator=g)
    counts[out[0]] += 1
    kept += out[0] == d and len(out) == 2
freq = counts / N_SAMPLES
tv = 0.5 * np.abs(freq - p.numpy()).sum()
x = np.arange(len(p))
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.bar(x - 0.27, p, width=0.27, label="target p", color="tab:blue")
ax.bar(x, q, width=0.27, label="draft q", color="tab:gray")
ax.bar(x + 0.27, freq, width=0.27, label=f"tokens that came out ({N_SAMPLES:,})", color="tab:green")
ax.set(xlabel="token", ylabel="probability", title="Rejection sampling returns the target's distribution")
ax.legend()
plt.show()
print(f"Only {kept / N_SAMPLES:.0%} of the proposals were kept, yet the output frequencies are within "
      f"{tv:.3f} (total variation) of p; sampling noise alone is about {math.sqrt(len(p) / N_SAMPLES) / 2:.3f} "
      f"at this sample size. Against the draft, the distance is {0.5 * np.abs(freq - q.numpy()).sum():.2f}.")

# %% [markdown]
# The statistical test of the engine's sampler (`tests/test_spec_rejection.py`) does the same with
# random distributions and more samples, and checks that a deliberately broken sampler fails it.
# The rest of this lab is greedy, which makes the outputs comparable token for token.
#
# ## 3. Three workloads, side by side
#
# Two engines, identical except for `speculative_config`, get the same prompts, greedy, one request
# at a time (batch 1), `k` = 4. They are stepped *in turn*, one step each, so that whatever else
# the machine is doing slows both alike. Only decode steps are timed (the prompt's prefill is the
# same work for both), and a step many times slower than its neighbours (another process took the
# CPU for a moment) is capped, so that such a moment does not decide the result
# ([`course/lab06.py`](course/lab06.py), `compare`).
#
# The workloads (after `benchmarks/bench_spec.py`):

# %%
for w in ex.WORKLOADS:
    print(f"{w:5s} {ex.WORKLOAD_TEXT[w]}")
example = ex.conversations("copy", 1)[0][0]["content"]
print("\nA copy prompt:\n" + example[:400] + (" [...]" if len(example) > 400 else ""))

# %% [markdown]
# **What to look for:** the live board's left panel counts the tokens decoded against the target
# steps (forward passes) taken, for the request in flight. Plain decoding climbs one token per step.
# On copy and code the speculative curve climbs in jumps of several tokens and needs far fewer
# steps. On chat the two curves nearly coincide: lookup finds short matches (a common word seen
# before), but what followed them there is rarely what comes next, so its verify steps bring almost
# nothing. The right panel adds each workload's speed-up, which is measured in time: fewer steps pay
# only if each step does not cost too much more, and on chat the verify steps are pure cost.

# %%
params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
board = ex.Board(f"three workloads, k = {K}, batch 1")
with lab.LoadProbe() as section3_probe:          # other processes' CPU use while it runs
    by_workload = {w: ex.compare(plain, spec, ex.prompt_ids(tok, w, GROUPS), params, workload=w,
                                 board=board) for w in ex.WORKLOADS}
board.finish()
workload_table = ex.table(by_workload.values()).set_index("workload")
workload_table.round(3)

# %% [markdown]
# The columns: **acceptance rate** is vLLM's, accepted tokens over draft tokens
# (`vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_draft_tokens`); **mean accepted
# length** is vLLM's too, `1 + accepted / drafts`: tokens per step *that verified something*;
# **tokens per target step** counts every decode step, including those where lookup found nothing
# (one token); **steps with drafts** is the share of steps that verified proposals; **verify cost**
# is how long a verify step took, in plain steps (medians); **speed-up** is decode tokens per second,
# speculative over plain.

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.3))
colors = ["tab:blue", "tab:orange", "tab:gray"]
for ax, col, title in zip(axes, ["acceptance rate", "tokens per target step", "speed-up"],
                          ["acceptance rate", "tokens per target step", "decode speed-up (x)"]):
    ax.bar(workload_table.index, workload_table[col].fillna(0), color=colors)
    ax.set_title(title)
axes[1].axhline(1, color="black", lw=0.8)
axes[2].axhline(1, color="black", lw=0.8)
wt = workload_table
pays = bool(wt.loc["copy", "speed-up"] > 1 and wt.loc["copy", "speed-up"] > wt.loc["chat", "speed-up"])
fig.suptitle("Speculation pays where the answer repeats the prompt" if pays else
             "Does speculation pay where the answer repeats the prompt?", fontsize=11)
fig.tight_layout()
plt.show()
lab.lesson("06-copy-pays", "speculation pays where the answer repeats the prompt: at batch 1 copy "
           "decodes faster with it than without, and gains more than chat",
           shown=pays,
           evidence=f"Decode speed-up {wt.loc['copy', 'speed-up']:.2f}x on copy "
                    f"({wt.loc['copy', 'tokens per target step']:.2f} tokens per target step), "
                    f"{wt.loc['chat', 'speed-up']:.2f}x on chat "
                    f"({wt.loc['chat', 'tokens per target step']:.2f})",
           load=section3_probe.load)
print(f"Copy: {wt.loc['copy', 'tokens per target step']:.2f} tokens per target step and "
      f"{wt.loc['copy', 'speed-up']:.2f}x; code: {wt.loc['code', 'tokens per target step']:.2f} and "
      f"{wt.loc['code', 'speed-up']:.2f}x; chat: {wt.loc['chat', 'tokens per target step']:.2f} and "
      f"{wt.loc['chat', 'speed-up']:.2f}x (drafts in {wt.loc['chat', 'steps with drafts']:.0%} of its steps).")
c_copy, roof_1 = wt.loc["copy", "verify cost (plain steps)"], roof.iloc[0]["verify cost (plain steps)"]
print(f"A verify step with k = {K} cost {c_copy:.2f} plain steps on copy: "
      f"{'less' if c_copy < K + 1 else 'more'} than the {K + 1} steps it can replace, and "
      f"{'more' if c_copy > roof_1 else 'less'} than the roofline's bound of {roof_1:.2f}.")
if note := ex.contention_note(workload_table, K):
    print(note)

# %% [markdown]
# **Exercise 1.** Speculation verified many proposals above and refused some of them. Did it change
# any of the greedy outputs? Answer `"same"` or `"different"`. (The check also compares the outputs
# themselves: if the engine ever got this wrong, it says so.)

# %%
outputs_verdict = None  # your answer: "same" or "different"

# %%
q1 = ex.q1_identical(by_workload.values())
q1.check(outputs_verdict)
# q1.hint()
# q1.solution()

# %% [markdown]
# **Exercise 2.** Which workload gets the most tokens out of each pass of the target model (and so,
# at batch 1, the largest speed-up)? Answer `"copy"`, `"code"` or `"chat"`.

# %%
best_workload = None  # your answer: "copy", "code" or "chat"

# %%
q2 = ex.q2_best_workload(by_workload.values())
q2.check(best_workload)
# q2.hint()
# q2.solution()

# %% [markdown]
# ## 4. A model of the speed-up
#
# Two things decide the speed-up: how many tokens a verify step yields, and what it costs. Suppose
# each proposal is right with probability `a`, independently of the others. A verify step always
# yields the model's own token; the first proposal adds one more with probability `a`; the second
# only if the first was kept too, `a²`; and so on up to the `k`-th. The expected number of tokens per
# verify step, `E(a, k)`, is the sum of those `k + 1` terms. If a verify step takes `c` times as long as
# a plain step (which yields one token), the speed-up is about `E(a, k) / c`.
#
# **Exercise 3.** Write `tokens_per_step(a, k)`, the expected tokens per verify step. The check calls
# it on this run's acceptance rates and on a few other cases, including `a = 1`.

# %%
tokens_per_step = None  # your answer: a function, e.g.
# def tokens_per_step(a, k):
#     ...

# %%
q3 = ex.q3_tokens_per_step({w: p.acceptance_rate for w, p in by_workload.items()})
q3.check(tokens_per_step)
# q3.hint()
# q3.solution()

# %% [markdown]
# **Exercise 4.** Predict the copy workload's speed-up from three numbers this run measured: its
# acceptance rate `a`, `k`, and the cost `c` of a verify step in plain steps (both printed below).
# After the check, the notebook holds your prediction against the speed-up the run measured.

# %%
copy = by_workload["copy"]
a, c = round(copy.acceptance_rate, 3), round(copy.cost_ratio, 3)
print(f"copy workload: a = {a}, k = {K}, c = {c} (a verify step took {c} plain steps)")
speedup_predicted = None  # your answer: the speed-up, a number like 1.5

# %%
q4 = ex.q4_speedup(a, K, c, copy.speedup, copy.tokens_per_step)
q4.check(speedup_predicted)
# q4.hint()
# q4.solution()

# %% [markdown]
# ## 5. More guesses per step: k = 2, 4, 6
#
# The same comparison on copy and code with `k` = 2 and 6 (one new engine for each `k`; `k` = 4 is
# section 3's). Only `k` changes.
#
# **What to look for:** a larger `k` can yield more tokens per step when the guesses are good, but
# later guesses are riskier (the acceptance rate drops) and a verify step has more rows to compute
# (its cost rises). The speed-up grows less than `k` does, and may stop growing.

# %%
k_pairs = [by_workload["copy"], by_workload["code"]]
board_k = ex.Board("copy and code for k = 2, 4, 6, batch 1")
for pair in k_pairs:
    board_k.add(pair)
for k in [v for v in K_VALUES if v != K]:
    spec_k = ex.make_engine(P, k=k, **ENGINE)
    for w in ("copy", "code"):
        k_pairs.append(ex.compare(plain, spec_k, ex.prompt_ids(tok, w, GROUPS), params, workload=w,
                                  board=board_k))
    if k == K_BATCH:
        spec_deep = spec_k   # kept for section 7
    del spec_k
    gc.collect()
board_k.finish()
k_table = ex.table(k_pairs).sort_values(["workload", "k"]).reset_index(drop=True)
k_table.round(3)

# %%
fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
for w, color in (("copy", "tab:blue"), ("code", "tab:orange")):
    t = k_table[k_table.workload == w]
    for ax, col in zip(axes, ["acceptance rate", "tokens per target step", "verify cost (plain steps)",
                              "speed-up"]):
        ax.plot(t.k, t[col], marker="o", color=color, label=w)
        ax.set(title=col, xlabel="k (proposals per step)", xticks=K_VALUES)
axes[0].legend()
ct = k_table[k_table.workload == "copy"].set_index("k")
more_k = bool((ct["tokens per target step"].diff().dropna() > 0).all()
              and (ct["verify cost (plain steps)"].diff().dropna() > 0).all())
fig.suptitle("More guesses per step: more tokens when they are right, a dearer step always" if more_k else
             "More guesses per step: do they bring more tokens, and a dearer step?", fontsize=11)
fig.tight_layout()
plt.show()
best_k = int(ct["speed-up"].idxmax())
print(f"Copy: acceptance {ct['acceptance rate'].iloc[0]:.2f} at k = {K_VALUES[0]} and "
      f"{ct['acceptance rate'].iloc[-1]:.2f} at k = {K_VALUES[-1]}; tokens per target step from "
      f"{ct['tokens per target step'].iloc[0]:.2f} to {ct['tokens per target step'].iloc[-1]:.2f}; "
      f"verify cost from {ct['verify cost (plain steps)'].iloc[0]:.2f} to "
      f"{ct['verify cost (plain steps)'].iloc[-1]:.2f} plain steps; the best speed-up here was at "
      f"k = {best_k} ({ct['speed-up'].max():.2f}x).")

# %% [markdown]
# How good is the model of section 4? Each point below is one comparison of this lab (three
# workloads at `k` = 4, copy and code at each `k`), placed by the speed-up `E(a, k) / c` predicts from
# its own measured `a` and `c` against the speed-up it measured.
#
# The model makes two assumptions the run can check: that each guess is right independently, with
# the overall rate `a` (so a verify step yields `E(a, k)` tokens), and that every step has a
# proposal to verify. The table beside the figure holds, for each comparison, what the run measured
# instead: tokens per verify step (vLLM's mean accepted length) and the share of steps with drafts.
#
# **What to look for:** points on the diagonal are predicted well. A point far off it broke one of the
# two assumptions, and the sentence under the table says which, from those columns.

# %%
pairs_all = list(by_workload.values()) + [p for p in k_pairs if p.k != K]
pred = ex.model_gaps(pairs_all)                 # course/lab06_model.py: the model and what it assumed
fig, ax = plt.subplots(figsize=(5.2, 4.2))
for w, color in (("copy", "tab:blue"), ("code", "tab:orange"), ("chat", "tab:gray")):
    t = pred[pred.workload == w]
    ax.scatter(t.predicted, t.measured, color=color, label=w, s=40)
    ax.scatter(t.refined, t.measured, color=color, s=40, facecolors="none")
top = max(pred.predicted.max(), pred.refined.max(), pred.measured.max(), 1.0) * 1.1
ax.plot([0, top], [0, top], color="black", lw=0.8)
ax.scatter([], [], color="black", s=40, facecolors="none",
           label="with the measured tokens\nper verify step and drafts")
ax.set(xlim=(0, top), ylim=(0, top), xlabel="predicted speed-up", ylabel="measured speed-up",
       title="The model E(a, k) / c against the run")
ax.legend(fontsize=8)
plt.show()
display(pred[["comparison", "predicted", "measured", "error", "E(a, k)", "tokens per verify step",
              "steps with drafts", "refined", "refined error"]].round(3))
for sentence in ex.explain_gaps(pred):
    print(sentence + ".")

# %% [markdown]
# ## 6. Where in a draft the guesses fail
#
# `vllm:spec_decode_num_accepted_tokens_per_pos` counts, for each position `i` of a draft, the drafts
# whose first `i` proposals were all accepted. Divided by the number of drafts it gives the share of
# drafts that got that far; divided by the count at the previous position it gives the chance that
# proposal `i` is right *once all before it were*. `engine.snapshot()` sums a counter over its labels,
# so `ex.spec_counters` reads the positions from the Prometheus registry itself.
#
# **What to look for:** if each guess were right independently with the overall rate `a`, the share
# reaching position `i` would fall as `a^i` and the conditional chance would stay at `a`. Prompt
# lookup is not like that: when a copy is under way the next guess is very likely right too, and when
# it is off, it is off from the first position.

# %%
deep = next(p for p in k_pairs if p.workload == "copy" and p.k == max(K_VALUES))
pos = ex.per_position(deep)
fig, ax = plt.subplots(figsize=(8, 3.4))
ax.plot(pos.position, pos.reached, marker="o", label="share of drafts that reached position i (measured)")
ax.plot(pos.position, pos.conditional, marker="s", label="chance that proposal i is right, given all before it were")
ax.plot(pos.position, pos.independent, ls="--", color="tab:gray", label="independent guesses: a^i")
ax.set(xlabel="position in the draft (i)", ylabel="fraction", ylim=(0, 1.05), xticks=pos.position,
       title=f"copy, k = {deep.k}: accepted tokens by position")
ax.legend(fontsize=8, loc="lower left")
plt.show()
c_deep = deep.counters()
print(f"{int(c_deep['drafts'])} drafts. The first proposal was right in {pos.reached.iloc[0]:.0%} of them; "
      f"once the first {deep.k - 1} were right, the last was right in {pos.conditional.iloc[-1]:.0%} of "
      f"cases, against the overall rate a = {deep.acceptance_rate:.2f}. Independent guesses at that rate "
      f"would reach position {deep.k} in {pos.independent.iloc[-1]:.0%} of drafts; the run did in "
      f"{pos.reached.iloc[-1]:.0%}.")
pos.round(3)

# %% [markdown]
# ## 7. Batch size: where speculation stops paying
#
# Now several requests decode together, on copy prompts cut to their first two sentences (shorter
# prompts keep the large batches quick), with the `k` = 6 engine of section 5: its verify steps carry
# the most extra rows, so the turn comes within batch sizes this CPU runs in a minute. Each batch
# size is one group of requests added at once to both engines. Only the batch size changes from run
# to run.
#
# **What to look for:** as the batch grows, a plain step gets more rows and stops being memory-bound,
# and a verify step has up to `k + 1` times as many. The measured verify cost (timed at the full
# batch) should rise with the batch while the tokens per target step stay about the same, so the
# speed-up falls towards 1, and below it once the extra rows cost more than they bring. The roofline
# (dashed) prices every row at one measured matmul rate; the engine's kernels do more work per second
# as a step gets more rows, so expect the measured cost to rise later and less steeply than the
# roofline's, in the same direction.

# %%
batch_params = SamplingParams(temperature=0, max_tokens=BATCH_TOKENS)
board_b = ex.Board(f"copy, k = {K_BATCH}, by batch size", label=lambda p: f"batch {p.batch}")
with lab.LoadProbe() as batch_probe:
    batch_pairs = [ex.compare(plain, spec_deep, ex.prompt_ids(tok, "copy", b, sentences=2), batch_params,
                              batch=b, workload="copy", board=board_b) for b in BATCHES]
board_b.finish()
del spec_deep
gc.collect()
roof_b, _ = ex.roofline_costs(P.model, BATCHES, K_BATCH)
batch_table = ex.table(batch_pairs)
batch_table["roofline verify cost"] = roof_b["verify cost (plain steps)"].to_numpy()
batch_table[["batch", "speed-up", "tokens per target step", "verify cost (plain steps)", "roofline verify cost",
             "acceptance rate", "plain tok/s", "spec tok/s", "identical"]].round(3)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6))
bt = batch_table
ax1.plot(bt.batch, bt["speed-up"], marker="o", color="tab:blue")
ax1.axhline(1, color="black", lw=0.8)
falls = bool(bt["speed-up"].iloc[-1] < bt["speed-up"].iloc[0])
stops = bool(falls and bt["speed-up"].iloc[-1] < 1)
ax1.set(xscale="log", xticks=BATCHES, xticklabels=BATCHES, xlabel="requests decoding together (batch)",
        ylabel="decode speed-up (x)",
        title="The speed-up falls as the batch grows" if falls else "Does the speed-up fall as the batch grows?")
ax2.plot(bt.batch, bt["verify cost (plain steps)"], marker="o", color="tab:red", label="verify cost, measured")
ax2.plot(bt.batch, bt["roofline verify cost"], ls="--", color="tab:red", label="verify cost, roofline")
ax2.plot(bt.batch, bt["tokens per target step"], marker="s", color="tab:green", label="tokens per target step")
rows_cost = bool(bt["verify cost (plain steps)"].iloc[-1] > bt["verify cost (plain steps)"].iloc[0])
ax2.set(xscale="log", xticks=BATCHES, xticklabels=BATCHES, xlabel="requests decoding together (batch)",
        ylabel="plain steps / tokens",
        title=("Extra rows stop being free; the tokens they bring do not grow" if rows_cost else
               "Do extra rows stop being free in a larger batch?"))
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()
first, last = bt.iloc[0], bt.iloc[-1]
print(f"Batch {int(first.batch)}: {first['speed-up']:.2f}x, a verify step cost {first['verify cost (plain steps)']:.2f} "
      f"plain steps. Batch {int(last.batch)}: {last['speed-up']:.2f}x, it cost "
      f"{last['verify cost (plain steps)']:.2f} (roofline {last['roofline verify cost']:.2f}) for "
      f"{last['tokens per target step']:.2f} tokens per request per step.")
note = ex.contention_note(batch_table, K_BATCH)
if note:
    print(note)
batch_lesson = lab.lesson(
    "06-large-batch", f"in a large batch speculation stops paying: the speed-up falls as the batch "
    f"grows, to below 1 at batch {int(last.batch)}",
    shown=stops,
    evidence=f"Speed-up {first['speed-up']:.2f}x at batch {int(first.batch)} and "
             f"{last['speed-up']:.2f}x at batch {int(last.batch)}, where a verify step cost "
             f"{last['verify cost (plain steps)']:.2f} plain steps for "
             f"{last['tokens per target step']:.2f} tokens",
    load=batch_probe.load, causes=[note] if note else None)

# %% [markdown]
# **Exercise 5.** At which batch size of this sweep did speculation first run *slower* than plain
# decoding (a speed-up below 1)? Answer with the batch size, or `"never"` if it paid at every one.

# %%
stops_at = None  # your answer: a batch size from BATCHES, or "never"

# %%
q5 = ex.q5_stops_paying(batch_table)
q5.check(stops_at)
# q5.hint()
# q5.solution()

# %% [markdown]
# This is what a server has to weigh: at low load, speculation shortens every request's decode; near
# capacity, the same arithmetic would serve more requests. The rows a verify step spends on refused
# guesses are pure waste then, and even the accepted ones cost about as much as decoding those
# tokens in a bigger batch.
#
# ## 8. The adaptive rule: speculate only while it pays
#
# The engine can decide for itself (`"adaptive": True` in `speculative_config`,
# [`spec/adaptive.py`](../minserve/spec/adaptive.py)). For each batch-size bucket it keeps two running
# estimates: output tokens per second of decode steps *with* proposals and of steps *without*, and
# proposes while the first is at least the second. Every 16 steps it tries the other choice once, so
# that a changed workload is noticed.
#
# An engine the same as section 3's except for `"adaptive": True` runs chat, and a fresh one runs
# copy (so that neither starts from the other's estimates), against plain decoding on the same
# prompts as in section 3. Only the rule differs.
#
# **What to look for:** without the rule (section 3), a good share of chat's steps verify guesses
# that are refused and cost a longer step each; with it, the engine should soon stop proposing on
# chat (apart from a probe every 16 steps). On copy, where proposals pay, it should keep most of them;
# whether it does depends on what its running estimates saw, and the cell after the figure says
# what they did here.

# %%
board_a = ex.Board(f"adaptive rule, k = {K}, batch 1",
                   label=lambda p: f"{p.workload}, {'adaptive' if p.adaptive else 'always'}")
runs_a = {(w, False): by_workload[w] for w in ("chat", "copy")}   # always proposing: section 3
for pair in runs_a.values():
    board_a.add(pair)
with lab.LoadProbe() as adaptive_probe:
    for w in ("chat", "copy"):
        spec_adaptive = ex.make_engine(P, k=K, adaptive=True, warm_batches=[1], **ENGINE)
        runs_a[w, True] = ex.compare(plain, spec_adaptive, ex.prompt_ids(tok, w, GROUPS), params,
                                     workload=w, board=board_a)
        del spec_adaptive
        gc.collect()
board_a.finish()
adaptive_table = ex.table([runs_a[w, a] for w in ("chat", "copy") for a in (False, True)])
adaptive_table[["workload", "adaptive", "speed-up", "steps with drafts", "acceptance rate",
                "tokens per target step", "verify cost (plain steps)", "identical"]].round(3)


# %%
def draft_steps(pair):
    d = pd.concat([r.decode for r in pair.spec], ignore_index=True)
    return d.num_spec_tokens.to_numpy() > 0, d.num_accepted_spec_tokens.to_numpy()

fig, axes = plt.subplots(4, 1, figsize=(12, 4.2))
for ax, key in zip(axes, [("chat", False), ("chat", True), ("copy", False), ("copy", True)]):
    has, acc = draft_steps(runs_a[key])
    idx = np.arange(len(has))
    ax.bar(idx[has & (acc == 0)], 1, width=1, color="tab:red", label="verified, nothing kept")
    ax.bar(idx[has & (acc > 0)], 1, width=1, color="tab:green", label="verified, some kept")
    ax.set(xlim=(-0.5, len(has) - 0.5), yticks=[])
    ax.set_ylabel(f"{key[0]}, {'adaptive' if key[1] else 'always'}", rotation=0, ha="right", va="center", fontsize=9)
axes[-1].set_xlabel("decode step of the speculative engine (its groups in turn; each row has its own scale)")
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, loc="upper right", ncol=2, fontsize=8)
chat_off, chat_on = runs_a["chat", False], runs_a["chat", True]
copy_off, copy_on = runs_a["copy", False], runs_a["copy", True]
drops_chat = bool(chat_on.draft_step_share < chat_off.draft_step_share)
fig.suptitle("Steps that verified proposals: the adaptive rule drops them on chat" if drops_chat else
             "Steps that verified proposals: does the adaptive rule drop them on chat?", fontsize=11, x=0.4)
fig.tight_layout(rect=(0, 0, 1, 0.93))
plt.show()
for w in ("chat", "copy"):
    off, on = runs_a[w, False], runs_a[w, True]
    print(f"{w}: drafts in {off.draft_step_share:.0%} of the steps without the rule and {on.draft_step_share:.0%} "
          f"with it; speed-up {off.speedup:.2f}x without, {on.speedup:.2f}x with.")
lab.lesson("06-adaptive-chat", "on chat, whose guesses are almost all refused, the adaptive rule "
           "proposes in fewer of the steps",
           shown=drops_chat,
           evidence=f"Chat drafted in {chat_on.draft_step_share:.0%} of the steps with the rule against "
                    f"{chat_off.draft_step_share:.0%} without (acceptance rate "
                    f"{chat_off.acceptance_rate:.2f}); speed-up {chat_on.speedup:.2f}x with, "
                    f"{chat_off.speedup:.2f}x without",
           load=adaptive_probe.load)
print(ex.adaptive_cost(copy_off, copy_on))

# %% [markdown]
# The rule judges by measured time, not by acceptance alone, so on a busy machine its choices move
# with the load, and a short run gives it few steps to learn from; its probes cost a little where
# speculation pays. Its estimates move a fifth of the way towards each new measurement, so when a
# server's traffic changes (chat after copy), the rule needs several probes, 16 steps apart, to
# change its mind. It matters wherever proposals exist but do not pay: a guesser that is often
# wrong, as on chat, and large batches (section 7).
#
# ## 9. Explore
#
# The panel runs one comparison with the settings you choose: workload, `k`, batch size, answer
# length, adaptive rule. It builds a speculative engine for a new `k` (a few seconds) and keeps it for
# the next run. Things to try: `k` = 1 on copy (how much of the gain does one guess give?); code at
# batch 8; chat with `k` = 7. In CI no button is pressed; the cell after it calls the same function
# directly.

# %%
explorer = ex.Explorer(P, plain, tok, engine_args=ENGINE)
explorer.adopt(spec, k=K, adaptive=False)   # section 3's engine: no reload for k = 4
ex.panel(explorer, k=K, max_tokens=min(MAX_TOKENS, 48))

# %%
explore = explorer.run("code", k=K, batch=2, max_tokens=min(MAX_TOKENS, 32))
print(f"code, batch 2: {explore.speedup:.2f}x, {explore.tokens_per_step:.2f} tokens per target step, "
      f"outputs identical: {explore.identical}.")

# %% [markdown]
# ## 10. Record your baseline

# %%
baseline = {
    "k": K,
    "by_workload": {w: {"speedup": round(p.speedup, 3), "acceptance_rate": round(p.acceptance_rate, 3),
                        "mean_accepted_len": round(p.mean_accepted_len, 3),
                        "tokens_per_target_step": round(p.tokens_per_step, 3),
                        "verify_cost_plain_steps": round(p.cost_ratio, 3)}
                    for w, p in by_workload.items()},
    "copy_by_k": {int(r.k): round(r["speed-up"], 3) for _, r in k_table[k_table.workload == "copy"].iterrows()},
    "copy_by_batch": {int(r.batch): round(r["speed-up"], 3) for _, r in batch_table.iterrows()},
    "stops_paying_at_batch": ex.stops_paying(batch_table),
    "copy_by_batch_k": K_BATCH,
    "chat_speedup": {"always": round(runs_a["chat", False].speedup, 3),
                     "adaptive": round(runs_a["chat", True].speedup, 3)},
    "greedy_outputs_identical": all(p.identical for p in pairs_all + batch_pairs + list(runs_a.values())),
    "plain_decode_tok_per_s_batch1": round(by_workload["copy"].row()["plain tok/s"], 2),
}
baseline_path = lab.record_baseline("06", baseline)
if lab01 and lab01.get("decode_tok_per_s_by_batch"):
    ref = lab01["decode_tok_per_s_by_batch"].get("1")
    if ref:
        print(f"\nLab 01 measured plain decoding at {ref:.0f} tokens/s at batch 1 here; this lab's plain "
              f"engine ran at {baseline['plain_decode_tok_per_s_batch1']:.0f}, and with speculation the copy "
              f"workload reached {by_workload['copy'].row()['spec tok/s']:.0f}.")

# %% [markdown]
# ## Summary
#
# - A decode step at batch 1 is bound by reading the weights, so a step that checks `k` guesses
#   (`k + 1` rows) costs far less than `k + 1` steps. Speculation spends that spare arithmetic to
#   take fewer sequential steps.
# - Verification never changes the output: a greedy request keeps guesses only where they equal the
#   model's own choice, and rejection sampling keeps a sampled request's distribution exactly the
#   model's. The guesser decides the speed, not the text.
# - Speed-up ≈ tokens per target step / cost of a verify step. With independent acceptance `a`, a
#   verify step yields `E(a, k) = (1 - a^(k+1)) / (1 - a)` tokens; section 5's table shows how far
#   prompt lookup's acceptance was from independent on this run, and how many steps had nothing to
#   verify.
# - Prompt lookup pays on copy-heavy work (editing, rewriting, code changes) and not on free chat.
#   Larger `k` brings more tokens while the guesses are good and a dearer step always.
# - In a large batch the step is compute-bound and the extra rows cost about what they bring:
#   speculation stops paying. The adaptive rule measures that and proposes only where its running
#   estimates say it pays, which on a shared machine move with the load.
#
# The lessons above, and the last cell, say which of these timing results this run showed on its own
# numbers. This run's numbers are above and in `labs/results/06.json`.
#
# ## Stretch goals
#
# - Ask for a match of at least two tokens (`ex.make_engine(P, k=K, prompt_lookup_min=2, **ENGINE)`,
#   as `benchmarks/bench_spec.py` does) and rerun section 3: what happens to chat's steps with
#   drafts and to copy's tokens per target step? Why can a one-token match help on copy and hurt
#   on chat?
# - Run section 7 with an adaptive engine (`ex.make_engine(P, k=K_BATCH, adaptive=True, **ENGINE)`):
#   does it turn speculation off at the batch sizes where it stopped paying, and give back the plain
#   speed there? And with `k` = 4 instead of 6, where does the turn come?
# - Sample instead of greedy (`SamplingParams(temperature=0.8, seed=...)`) on copy: how much lower is
#   the acceptance rate, and why (think of what the one-hot draft has to match)?
# - Use `ex.roofline_costs` with `hardware="h100"`: on that roofline, up to which batch size would a
#   verify step with `k = 4` stay almost free?
# - Propose with a draft model instead of lookup: `ex.make_engine(P, k=4, method="draft_model",
#   **ENGINE)` runs the model's own checkpoint in int4 as the draft (docs/engine/speculative.md, "Speculative
#   decoding"). Rerun section 3 with it: it proposes on chat too, where lookup finds nothing. Why is
#   its acceptance rate so high with this checkpoint (where did the checkpoint's weights come from?),
#   and how does the speed-up compare with what section 4's model predicts from that rate (what
#   does each proposal cost now)?

# %% [markdown]
# ## This run

# %%
run_summary = lab.summary("06")   # run time, the machine's load, the lessons this run showed
