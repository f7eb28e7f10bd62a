"""Every weight format side by side in one run: bytes, KV capacity, prefill and decode speed, where
each step's time goes, and llama.cpp on the same GGUF at batch 1.

    .venv/bin/python benchmarks/bench_quant.py            # every row, 5 interleaved repetitions
    .venv/bin/python benchmarks/bench_quant.py --quick    # smoke run: 4 rows, 1 repetition, short runs
    .venv/bin/python benchmarks/bench_quant.py --rows fp32,int4,"int4 kv=int8"

Rows (ROWS): fp32, int8, int4 with groups of 32 / 64 / 128 (``fallback``: 64 where 128 does not
divide), int4-awq, the int8 KV cache beside fp32 and int4, and int8 / int4 with int8 activations
(``a8``: ``quantization_config={"activations": "int8"}``, minserve/quant/activations.py). Every engine is built first; then
each repetition measures every row in turn, so each ratio compares timings from the same moments
of a shared, noisy host, and the table gives medians. Per row:
- *weight MiB*: resident and streamed per decode step (``runner.weight_footprint()``);
- *KV tokens at the budget*: what ``--memory-budget`` leaves beside the resident weights, in tokens
  of this row's KV dtype (``kv_budget_within``, as ``memory_budget=`` and ``minserve plan`` do);
- *prefill tok/s*: one ``--prefill-tokens`` prompt, ``max_tokens=1``, prefix caching off;
- *batch-1 / batch-16 decode tok/s*: ``--prompt-tokens`` prompts, then ``--decode-steps`` decode
  steps of the engine (fused C path), timed from the step after the last prefill; tokens / time;
- ratios against fp32 from the same repetition, then the median.
Targets (issue 11, ratios in one run): batch-1 decode int8 >= 2.5x and int4 >= 3.5x fp32; prefill
with quantized weights >= 0.8x fp32; batch-16 decode int4 >= 2x fp32; int4 >= 1.0x llama.cpp.

Where the time goes: the engine's own fused decoder runs steps of 1 and 16 rows at ``--context``
tokens with its per-part clock on (decode.c's ms_step_profile): block weight matmuls, LM head,
attention, the rest. Each part's bytes (weights: the descriptors' bytes; attention: the KV entries
read) divided by its time gives GB/s, compared with the machine's read bandwidth measured in the
same run; at batch 16 the weight part's multiply-adds per second are given too. A part that moves
bytes near the bandwidth is bandwidth-bound; one far below it at many multiply-adds per byte is
arithmetic-bound.

llama.cpp: ``llama_cpp`` (llama-cpp-python) on the GGUF minserve's default model is converted
from, with the same thread count, the same prompt, greedy, ``ignore_eos``; skipped with the install
command when it is not importable. Results: ``--out`` (default benchmarks/results/quant.json, or
quant_quick.json), with the markdown printed at the end.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from bench_contention import llama_cpp_engine, llama_cpp_rate
from bench_offline import cpu_seconds, machine_info, memory_bandwidth, other_load
from bench_quant_formats import ROWS as FORMAT_ROWS
from minserve import LLM, SamplingParams
from minserve.eval.data import load_texts
from minserve.models.loader import load_model
from minserve.plan.budget import kv_budget_within

# label: (quantization, quantization_config, kv_cache_dtype)
ROWS = {"fp32": (None, None, "auto"), "int8": ("int8", None, "auto"),
        "int4 g32": ("int4", None, "auto"), "int4 g64": ("int4", {"group_size": 64}, "auto"),
        "int4 g128": FORMAT_ROWS["int4 g128+fallback"] + ("auto",),
        "int4-awq": ("int4-awq", None, "auto"),
        "fp32 kv=int8": (None, None, "int8"), "int4 kv=int8": ("int4", None, "int8"),
        "int8 a8": ("int8", {"activations": "int8"}, "auto"),
        "int4 a8": ("int4", {"activations": "int8"}, "auto"),
        "int4 a8 kv=int8": ("int4", {"activations": "int8"}, "int8")}
QUICK_ROWS = ["fp32", "int8", "int4 g32", "int4 kv=int8"]
TARGETS = {"decode_b1": {"int8": 2.5, "int4 g32": 3.5}, "prefill": 0.8,
           "decode_b16": {"int4 g32": 2.0, "int4 a8": 2.0, "int4 a8 kv=int8": 2.0}, "llama_cpp": 1.0}
LLAMA_CPP_INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install --no-deps llama-cpp-python '
                     "&& .venv/bin/pip install numpy typing-extensions diskcache jinja2")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default=None, help=f"comma-separated, from: {', '.join(ROWS)}")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions (5; quick: 1)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill prompt length (256; quick: 64)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="decode prompts' length (128; quick: 32)")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (48; quick: 8)")
    ap.add_argument("--context", type=int, default=300, help="context of the per-part step profile")
    ap.add_argument("--profile-clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the per-part profile on one thread, in its CPU time (a busy host's "
                         "other processes drop out; the ratios of a quiet 1-thread run)")
    ap.add_argument("--skip-speed", action="store_true", help="only bytes, KV tokens and the profile")
    ap.add_argument("--memory-budget", type=int, default=1 << 30, help="bytes, for the KV tokens column")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    q = a.quick
    a.rows = [r.strip() for r in a.rows.split(",")] if a.rows else (QUICK_ROWS if q else list(ROWS))
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {unknown}; known: {', '.join(ROWS)}")
    a.rows = ["fp32"] + [r for r in a.rows if r != "fp32"]   # the reference of every ratio
    a.reps = a.reps or (1 if q else 5)
    a.prefill_tokens = a.prefill_tokens or (64 if q else 256)
    a.prompt_tokens = a.prompt_tokens or (32 if q else 128)
    a.decode_steps = a.decode_steps or (8 if q else 48)
    a.out = a.out or f"benchmarks/results/quant{'_quick' if q else ''}.json"
    return a


# ---- engines and their measurements ------------------------------------------------------------

def build_engine(label: str, args) -> LLM:
    quant, qc, kv = ROWS[label]
    need = 16 * (args.prompt_tokens + args.decode_steps + 8) + args.prefill_tokens + args.context + 64
    return LLM(args.model, quantization=quant, quantization_config=qc, kv_cache_dtype=kv,
               num_kv_blocks=max(16 * (args.context // 16 + 2), need // 16 + 32), max_num_seqs=16,
               max_model_len=max(args.prefill_tokens, args.context) + 64, enable_prefix_caching=False)


def prefill_tok_s(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0, max_tokens=1)
    t0 = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return len(prompt) / (time.perf_counter() - t0)


def decode_tok_s(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Tokens / second over ``steps`` engine steps in which every prompt decodes (after prefill)."""
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"bq-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    started: set[str] = set()
    while len(started) < len(ids):   # prefill steps (maybe several) until every request has a token
        started |= {o.request_id for o in eng.step() if o.outputs and o.outputs[0].token_ids}
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    rate = len(prompts) * steps / (time.perf_counter() - t0)
    while eng.has_unfinished_requests():
        eng.step()
    return rate


def fill_kv_blocks(runner, blocks: int, seed: int = 0) -> None:
    """Write values into KV blocks 0 .. blocks - 1 of every layer (keys, values, int8 scales).
    Why: pages of the cache that were never written all map to the kernel's one zero page, so a
    step over them reads from cache, not DRAM, and its attention looks faster than over a real
    context (batch 16 at 300 tokens on the AVX2 EPYC: 25-27 ms against 29.9; docs/performance/vllm-avx2-epyc.md)."""
    g = torch.Generator().manual_seed(seed)
    for layer in runner.kv_caches:   # (k, v) or, for an int8 cache, (k, v, k_scales, v_scales)
        for t in layer[:2]:
            part = t[:blocks]
            if part.dtype == torch.int8:
                part.copy_(torch.randint(-127, 128, part.shape, generator=g, dtype=torch.int8))
            else:
                part.copy_(torch.randn(part.shape, generator=g).to(part.dtype))
        for t in layer[2:]:
            t[:blocks].copy_(torch.rand(t[:blocks].shape, generator=g) * 0.02)


def step_parts(llm: LLM, batch: int, context: int, steps: int, clock: str = "wall") -> dict:
    """Per-part ms of one fused step of ``batch`` rows at ``context`` (median of ``steps``): wall
    time, or with ``clock="cpu"`` the CPU time of a one-thread step. The rows' context blocks hold
    written values (fill_kv_blocks), so attention reads them from memory as a real step does."""
    runner = llm.llm_engine.runner
    dec, bs = runner.fused, runner.block_size
    per = context // bs + 1
    fill_kv_blocks(runner, batch * per)
    tables = torch.tensor([list(range(i * per, (i + 1) * per)) for i in range(batch)])
    args = torch.full((batch,), 5), torch.full((batch,), context), tables, torch.arange(batch)
    threads = 1 if clock == "cpu" else 0   # 0: the engine's default team
    dec(*args, num_threads=threads)
    samples = []
    dec.step_profile(clock)
    for _ in range(steps):
        dec(*args, num_threads=threads)
        s = dec.step_profile(clock)
        samples.append(s | {"rest": s["step"] - s["weights"] - s["lm_head"] - s["attention"]})
    dec.step_profile(None)
    return {k: statistics.median(s[k] for s in samples) * 1e3 for k in samples[0]}


def step_bytes(llm: LLM, batch: int, context: int) -> dict:
    """Bytes a fused step reads per part: the weights once whatever the batch; K and V of every
    row's context (int8 KV: codes plus a float32 scale per entry)."""
    eng = llm.llm_engine
    m = eng.runner.model
    head = m.lm_head.descriptor()
    macs = sum(mod.descriptor().in_features * mod.descriptor().out_features
               for layer in m.layers for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj))
    return {"weights": eng.runner.weight_bytes() - head.nbytes, "lm_head": head.nbytes,
            "attention": batch * (context + 1) * eng.kv_spec.bytes_per_token,
            "weight_macs": batch * macs, "lm_head_macs": batch * head.in_features * head.out_features}


def row_static(label: str, llm: LLM, args) -> dict:
    eng = llm.llm_engine
    fp = eng.runner.weight_footprint()
    kv_tokens = kv_budget_within(args.memory_budget, fp.resident_bytes) // eng.kv_spec.bytes_per_token
    return {"resident_mib": fp.resident_bytes / 2**20, "streamed_mib": fp.streamed_bytes / 2**20,
            "kv_bytes_per_token": eng.kv_spec.bytes_per_token, "kv_tokens_at_budget": kv_tokens,
            "fused": eng.runner.fused is not None}


def one_thread_read_bandwidth(nbytes: int = 1 << 30) -> dict:
    """torch.sum over 1 GiB on one thread, in its CPU time (best of 3): the bandwidth a one-thread
    step can reach, on the clock --profile-clock cpu reads."""
    x, before = torch.ones(nbytes // 4), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x.sum()
        best = float("inf")
        for _ in range(3):
            t0 = time.thread_time()
            x.sum()
            best = min(best, time.thread_time() - t0)
    finally:
        torch.set_num_threads(before)
    return {"read_GBps": nbytes / best / 1e9, "read_bytes": nbytes, "threads": 1, "clock": "cpu"}


# ---- the run -----------------------------------------------------------------------------------

def measure(args, engines: dict, prompts: dict, llama=None) -> dict:
    """Every row once per repetition, rows in turn (order rotated), llama.cpp's batch-1 decode among
    them when given; medians, and ratios to fp32 (and int4 g32 to llama.cpp) per repetition."""
    runs = {label: [] for label in engines}
    names = list(engines) + (["llama.cpp"] if llama is not None else [])
    for r in range(args.reps):
        for label in names[r % len(names):] + names[:r % len(names)]:
            if label == "llama.cpp":
                runs.setdefault(label, []).append(
                    {"decode_b1_tok_s": llama_cpp_decode_rate(llama, prompts["decode"][0], args.decode_steps)})
            else:
                llm = engines[label]
                runs[label].append({
                    "prefill_tok_s": prefill_tok_s(llm, prompts["prefill"]),
                    "decode_b1_tok_s": decode_tok_s(llm, prompts["decode"][:1], args.decode_steps),
                    "decode_b16_tok_s": decode_tok_s(llm, prompts["decode"], args.decode_steps)})
            print(f"  rep {r + 1}/{args.reps} {label:14s} " + "  ".join(
                f"{k} {v:7.1f}" for k, v in runs[label][-1].items()), flush=True)
    out = {}
    for label, rs in runs.items():
        row = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        for k in rs[0]:   # ratio per repetition (same moments of the host), then the median
            row[k.replace("tok_s", "x_fp32")] = statistics.median(
                x[k] / f[k] for x, f in zip(rs, runs["fp32"]))
        out[label] = row
    if llama is not None and "int4 g32" in runs:
        out["int4 g32"]["decode_b1_x_llama_cpp"] = statistics.median(
            x["decode_b1_tok_s"] / lc["decode_b1_tok_s"] for x, lc in zip(runs["int4 g32"], runs["llama.cpp"]))
    return out


def where_time_goes(args, engines: dict, bandwidth: float) -> dict:
    steps = 3 if args.quick else 10
    out = {}
    for label, llm in engines.items():
        if llm.llm_engine.runner.fused is None:
            continue
        out[label] = {}
        for batch in (1, 16):
            ms = step_parts(llm, batch, args.context, steps, args.profile_clock)
            nbytes = step_bytes(llm, batch, args.context)
            parts = {}
            for part in ("weights", "lm_head", "attention"):
                gb_s = nbytes[part] / ms[part] / 1e6
                parts[part] = {"ms": ms[part], "mb": nbytes[part] / 1e6, "gb_s": gb_s,
                               "of_bandwidth": gb_s / bandwidth,
                               "floor_ms": nbytes[part] / bandwidth / 1e6}
            parts["weights"]["gmac_s"] = nbytes["weight_macs"] / ms["weights"] / 1e6
            parts["lm_head"]["gmac_s"] = nbytes["lm_head_macs"] / ms["lm_head"] / 1e6
            out[label][batch] = {"step_ms": ms["step"], "rest_ms": ms["rest"], "parts": parts}
    return out


def llama_cpp_setup(args):
    """(llama.cpp on the GGUF the default model comes from, with as many threads as CPUs:
    bench_contention's engine; or None, and a note why not)."""
    if args.skip_llama_cpp:
        return None, {"skipped": "--skip-llama-cpp"}
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"llama.cpp row skipped: llama_cpp is not importable. Install it (compiles C++, ~10+ min on "
              f"2 cores):\n    {LLAMA_CPP_INSTALL}", flush=True)
        return None, {"skipped": "llama_cpp not importable", "install": LLAMA_CPP_INSTALL}
    import llama_cpp
    llm, note = llama_cpp_engine()
    llama_cpp_rate(llm, 4, 30)   # warm-up
    return llm, {"engine": note, "version": llama_cpp.__version__}


def llama_cpp_decode_rate(llm, prompt: list[int], steps: int) -> float:
    """llama.cpp's decode tok/s from the same prompt token ids as the minserve rows (SmolLM2's GGUF
    and our tokenizer share the vocabulary), greedy, end-of-text banned: ``steps`` tokens timed
    after the first (which ends the prefill), as decode_tok_s times minserve's steps."""
    llm.reset()
    stamps = []
    for _ in llm.create_completion(prompt, max_tokens=steps + 1, temperature=0, stream=True,
                                   logit_bias={llm.token_eos(): -1e9}):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def markdown(res: dict) -> str:
    m, a, rows = res["machine"], res["args"], res["rows"]
    lines = [f"Machine: {m['cpu']} ({m['isa']}), {m['cores']} CPUs, torch {m['torch']} ({m['torch_threads']} "
             f"threads); `{a['model']}`; medians of {a['reps']} interleaved repetitions"
             + (" — **quick mode**" if res["quick"] else ""), ""]
    if res["other_load"]["other_avg_cores"] > 0.1:
        lines += [f"**Warning:** other processes kept {res['other_load']['other_avg_cores']:.2f} cores busy "
                  "during the run: compare ratios only (each is taken within one repetition).", ""]
    lines += speed_table(res) if "decode_b1_tok_s" in rows["fp32"] else []
    clock = ("CPU ms of a one-thread step" if a["profile_clock"] == "cpu" else "wall ms")
    lines += ["", f"Where a fused step's time goes at {a['context']} tokens of context ({clock} per part, "
              f"median; GB/s of the bytes each part reads; read bandwidth "
              f"{res['bandwidth']['read_GBps']:.1f} GB/s):", "",
              "| row | batch | step ms | weights ms (MB, GB/s, GMAC/s) | LM head ms (MB, GB/s) | "
              "attention ms (KV MB, GB/s) | rest ms |", "|" + " --- |" * 7]
    for label, by_batch in res["where_time_goes"].items():
        for batch, b in by_batch.items():
            w, h, at = (b["parts"][k] for k in ("weights", "lm_head", "attention"))
            lines.append(f"| {label} | {batch} | {b['step_ms']:.1f} | {w['ms']:.1f} ({w['mb']:.0f}, "
                         f"{w['gb_s']:.1f}, {w['gmac_s']:.1f}) | {h['ms']:.1f} ({h['mb']:.0f}, {h['gb_s']:.1f}) | "
                         f"{at['ms']:.1f} ({at['mb']:.0f}, {at['gb_s']:.1f}) | {b['rest_ms']:.1f} |")
    return "\n".join(lines)


def speed_table(res: dict) -> list[str]:
    a, rows, lines = res["args"], res["rows"], []
    budget = a["memory_budget"] / 2**30
    lines += [f"| row | resident MiB | streamed MiB / step | KV tokens at {budget:g} GiB | prefill tok/s "
              f"({a['prefill_tokens']} tokens) | x fp32 | batch-1 decode tok/s | x fp32 | batch-16 decode "
              "tok/s | x fp32 |", "|" + " --- |" * 10]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['resident_mib']:.1f} | {r['streamed_mib']:.1f} | "
                     f"{r['kv_tokens_at_budget']:,} | {r['prefill_tok_s']:.0f} | {r['prefill_x_fp32']:.2f} | "
                     f"{r['decode_b1_tok_s']:.1f} | {r['decode_b1_x_fp32']:.2f} | "
                     f"{r['decode_b16_tok_s']:.1f} | {r['decode_b16_x_fp32']:.2f} |")
    lines += ["", "Targets (ratios within one repetition, then the median):", ""]
    lines += target_lines(res)
    return lines


def target_lines(res: dict) -> list[str]:
    rows, t, out = res["rows"], TARGETS, []
    def check(name, value, target):
        out.append(f"- {name}: {value:.2f}x (target >= {target}x) — {'met' if value >= target else '**missed**'}")
    for label, target in t["decode_b1"].items():
        if label in rows:
            check(f"batch-1 decode {label} / fp32", rows[label]["decode_b1_x_fp32"], target)
    for label, r in rows.items():
        if label != "fp32" and ROWS[label][0] is not None:
            check(f"prefill {label} / fp32", r["prefill_x_fp32"], t["prefill"])
    for label, target in t["decode_b16"].items():
        if label in rows:
            check(f"batch-16 decode {label} / fp32", rows[label]["decode_b16_x_fp32"], target)
    llama = res["llama_cpp"]
    if "decode_b1_tok_s" in llama and "int4 g32" in rows:
        check(f"batch-1 decode int4 g32 / llama.cpp ({llama['engine']})",
              rows["int4 g32"]["decode_b1_x_llama_cpp"], t["llama_cpp"])
        out.append(f"- llama.cpp batch-1 decode: {llama['decode_b1_tok_s']:.1f} tok/s "
                   f"(llama-cpp-python {llama['version']}, same prompt, interleaved with the rows)")
    else:
        out.append(f"- llama.cpp: {llama.get('skipped')}" + (f"; install: `{llama['install']}`" if "install" in llama else ""))
    return out


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    tok = load_model(args.model).tokenizer
    ids = tok.encode(" ".join(load_texts()))   # datasets/eval/prose.jsonl, the gate's text
    prompts = {"prefill": ids[:args.prefill_tokens],
               "decode": [ids[i * 7: i * 7 + args.prompt_tokens] for i in range(16)]}
    bw = (one_thread_read_bandwidth() if args.profile_clock == "cpu"
          else memory_bandwidth(1 << 28 if args.quick else 1 << 30, reps=3))
    print(f"read bandwidth {bw['read_GBps']:.1f} GB/s (torch.sum, best of 3)", flush=True)
    engines, static = {}, {}
    for label in args.rows:
        t0 = time.perf_counter()
        engines[label] = build_engine(label, args)
        static[label] = row_static(label, engines[label], args) | {"load_s": time.perf_counter() - t0}
        print(f"built {label} in {static[label]['load_s']:.1f} s", flush=True)
    start = cpu_seconds()
    lcpp, llama = llama_cpp_setup(args) if not args.skip_speed else (None, {"skipped": "--skip-speed"})
    speed = {} if args.skip_speed else measure(args, engines, prompts, lcpp)
    if "llama.cpp" in speed:
        llama |= speed.pop("llama.cpp")
    parts = where_time_goes(args, engines, bw["read_GBps"])
    load = other_load(start)
    del engines, lcpp
    gc.collect()
    res = {"machine": machine_info(), "quick": args.quick, "args": {k: v for k, v in vars(args).items()},
           "bandwidth": bw, "other_load": load, "rows": {r: static[r] | speed.get(r, {}) for r in args.rows},
           "where_time_goes": parts, "llama_cpp": llama}
    res["markdown"] = markdown(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print("\n" + res["markdown"] + f"\n\nresults: {out}")



if __name__ == "__main__":
    main()
