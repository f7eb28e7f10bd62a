"""Offline throughput and batch-1 decode: minserve vs Hugging Face transformers vs the memory roofline.

One script, one run, one model (identical weights: transformers loads the directory minserve
resolved), one CPU. Three measurements, all taken in the same process so they share the machine's
state (clock, other load):

1. memory bandwidth: a read-only stream (``torch.sum``) and a copy; the roofline uses the read figure
   because batch-1 decoding only *reads* the weights;
2. batch-1 decode rate (1/TPOT), against that roofline: read GB/s / weight bytes per token, for
   minserve (fused C decode step), minserve's PyTorch path (`fused_decode=False`) and transformers;
3. a mixed offline workload: minserve's continuous batching against static batches of ``generate``.

    .venv/bin/python benchmarks/bench_offline.py            # full run (several minutes on 2 idle cores)
    .venv/bin/python benchmarks/bench_offline.py --quick    # smoke test (about 20 s on 2 idle cores)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import pydoc
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from minserve import LLM, SamplingParams

PROMPT = "The history of the printing press begins in fifteenth-century Europe, where a goldsmith named"
CORPUS_MODULES = ["argparse", "json", "logging", "collections", "pathlib", "typing"]
TARGETS = {"mixed_vs_hf": 2.0, "decode_vs_hf": 1.2, "decode_vs_roofline": 0.70}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=None, help="max_num_seqs / static batch (16; quick: 4)")
    ap.add_argument("--num-requests", type=int, default=None, help="mixed workload size (64; quick: 8)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="batch-1 output tokens (256; quick: 64)")
    ap.add_argument("--runs", type=int, default=None, help="batch-1 repetitions per engine (3; quick: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small smoke-test sizes")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/offline.json")
    a = ap.parse_args()
    full, quick = (16, 64, 256, 3), (4, 8, 64, 1)
    for name, f, q in zip(("batch_size", "num_requests", "decode_tokens", "runs"), full, quick):
        if getattr(a, name) is None:
            setattr(a, name, q if a.quick else f)
    # Quick mode narrows the length ranges too; the lognormal scheme stays the same.
    a.prompt_range, a.output_range = ((32, 128), (16, 64)) if a.quick else ((32, 512), (16, 256))
    return a


# ---- machine and memory bandwidth ----------------------------------------------------------

def machine_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
                 platform.processor() or "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"cpu": model, "isa": isa, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "python": platform.python_version()}


def cpu_seconds() -> tuple[float, float, float]:
    """(wall, busy CPU seconds of the whole machine, CPU seconds of this process)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")   # all but idle + iowait
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return time.perf_counter(), busy, t.user + t.system


def other_load(start: tuple[float, float, float]) -> dict:
    # Another job on the same 2 cores slows both engines by far more than its share (thread pools
    # spin and thrash), so record how busy everything *else* kept the CPU during this run.
    end = cpu_seconds()
    wall, others = end[0] - start[0], (end[1] - start[1]) - (end[2] - start[2])
    return {"wall_s": wall, "other_cpu_s": others, "other_avg_cores": others / wall}


def best_seconds(fn, reps: int) -> float:
    # Best of several: interference from other processes only ever makes a run slower.
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memory_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> dict:
    """Read (sum) and copy bandwidth in GB/s over buffers far larger than any cache."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)   # ones, not empty: pages must be touched
    x.sum()
    read_s = best_seconds(lambda: x.sum(), reps)
    x = None   # free 1 GiB before the copy buffers (the lambda above is done with it)
    src, dst = torch.ones(nbytes // 8), torch.zeros(nbytes // 8)   # half each: 1 GiB resident
    dst.copy_(src)
    copy_s = best_seconds(lambda: dst.copy_(src), reps)
    moved = 2 * src.numel() * 4   # every byte read once and written once
    src = dst = None
    gc.collect()
    return {"read_GBps": nbytes / read_s / 1e9, "read_bytes": nbytes,
            "copy_GBps": moved / copy_s / 1e9, "copy_bytes_moved": moved, "reps": reps}


# ---- workload -----------------------------------------------------------------------------

def corpus_tokens(tokenizer, min_tokens: int = 60_000) -> list[int]:
    """Real English-ish text available offline: the plain-text pydoc of some stdlib modules."""
    ids: list[int] = []
    for name in CORPUS_MODULES:
        text = pydoc.plain(pydoc.render_doc(__import__(name), renderer=pydoc.plaintext))
        ids += tokenizer(text).input_ids
        if len(ids) >= min_tokens:
            break
    return ids


def lognormal_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    # Median at the geometric middle of the range, +-2 sigma spanning it: mostly short, a long tail.
    mu, sigma = np.log(np.sqrt(lo * hi)), np.log(hi / lo) / 4
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), lo, hi).astype(int).tolist()


def make_workload(tokenizer, args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    ids = corpus_tokens(tokenizer)
    p_lens = lognormal_lengths(rng, args.num_requests, *args.prompt_range)
    o_lens = lognormal_lengths(rng, args.num_requests, *args.output_range)
    starts = rng.integers(0, len(ids) - max(p_lens), args.num_requests)
    return [{"prompt_token_ids": ids[s:s + p], "max_tokens": o} for s, p, o in zip(starts, p_lens, o_lens)]


# ---- the two engines ----------------------------------------------------------------------

def load_hf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"   # decoder-only: pad on the left so every row ends at its prompt's end
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


@torch.inference_mode()
def hf_generate(model, tok, batch_ids: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for one static batch, and the new tokens of each row."""
    enc = tok.pad({"input_ids": batch_ids}, padding=True, return_tensors="pt")
    t0 = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return time.perf_counter() - t0, out[:, enc["input_ids"].shape[1]:].tolist()


def minserve_decode_rate(llm: LLM, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    m = out.metrics   # first token ends prefill; the n-1 gaps after it are pure decode steps
    return (n - 1) / (m.last_token_time - m.first_token_time), out.outputs[0].token_ids


def hf_decode_rate(model, tok, prompt_ids: list[int], n: int) -> tuple[float, list[int]]:
    # generate(n) - generate(1) leaves the n-1 decode steps: prefill is paid in both.
    full, tokens = hf_generate(model, tok, [prompt_ids], n)
    prefill, _ = hf_generate(model, tok, [prompt_ids], 1)
    return (n - 1) / (full - prefill), tokens[0]


def leading_agreement(a: list[int], b: list[int]) -> int:
    # fp32 kernels differ in summation order, so greedy paths may part late; early on they must agree.
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_decode(llm: LLM, llm_torch: LLM, hf, args, weight_bytes: int, bw: dict) -> dict:
    """Batch-1 decode rate of minserve (fused C decode step, the default on CPU), of minserve's
    PyTorch path (``fused_decode=False``: what the kernel buys) and of transformers."""
    prompt_ids = llm.get_tokenizer()(PROMPT).input_ids
    minserve_decode_rate(llm, prompt_ids, 8)   # warm-up: first-call allocations, thread pools
    minserve_decode_rate(llm_torch, prompt_ids, 8)
    if hf:
        hf_decode_rate(*hf, prompt_ids, 8)
    ms, mt, tf, m_tok, t_tok = [], [], [], [], []
    for _ in tqdm(range(args.runs), desc="batch-1 decode runs"):
        rate, m_tok = minserve_decode_rate(llm, prompt_ids, args.decode_tokens)   # alternate engines
        ms.append(rate)                                                         # so drifts hit all
        mt.append(minserve_decode_rate(llm_torch, prompt_ids, args.decode_tokens)[0])
        if hf:
            rate, t_tok = hf_decode_rate(*hf, prompt_ids, args.decode_tokens)
            tf.append(rate)
    roofline = bw["read_GBps"] * 1e9 / weight_bytes
    out = {"prompt_tokens": len(prompt_ids), "decode_tokens": args.decode_tokens, "weight_bytes": weight_bytes,
           "roofline_tok_s": roofline, "minserve_runs_tok_s": ms, "minserve_tok_s": statistics.median(ms),
           "torch_path_runs_tok_s": mt, "torch_path_tok_s": statistics.median(mt)}
    out["minserve_vs_roofline"] = out["minserve_tok_s"] / roofline
    out["torch_path_vs_roofline"] = out["torch_path_tok_s"] / roofline
    if tf:
        out.update(transformers_runs_tok_s=tf, transformers_tok_s=statistics.median(tf))
        out["transformers_vs_roofline"] = out["transformers_tok_s"] / roofline
        out["ratio"] = out["minserve_tok_s"] / out["transformers_tok_s"]
        out["torch_path_ratio"] = out["torch_path_tok_s"] / out["transformers_tok_s"]
        out["greedy_tokens_agree"] = leading_agreement(m_tok, t_tok)
    return out


def bench_mixed(llm: LLM, hf, work: list[dict], batch_size: int) -> dict:
    useful = sum(w["max_tokens"] for w in work)
    params = [SamplingParams(temperature=0, max_tokens=w["max_tokens"], ignore_eos=True) for w in work]
    warm = [w["prompt_token_ids"] for w in work[:batch_size]]   # warm-up: a short batched run each
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    if hf:
        hf_generate(*hf, warm, 2)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w["prompt_token_ids"]} for w in work], params)
    wall = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == useful, "minserve returned fewer tokens"
    out = {"num_requests": len(work), "batch_size": batch_size, "useful_output_tokens": useful,
           "prompt_tokens": sum(len(w["prompt_token_ids"]) for w in work),
           "minserve_wall_s": wall, "minserve_tok_s": useful / wall}
    if hf:
        batches = [work[i:i + batch_size] for i in range(0, len(work), batch_size)]
        wall, padded = 0.0, 0
        for b in tqdm(batches, desc="transformers static batches"):
            longest = max(w["max_tokens"] for w in b)   # the batch runs until its longest member is done
            wall += hf_generate(*hf, [w["prompt_token_ids"] for w in b], longest)[0]
            padded += longest * len(b)
        out.update(transformers_wall_s=wall, transformers_tok_s=useful / wall,
                   transformers_generated_tokens=padded, ratio=out["minserve_tok_s"] / (useful / wall))
    return out


# ---- report -------------------------------------------------------------------------------

def fmt(x, spec=".1f", suffix=""):
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def verdict(x, target) -> str:
    return "n/a" if x is None else ("yes" if x >= target else "**no**")


def markdown(res: dict) -> str:
    m, bw, d, x = res["machine"], res["bandwidth"], res.get("decode") or {}, res.get("mixed") or {}
    lines = [f"Machine: {m['cpu']} ({m['isa']}), {m['cores']} cores, torch {m['torch']} "
             f"({m['torch_threads']} threads), transformers {m['transformers']}; model `{res['model']}` fp32"
             + (" — **quick mode**" if res["quick"] else ""), "",
             *([f"**Warning:** other processes kept {res['other_load']['other_avg_cores']:.2f} cores busy on "
                "average during this run; both engines' numbers are unreliable (rerun on a quiet machine).", ""]
               if res["other_load"]["other_avg_cores"] > 0.1 else []),
             f"Memory: read {fmt(bw.get('read_GBps'))} GB/s (sum over 1 GiB), copy {fmt(bw.get('copy_GBps'))} "
             f"GB/s (bytes read + written). Weights read per token: {res['weight_bytes'] / 1e6:.0f} MB.",
             "", "| measurement | minserve | transformers | minserve / transformers | target | met |",
             "| --- | --- | --- | --- | --- | --- |"]
    if d:
        lines.append(f"| batch-1 decode, {d['decode_tokens']} tokens (tok/s, median of {res['args']['runs']}) | "
                     f"{fmt(d['minserve_tok_s'])} | {fmt(d.get('transformers_tok_s'))} | {fmt(d.get('ratio'), '.2f', 'x')} "
                     f"| >= {TARGETS['decode_vs_hf']}x | {verdict(d.get('ratio'), TARGETS['decode_vs_hf'])} |")
        lines.append(f"| batch-1 decode, % of roofline ({fmt(d['roofline_tok_s'])} tok/s) | "
                     f"{fmt(100 * d['minserve_vs_roofline'], '.0f', '%')} | "
                     f"{fmt(100 * d['transformers_vs_roofline'] if 'ratio' in d else None, '.0f', '%')} | | "
                     f">= {TARGETS['decode_vs_roofline']:.0%} | "
                     f"{verdict(d['minserve_vs_roofline'], TARGETS['decode_vs_roofline'])} |")
        lines.append(f"| batch-1 decode, minserve's PyTorch path (`fused_decode=False`) (tok/s; % of roofline) | "
                     f"{fmt(d['torch_path_tok_s'])}; {fmt(100 * d['torch_path_vs_roofline'], '.0f', '%')} | | "
                     f"{fmt(d.get('torch_path_ratio'), '.2f', 'x')} | | |")
    if x:
        lines.append(f"| mixed, {x['num_requests']} requests, batch {x['batch_size']} (useful tok/s) | "
                     f"{fmt(x['minserve_tok_s'])} | {fmt(x.get('transformers_tok_s'))} | {fmt(x.get('ratio'), '.2f', 'x')} "
                     f"| >= {TARGETS['mixed_vs_hf']}x | {verdict(x.get('ratio'), TARGETS['mixed_vs_hf'])} |")
        lines.append(f"| mixed, wall time (s) | {fmt(x['minserve_wall_s'])} | {fmt(x.get('transformers_wall_s'))} | | | |")
    if "greedy_tokens_agree" in d:
        lines += ["", f"Same weights check: the two engines' greedy batch-1 outputs agree on the first "
                      f"{d['greedy_tokens_agree']} of {d['decode_tokens']} tokens."]
    if "transformers_generated_tokens" in x:
        lines += ["", f"Mixed throughput counts only the {x['useful_output_tokens']} requested output tokens; "
                      f"transformers also generated {x['transformers_generated_tokens'] - x['useful_output_tokens']} "
                      "padding tokens for rows that finished before the longest in their static batch, "
                      "which do not count."]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    res = {"model": args.model, "quick": args.quick, "args": vars(args), "machine": machine_info(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    start = cpu_seconds()
    print("measuring memory bandwidth ...", flush=True)
    res["bandwidth"] = memory_bandwidth()
    llm = LLM(args.model, max_num_seqs=args.batch_size, max_num_batched_tokens=512, seed=args.seed)
    hf = None if args.skip_transformers else load_hf(llm.llm_engine.config_path)
    res["weight_bytes"] = weight_bytes = llm.llm_engine.runner.weight_bytes()
    if not args.skip_decode:
        llm_torch = LLM(args.model, max_num_seqs=1, kv_cache_memory="256MiB", fused_decode=False)
        res["decode"] = bench_decode(llm, llm_torch, hf, args, weight_bytes, res["bandwidth"])
        del llm_torch
        gc.collect()
    if not args.skip_mixed:
        res["mixed"] = bench_mixed(llm, hf, make_workload(llm.get_tokenizer(), args), args.batch_size)
    res["other_load"] = other_load(start)
    res["markdown"] = markdown(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print("\n" + res["markdown"] + f"\n\nresults: {out}")


if __name__ == "__main__":
    main()
