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
# # Lab 04 — Prefix caching: reuse, savings, and a leak between tenants
#
# Much of what a production server is asked repeats at the *start* of the prompt: an agent's
# system prompt with its tool definitions, a company's policy preamble, the same retrieved document
# under several questions. The keys and values of those tokens are the same every time, so the
# engine can compute them once and reuse them. That is automatic prefix caching; it makes a repeated
# prefix almost free, and it only speeds up prefill (the answer is still generated token by token).
#
# It also makes timing depend on what *other* requests sent before. If tenants share the cache, the
# time to first token tells one tenant whether another tenant's prompt began with a given text. The
# second half of this lab mounts that attack and then closes it with per-tenant cache salts.
#
# **Goals.** By the end you will have:
#
# 1. predicted how many prompt tokens a request gets from the cache (whole blocks only);
# 2. measured cold against warm TTFT in repeated pairs, and the cache's queries, hits and hit rate
#    on a workload with a shared preamble against one with unique prompts;
# 3. seen why counting requests that hit is not the same as counting tokens saved;
# 4. used TTFT to learn which document another tenant sent, and confirmed the leak with a
#    two-sample test you can compute by hand;
# 5. closed the leak with a per-tenant `cache_salt` (in the engine, and over HTTP with two API keys).
#
# **Run time:** about 1 minute on a 2-core CPU in the `quick` preset (the default), quiet or busy:
# measured 0.8 min with other processes using half a core, and 0.8 min with a whole core taken by
# another process (`MINSERVE_LAB_CI=1`: 45 s and 70 s). The `full` preset
# (`MINSERVE_LAB_PRESET=full`) uses a 1,024-token system prompt, 32 requests of 1,024 tokens per
# workload and 16 probes per group, sized for a GPU box (not timed there yet). The last cell prints
# this run's time, how busy the machine was meanwhile, and which of the lab's four lessons the run
# showed.
#
# **On a busy machine.** The cache's token counts (queries, hits, tokens prefilled) are the
# engine's own counts: they come out the same however busy the machine is. The timings are not:
# each timing lesson below is checked on this run's numbers and says so plainly when the run did
# not show it, with the load it measured.
#
# **Against a server** (`MINSERVE_LAB_TARGET=http://host:port`, see the README's labs section):
# section 2's two workloads run over HTTP (client-side TTFT per request, the server's own prefix
# cache, which must be on, and its `vllm:prefix_cache_queries` / `_hits` counters read from its
# `/metrics`, which on a server with keys needs an admin key), and so does the explore panel. The
# cached-token counts of section 1, the step records of section 2 and its exercises 2 and 3, the
# timing attack and the salts of sections 3 and 4 (probes sent into the engine with a
# `cache_salt` each), section 5 (a server of its own with two tenants' keys, started here) and the
# baseline read or drive the engine in this notebook, and are skipped with one line each.
#
# **Prerequisites:** [Lab 00](00_tour.ipynb) (TTFT, engine steps) and
# [Lab 01](01_prefill_vs_decode.ipynb) (prefill cost grows with the prompt).
#
# **Source files:** [`engine/kv_cache.py`](../minserve/engine/kv_cache.py) (block hashes chained
# with the salt, `find_cached_prefix`, `cache_full_blocks`),
# [`engine/scheduler.py`](../minserve/engine/scheduler.py) (`_admit_waiting`: the lookup at
# admission and the query / hit counters), [`metrics/prometheus.py`](../minserve/metrics/prometheus.py)
# (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`),
# [`server/auth.py`](../minserve/server/auth.py) (`effective_salt`: the server's per-tenant salt),
# [`lab/prefix.py`](../minserve/lab/prefix.py) and [`lab/sidechannel.py`](../minserve/lab/sidechannel.py)
# (the workloads, the cold/warm pairs, the probes and the two-sample tests), and
# [`course/lab04.py`](course/lab04.py) (this lab's checks).

# %%
# Set-up check: what this notebook runs on (and quiet engine logs, shared figure style).
import math

import httpx
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from minserve import SamplingParams, lab
from minserve.lab import prefix as px
from minserve.lab import sidechannel as sc
from minserve.workshop.doctor import format_checks, run_checks
from course import lab04 as ex

P = lab.setup()
print(format_checks(run_checks(short=True), short=True))  # the short form of `minserve doctor`

# %%
# Sizes per preset: quick for a 2-core CPU, full for a GPU box.
SYSTEM_TOKENS, QUESTION_TOKENS = P.pick(quick=(256, 32), full=(1024, 64))            # section 1
N_REQ, PROMPT_TOKENS, OUT_TOKENS = P.pick(quick=(6, 256, 8), full=(32, 1024, 32))    # section 2
K, MEMO_TOKENS = P.pick(quick=(12, 96), full=(16, 512))         # section 3: probes per group, memo size
ALPHA = 0.01   # the significance level of every test in this lab
# Warm the engine up on the shapes this lab times (prefills of a question, a memo, a whole prompt,
# two prompts in one step; decode batches of 1 and of the workload), so no measurement pays for a
# first use.
llm = lab.engine_for(P, enable_prefix_caching=True,
                     warm_prompts=[8, QUESTION_TOKENS, MEMO_TOKENS, SYSTEM_TOKENS + QUESTION_TOKENS,
                                   2 * PROMPT_TOKENS],
                     warm_batches=[1, N_REQ])
tok = llm.get_tokenizer()
print(P.describe())
lab01 = lab.load_baseline("01")

# %%
# needs the engine: the engine's configuration (block size, KV pool)
eng = llm.llm_engine
BS = eng.config.block_size
print(f"KV cache: {eng.kv_spec.num_blocks} blocks of {BS} tokens, prefix caching on")

# %% [markdown]
# ## 1. How a prefix is found: whole blocks, chained
#
# The KV cache is cut into blocks of `block_size` tokens (`BS`, printed above). When a block of a prompt is full
# and computed, the engine files it under a key: a SHA-256 hash of the previous block's key, the
# block's own token ids, the model's fingerprint and the request's `cache_salt`. Because each key
# includes the one before it, a block matches only if *everything* before it matches too.
#
# When a new request is admitted, the scheduler walks its prompt block by block and stops at the
# first key it does not find. The blocks found join the request's block table; only the tokens after
# them are prefilled. Two details decide the count: a block that is only partly shared has a
# different key, and the last prompt token is always computed, because its logits give the first
# output token.
#
# Our agent, Atlas, starts every request with the same system prompt and tool definitions, then the
# user's question.

# %%
AGENT = (
    "You are Atlas, the support assistant of a small software company.\n"
    "Rules: answer in at most three sentences; name the manual section you used; never share one "
    "customer's data with another; call a tool when you need a fact you do not have.\n"
    "Tools (JSON schema):\n"
    '[{"name": "search_manual", "description": "full-text search in the product manual", '
    '"parameters": {"query": "string", "top_k": "integer"}},\n'
    ' {"name": "get_order", "description": "look up an order by its id", '
    '"parameters": {"order_id": "string"}},\n'
    ' {"name": "open_ticket", "description": "open a support ticket", '
    '"parameters": {"title": "string", "severity": "low | medium | high"}}]\n'
    "Manual excerpts:\n")
(first, second), system_prompt = px.shared_prefix_requests(
    tok, 2, SYSTEM_TOKENS + QUESTION_TOKENS, 8, SYSTEM_TOKENS, AGENT, seed=1, label="agent",
    seam="\n\nUser:")
ids1, ids2 = tok(first.prompt).input_ids, tok(second.prompt).input_ids
C = px.common_prefix_tokens(ids1, ids2)
print(system_prompt[:420] + " [...]\n")
print(f"Each request: {len(ids1)} prompt tokens. The system prompt with its tools is "
      f"{len(tok(system_prompt).input_ids)} tokens; the two requests share their first {C} token ids.")

# %% [markdown]
# **Exercise 1.** The first request runs alone on a cache that has never seen this system prompt.
# Then the second request runs. How many of the second request's prompt tokens will be served from
# the cache? Predict before running the cell after the next one. (It is a count, so it does not
# depend on how fast this machine is.)

# %%
# needs the engine: the engine's cached-token counts (exercise 1)
cached_predicted = None  # your prediction: a number of tokens

# %%
# needs the engine: the engine's cached-token counts (exercise 1)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
cold = llm.generate([first.prompt], params, use_tqdm=False)[0]
warm = llm.generate([second.prompt], params, use_tqdm=False)[0]
pair = pd.DataFrame({
    "prompt tokens": [len(o.prompt_token_ids) for o in (cold, warm)],
    "cached tokens": [o.num_cached_tokens for o in (cold, warm)],
    "prefilled tokens": [len(o.prompt_token_ids) - o.num_cached_tokens for o in (cold, warm)],
}, index=["first (cold)", "second (warm)"])
display(pair)

q1 = ex.q1_cached_tokens(C, BS, len(ids2), warm.num_cached_tokens)
q1.check(cached_predicted)
# q1.hint()
# q1.solution()

# %% [markdown]
# ### Timing it: cold against warm, in repeated pairs
#
# Fewer tokens to prefill should mean an earlier first token. One pair of requests is a weak
# measurement of that: on a shared machine one request can land in a busy second. So the next cell
# repeats the experiment in pairs, each pair a cold request on a system prompt the cache has never
# seen (its first line names the pair, so every block key is new) and a warm one right after it.
# The first pair is dropped (a warm-up), and pairs are added until the last three agree on the time
# the cache saved ([`lab/prefix.py`](../minserve/lab/prefix.py), `cold_warm_pairs`).
#
# **What to look for:** the warm request's TTFT well below the cold one's, in every kept pair.

# %%
# needs the engine: the engine's cached-token counts of cold and warm pairs
pairs, pair_cal = px.cold_warm_pairs(llm, tok, SYSTEM_TOKENS + QUESTION_TOKENS, SYSTEM_TOKENS, AGENT,
                                     seed=100, seam="\n\nUser:")
kept = pairs[pairs.kept]
cold_ms, warm_ms = 1000 * kept.cold_ttft_s.median(), 1000 * kept.warm_ttft_s.median()
display((pairs.assign(cold_ttft_ms=1000 * pairs.cold_ttft_s, warm_ttft_ms=1000 * pairs.warm_ttft_s)
         [["pair", "kept", "cold_ttft_ms", "warm_ttft_ms", "cold_prefilled", "warm_cached",
           "warm_prefilled"]].round(1)))
n_faster = int((kept.warm_ttft_s < kept.cold_ttft_s).sum())
lab.lesson("04-warm-ttft", "a request whose system prompt is already cached gets its first token sooner",
           shown=n_faster == len(kept) and warm_ms < cold_ms,
           evidence=f"medians of {len(kept)} pairs after a warm-up pair: cold {cold_ms:.0f} ms, warm "
                    f"{warm_ms:.0f} ms; the warm request was the faster one in {n_faster} of {len(kept)} pairs",
           load=pair_cal.load, calibration=pair_cal)
print(f"Cold TTFT {cold_ms:.0f} ms, warm {warm_ms:.0f} ms (medians): the warm request was "
      f"{ex.times_word(warm_ms, cold_ms)}.")
print(f"The engine's counts, the same on any machine: each warm request prefilled "
      f"{int(kept.warm_prefilled.median())} tokens instead of {int(kept.cold_prefilled.median())}, "
      f"taking {int(kept.warm_cached.median())} from the cache.")
if lab01 and lab01.get("prefill_tok_per_s"):
    rate = lab01["prefill_tok_per_s"]
    saved = int(kept.warm_cached.median())
    print(f"Lab 01 measured prefill at about {rate:.0f} tokens/s here: the {saved} cached tokens would "
          f"have cost about {1000 * saved / rate:.0f} ms; this run's pairs saved {cold_ms - warm_ms:.0f} ms.")

# %% [markdown]
# Run the exercise's request cell again and the *first* request is warm too: cached blocks stay after
# their request has finished (their reference count drops to zero, but they keep their key), until
# the space is needed and the least recently used ones are evicted.
#
# ## 2. A workload: a shared policy preamble against unique prompts
#
# An internal assistant puts the same policy preamble at the start of every request. Two runs with
# the same number of requests, the same prompt and output lengths and the same arrivals (all at
# once); the one difference is that in the first run the first 7/8 of each prompt is the shared
# preamble, and in the second every prompt is unique. Each run starts from a preamble the cache has
# not seen.
#
# **What to look for:** the queries counter (prompt tokens looked up) is the same in both runs; the
# hits counter is not. In the live figures, the shared run's TTFTs are lower and closer together.

# %%
POLICY = (
    "Example Corp internal assistant. Company policy, applied to every answer:\n"
    "1. Confidential material stays inside the company; never paste it into outside tools.\n"
    "2. Personal data goes only to people who need it for their work.\n"
    "3. When you refuse a request, quote the section of this policy that applies.\n"
    "4. Answers are short, factual and in plain language.\n"
    "Reference documents:\n")
SHARED = 7 / 8
runs, counters = {}, {}
for name, fraction in (("shared preamble", SHARED), ("unique prompts", 0.0)):
    before = px.cache_counters(llm)    # over HTTP: the server's /metrics
    runs[name] = px.prefix_experiment(P, num_requests=N_REQ, prompt_tokens=PROMPT_TOKENS,
                                      output_tokens=OUT_TOKENS, shared_fraction=fraction,
                                      preamble=POLICY, name=name)
    after = px.cache_counters(llm)
    counters[name] = {k: after[k] - before[k] for k in before}
shared_run, unique_run = runs["shared preamble"], runs["unique prompts"]

# %% [markdown]
# The engine's two Prometheus counters, read before and after each run, next to the same numbers
# summed from its step records (they must agree), the prompt tokens actually prefilled and the
# latency. Against a server the counters come from its `/metrics` (a shared server's count every
# participant's requests, so a neighbour's run can add to them) and there are no step records.

# %%
rows = {}
for name, run in runs.items():
    c = counters[name]
    row = {"vllm:prefix_cache_queries": c["queries"], "vllm:prefix_cache_hits": c["hits"],
           "prompt tokens prefilled": c["queries"] - c["hits"]}
    if run.in_process:   # the step records count the same tokens, step by step
        rep = px.cache_report(run)
        assert rep["queries"] == c["queries"] and rep["hits"] == c["hits"], \
            "the Prometheus counters and the step records disagree"
        row.update({"prompt tokens prefilled": rep["computed"],
                    "requests that hit": f"{rep['requests_with_hits']} of {rep['requests']}"})
    rows[name] = {**row, "median TTFT (ms)": 1000 * run.requests.ttft_s.median(),
                  "max TTFT (ms)": 1000 * run.requests.ttft_s.max()}
report = pd.DataFrame(rows).T
report

# %%
med_s, med_u = (1000 * run.requests.ttft_s.median() for run in runs.values())
busiest = max((r.load for r in runs.values() if r.load is not None),
              key=lambda l: l.others_cores or 0.0, default=None)
workload_shown = med_s < med_u
fig, ax = plt.subplots(figsize=(8, 3.4))
x = np.arange(N_REQ)
for k, (name, run) in enumerate(runs.items()):
    r = run.requests.reset_index(drop=True)
    ax.bar(x + (k - 0.5) * 0.4, 1000 * r.ttft_s, width=0.4, label=name)
ax.set(xlabel="request (in arrival order)", ylabel="TTFT (ms)",
       title=("TTFT per request: lower when the preamble is cached" if workload_shown else
              "TTFT per request: is it lower when the preamble is cached?"))
ax.set_xticks(x)
ax.legend()
plt.show()
lab.lesson("04-shared-workload", "with a shared preamble, the workload's median TTFT is lower than with "
           "unique prompts of the same length", shown=workload_shown,
           evidence=f"median TTFT {med_s:.0f} ms with the shared preamble, {med_u:.0f} ms with unique "
                    f"prompts, {N_REQ} requests of {PROMPT_TOKENS} tokens each",
           load=busiest)
print(f"Median TTFT: {med_s:.0f} ms with the shared preamble, {med_u:.0f} ms with unique prompts: the "
      f"shared run was {ex.times_word(med_s, med_u)}. The counters above are the engine's counts and "
      "do not depend on the machine's load.")

# %% [markdown]
# **Exercise 2.** In the shared-preamble run, how many prompt tokens did the cache save (tokens whose
# prefill was skipped)? The per-request table is below; `shared_run.steps` has the per-step counters.
#
# **Exercise 3.** What was the run's hit rate, in vLLM's sense (a fraction of prompt tokens)?

# %%
shared_run.requests[["request_id", "prompt_tokens", "cached_tokens", "queue_s", "ttft_s"]]

# %%
# needs the engine: the engine's cached-token counts (exercises 2 and 3)
tokens_saved = None  # your answer, in tokens
hit_rate = None      # your answer, a fraction between 0 and 1

# %%
# needs the engine: the engine's cached-token counts (exercises 2 and 3)
per_request_hit = int(shared_run.requests.cached_tokens.max())
q2 = ex.q2_tokens_saved(shared_run, per_request_hit)
q2.check(tokens_saved)
q3 = ex.q3_hit_rate(shared_run)
q3.check(hit_rate)
# q2.hint(); q3.hint()
# q2.solution(); q3.solution()

# %% [markdown]
# Where did the misses happen? Each bar below is one engine step of the shared run: prompt tokens it
# computed, and prompt tokens it took from the cache instead. Lookups happen when a request is
# *admitted*, and a block enters the cache only after the step that computed it. So every request
# admitted in the same step as the very first one found nothing yet.

# %%
# needs the engine: the engine's step records
st = shared_run.steps
pre = st[(st.num_prefill_tokens > 0) | (st.prefix_cache_hits > 0)].reset_index(drop=True)
first_then_hits = bool(len(pre) > 1 and pre.prefix_cache_hits.iloc[0] == 0
                       and pre.prefix_cache_hits.iloc[1:].sum() > 0)
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.bar(pre.index, pre.num_prefill_tokens, color="tab:orange", label="prompt tokens computed")
ax.bar(pre.index, pre.prefix_cache_hits, bottom=pre.num_prefill_tokens, color="tab:green",
       label="prompt tokens from the cache")
ax.set(xlabel="engine step with prompt work", ylabel="tokens",
       title=("The cache is filled by the first step and used from the next" if first_then_hits else
              "When does the cache start to serve this workload?"))
ax.set_xticks(pre.index)
ax.legend()
plt.show()
missed = shared_run.requests.query("cached_tokens == 0")
got = shared_run.requests.query("cached_tokens > 0").cached_tokens
got_text = (f"each got {int(got.iloc[0])} tokens" if got.nunique() == 1 else
            f"got {int(got.min())} to {int(got.max())} tokens") if len(got) else "found nothing either"
print(f"{len(missed)} of {N_REQ} requests found nothing in the cache: {', '.join(missed.request_id)}. "
      f"The first step with prompt work computed {int(pre.num_prefill_tokens.iloc[0])} prompt tokens "
      f"and found {int(pre.prefix_cache_hits.iloc[0])} in the cache. The others {got_text}.")

# %% [markdown]
# ## 3. The side channel: TTFT tells who sent what
#
# Now two tenants share the engine and, so far, one cache namespace. The legal team (the victim)
# pastes confidential board memos into its prompts. Another tenant (the attacker) knows what such
# memos look like and wants to know which ones the legal team has been working on. It cannot see
# their requests, but it can send its own and time them: a memo that somebody already sent comes back
# faster, because its blocks are in the cache.
#
# First a calibration, the way an attacker would check the method: the victim sends `K` memos; then
# the attacker sends, in random order, those `K` memos and `K` memos nobody sent, each once, each
# alone on the engine, and records the TTFT of each probe.
#
# **What to look for:** two clearly separated histograms, and a two-sample test that says the
# difference is far too large to be chance: a p-value below `ALPHA` (0.01, set at the top).

# %%
# needs the engine: probes sent into the engine, and its cached-token counts (section 3)
memos = [lab.text_of_length(tok, MEMO_TOKENS, seed=500 + i,
                            prefix=f"Memo {i:04d}, board only, strictly confidential.\n")
         for i in range(2 * K)]
sent, unsent = memos[:K], memos[K:]
with lab.LoadProbe() as leak_load:
    victim, probes = sc.timing_attack(llm, sent, unsent, seed=0)
hit = probes.loc[probes.group == sc.SENT, "ttft_s"]
miss = probes.loc[probes.group == sc.UNSENT, "ttft_s"]
leak_test = sc.two_sample_test(hit, miss, alpha=ALPHA)
probes.groupby("group")[["ttft_s", "cached_tokens"]].median()

# %%
# needs the engine: probes sent into the engine, and its cached-token counts (section 3)
hit_cached = probes.loc[probes.group == sc.SENT, "cached_tokens"]
miss_cached = probes.loc[probes.group == sc.UNSENT, "cached_tokens"]
leak_shown = leak_test.significant and hit.median() < miss.median()
ax = sc.plot_groups(probes, sc.SENT, sc.UNSENT, leak_test,
                    title=("Shared cache: probes of sent memos answer sooner" if leak_shown
                           else "Shared cache: do probes of sent memos answer sooner?"))
plt.show()
lab.lesson("04-leak", f"with one shared cache, TTFT tells which memos the victim sent (a two-sample test "
           f"significant at alpha = {ALPHA:g}, the sent memos' probes the faster)", shown=leak_shown,
           evidence=f"median TTFT of a probe {1000 * hit.median():.0f} ms if the victim had sent the memo, "
                    f"{1000 * miss.median():.0f} ms if nobody had; {leak_test}",
           load=leak_load.load, causes=ex.leak_causes(hit, miss, hit_cached))
mw = sc.two_sample_test(hit, miss, alpha=ALPHA, method="mann-whitney")
print(f"Median TTFT of a probe: {1000 * hit.median():.0f} ms if the victim had sent the memo, "
      f"{1000 * miss.median():.0f} ms if nobody had ({ex.times_word(hit.median(), miss.median())}). "
      f"{leak_test}. The Mann-Whitney test "
      f"{'agrees' if mw.significant == leak_test.significant else 'disagrees'}: p = {mw.p_value:.2g}, "
      f"{'' if mw.significant else 'not '}significant at alpha = {ALPHA:g}.")
print(f"The engine's counts, the same on any machine: every probe of a sent memo found "
      f"{int(hit_cached.min())} to {int(hit_cached.max())} of its tokens in the cache; the probes of "
      f"unsent memos found {int(miss_cached.sum())} in all.")

# %% [markdown]
# Why a test, and which one: the attacker only has a handful of noisy timings. A two-sample test asks
# how often a difference at least this large would appear if both groups came from one distribution.
# The permutation test ([`lab/sidechannel.py`](../minserve/lab/sidechannel.py)) answers by
# shuffling the group labels thousands of times; the Mann-Whitney U test uses ranks only, so one
# probe that happened to be slow (another process took the CPU) cannot drag the result. Below
# `ALPHA` = 0.01 we call the difference significant; every test in this lab uses that level.
#
# **Exercise 4.** The legal team has sent one memo about an acquisition; the attacker knows it is
# about one of four companies. The next cell lets the victim send its memo (the choice is hidden in
# `secret`; no peeking), then probes each of the four candidates once. Which company is it?

# %%
# needs the engine: probes sent into the engine, and its cached-token counts (section 3)
candidates = ["Heron", "Kestrel", "Osprey", "Plover"]
secret = candidates[np.random.default_rng(20240).integers(4)]   # the victim's choice
memo_for = {c: lab.text_of_length(tok, MEMO_TOKENS, seed=77,
                                  prefix=f"{c} acquisition plan, board only, strictly confidential.\n")
            for c in candidates}
sc.probe(llm, [sc.Probe(memo_for[secret] + "\n\nList the three biggest risks.", tenant="victim",
                        max_tokens=2)], live=False)
guess_probes = sc.probe(llm, [sc.Probe(memo_for[c] + "\nTL;DR:", tenant="attacker")
                              for c in candidates], title="attacker probes four candidates")
guess = ex.guess_table(guess_probes, candidates)
guess[["candidate", "TTFT (ms)"]].round(0)

# %%
# needs the engine: probes sent into the engine, and its cached-token counts (section 3)
acquisition_target = None  # your answer: one of "Heron", "Kestrel", "Osprey", "Plover"

# %%
# needs the engine: probes sent into the engine, and its cached-token counts (section 3)
q4 = ex.q4_which_memo(guess, secret)
q4.check(acquisition_target)
# q4.hint()
# q4.solution()

# %% [markdown]
# **Exercise 5.** Write the Mann-Whitney statistic yourself: `U(a, b)` is the number of pairs
# (x from `a`, y from `b`) with x > y, where a tie counts one half. The check calls your function on
# this run's hit and miss timings (ms) and on a small case with ties. (With `U` near 0 for the hits,
# almost every hit probe was faster than every miss probe.)

# %%
u_stat = None  # your answer: a function, e.g.
# def u_stat(a, b):
#     ...  # the number of pairs (x in a, y in b) with x > y, a tie counting 1/2

# %%
# needs the engine: the probe times of section 3
q5 = ex.q5_u_statistic(1000 * hit, 1000 * miss)
q5.check(u_stat)
# q5.hint()
# q5.solution()

# %% [markdown]
# ## 4. Closing the leak: a salt per tenant
#
# `cache_salt` is part of every block key, so two requests with different salts never share a block,
# even for identical text. Give each tenant its own salt and the attacker can only ever hit blocks
# its own requests computed. Same experiment, same memos, same order; the one difference is the two
# salts.
#
# **What to look for:** no probe finds anything in the cache, the histograms overlap, and the test
# is no longer significant at `ALPHA`.

# %%
# needs the engine: probes sent into the engine with a salt each (section 4)
with lab.LoadProbe() as salted_load:
    victim_salted, salted = sc.timing_attack(llm, sent, unsent, victim_salt="tenant-legal",
                                             attacker_salt="tenant-other", seed=0)
s_hit = salted.loc[salted.group == sc.SENT, "ttft_s"]
s_miss = salted.loc[salted.group == sc.UNSENT, "ttft_s"]
salted_test = sc.two_sample_test(s_hit, s_miss, alpha=ALPHA)
cross_hits = int(salted.cached_tokens.sum())
assert cross_hits == 0, "with different salts no attacker probe may find a cached block"
ax = sc.plot_groups(salted, sc.SENT, sc.UNSENT, salted_test,
                    title=("One salt per tenant: sent and unsent memos look alike" if not salted_test.significant
                           else "One salt per tenant: do sent and unsent memos still differ?"))
plt.show()
lab.lesson("04-salt", f"with a salt per tenant, TTFT no longer tells sent from unsent memos (the test is not "
           f"significant at alpha = {ALPHA:g})", shown=not salted_test.significant,
           evidence=f"median TTFT {1000 * s_hit.median():.0f} ms (sent) vs {1000 * s_miss.median():.0f} ms "
                    f"(not sent); {salted_test}",
           load=salted_load.load,
           causes=[f"no block was shared ({cross_hits} cached tokens found by the attacker), so this is a "
                   f"false alarm: a test at alpha = {ALPHA:g} gives one in {1 / ALPHA:.0f} runs even when "
                   "both groups are timed alike"])
print(f"The engine's count, the same on any machine: the attacker's probes found {cross_hits} cached "
      f"tokens. Median TTFT: {1000 * s_hit.median():.0f} ms (sent) vs {1000 * s_miss.median():.0f} ms "
      f"(not sent). {salted_test}.")

# %% [markdown]
# **Exercise 6.** With per-tenant salts, does the timing still leak which memos the victim sent?
# Answer `"leak"` or `"no leak"`.

# %%
# needs the engine: probes sent into the engine with a salt each (section 4)
salted_verdict = None  # your answer: "leak" or "no leak"

# %%
# needs the engine: probes sent into the engine with a salt each (section 4)
q6 = ex.q6_salted(salted, salted_test)
q6.check(salted_verdict)
# q6.hint()
# q6.solution()

# %% [markdown]
# A significance level is a promise about false alarms: with identical distributions, a test at
# `ALPHA` = 0.01 still flags one run in a hundred. That is why the check above decides by the
# mechanism (no block was shared) and reads the test as evidence.
#
# ## 5. Over HTTP: the server salts by tenant for you
#
# `minserve serve` never hands a client's `cache_salt` to the engine as it is. It passes
# `effective_salt(tenant, cache_salt)`, a digest of the tenant (from the API key) and the client's
# salt ([`server/auth.py`](../minserve/server/auth.py)), so tenants are isolated even when clients
# send no salt at all, and copying another tenant's salt gets nothing. It also keeps `/metrics` for
# admin keys: the hit counters move when *anyone* hits the cache, which is the same side channel in
# another form.
#
# The next cell starts the real app in this notebook (`lab.local_server.serve`, uvicorn on a free
# local port) with two API keys, then asks for one memo three times and reads
# `usage.prompt_tokens_details.cached_tokens` from each reply.

# %%
# needs the engine: a server of its own, with two tenants' API keys (section 5)
from minserve.server import Auth, Principal

keys = {"sk-legal": Principal("legal"), "sk-other": Principal("other")}
memo = lab.text_of_length(tok, MEMO_TOKENS, seed=901, prefix="Memo 9001, board only, strictly confidential.\n")
with lab.local_server.serve(llm, auth=Auth(keys)) as srv:
    def cached(key, prompt):
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": srv.model_name, "prompt": prompt, "max_tokens": 1})
        r.raise_for_status()
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    http_rows = [("legal", "sends the memo", cached("sk-legal", memo + "\n\nSummarize it.")),
                 ("other", "probes the same memo", cached("sk-other", memo + "\nTL;DR:")),
                 ("legal", "asks about it again", cached("sk-legal", memo + "\nTL;DR:"))]
http_demo = pd.DataFrame(http_rows, columns=["tenant (API key)", "request", "cached tokens"])
assert http_demo["cached tokens"][1] == 0 and http_demo["cached tokens"][2] > 0
display(http_demo)
print(f"The other tenant's probe found {http_demo['cached tokens'][1]} cached tokens; the legal team's "
      f"own second request found {http_demo['cached tokens'][2]}.")

# %% [markdown]
# ## 6. Explore
#
# The panel runs `lab.prefix.prefix_experiment`, the function section 2 called, with the values on
# its sliders (rate, concurrency, prompt and output length, engine sizes) and a fixed share of each
# prompt taken by the preamble. Things to try: the same workload at 2 requests/s instead of all at
# once (do the early misses disappear?); a KV budget so small that the preamble's blocks get evicted
# between requests. In CI no button is pressed; the cell after it calls the function directly.

# %%
panel = lab.control_panel(run=px.prefix_experiment, preset=P,
                          engine_args=dict(enable_prefix_caching=True, shared_fraction=SHARED,
                                           preamble=POLICY),
                          num_requests=N_REQ, prompt_tokens=PROMPT_TOKENS, output_tokens=OUT_TOKENS)
panel

# %%
explore = px.prefix_experiment(P, num_requests=4, request_rate=4.0, prompt_tokens=PROMPT_TOKENS,
                               output_tokens=OUT_TOKENS, shared_fraction=SHARED, preamble=POLICY,
                               live=False)
if lab.needs_engine("the engine's step records (the explore run's hit rate)"):
    explore_rep = px.cache_report(explore)
    print(f"At 4 requests/s: {explore_rep['requests_with_hits']} of {explore_rep['requests']} requests "
          f"hit, hit rate {explore_rep['hit_rate']:.2f}.")
explore.percentiles()

# %% [markdown]
# ## 7. Record your baseline

# %%
# needs the engine: the engine's records of sections 1 to 4 (the baseline)
baseline = {
    "agent_cold_ttft_ms": round(cold_ms, 1),      # medians of the kept cold/warm pairs
    "agent_warm_ttft_ms": round(warm_ms, 1),
    "agent_ttft_pairs": int(len(kept)),
    "agent_cached_tokens": int(warm.num_cached_tokens),
    "workload": {name: {"queries": int(counters[name]["queries"]), "hits": int(counters[name]["hits"]),
                        "median_ttft_ms": round(1000 * run.requests.ttft_s.median(), 1)}
                 for name, run in runs.items()},
    "shared_hit_rate": round(px.cache_report(shared_run)["hit_rate"], 3),
    "probe_ttft_ms": {"hit": round(1000 * hit.median(), 1), "miss": round(1000 * miss.median(), 1)},
    "leak_p_value": leak_test.p_value,
    "salted_p_value": salted_test.p_value,
    "salted_cross_tenant_hits": cross_hits,
    "alpha": ALPHA,
}
baseline_path = lab.record_baseline("04", baseline)
if lab01 and lab01.get("prefill_tok_per_s"):
    fixed_ms = lab01.get("prefill_fixed_ms", 0.0)
    predicted = fixed_ms + 1000 * len(cold.prompt_token_ids) / lab01["prefill_tok_per_s"]
    print(f"\nLab 01's prefill line (fixed cost + tokens / speed) predicts {predicted:.0f} ms for the "
          f"cold agent request; the pairs' median was {cold_ms:.0f} ms. The warm one, {warm_ms:.0f} ms, "
          f"paid for {len(warm.prompt_token_ids) - warm.num_cached_tokens} tokens only.")

# %% [markdown]
# ## Summary
#
# - The prefix cache works in whole blocks keyed by everything before them, so a request reuses the
#   longest run of full blocks it shares with what was computed before; a partly shared block is
#   computed again, and so is the last prompt token.
# - A hit skips prefill, so it cuts prefill work, and with it TTFT when the machine gives the
#   request its share of the CPU; it does nothing for the decode that follows. The token counts
#   hold on any machine; the time saved is a measurement (the lessons above say what this run saw).
# - Measure the benefit in tokens: `vllm:prefix_cache_hits / vllm:prefix_cache_queries`. Requests
#   admitted together with the first one find nothing yet, because blocks are published only once
#   computed.
# - A shared cache is a timing side channel: TTFT says whether a prefix was already there. A
#   two-sample test at a level fixed beforehand (`ALPHA`) says whether a handful of probes is enough
#   to tell.
# - A per-tenant `cache_salt` closes it: different salts never share a block. `minserve serve` does
#   this by default (salt bound to the API key's tenant) and restricts `/metrics` to admin keys.
#
# This run's numbers are above and in `labs/results/04.json`.
#
# ## Stretch goals
#
# - Rerun section 2 with `enable_prefix_caching=False` passed to `px.prefix_experiment` (the same
#   workloads on an engine without the cache): which numbers in the report change, and which stay?
# - How few probes does the attacker need? Rerun section 3 with `K = 3` and `K = 5`: at what point
#   does the test stop being significant at `ALPHA`, even without salts?
# - Make the memos share a 64-token public header before the confidential part. What do the
#   attacker's probes of unsent memos now find in the cache, and does the leak survive?
# - Run the HTTP cell with a single API key for both tenants (`Auth({"sk-shared": Principal("team")})`):
#   the two "tenants" now share a cache. When is that what you want?

# %% [markdown]
# ## This run

# %%
run_summary = lab.summary("04")
