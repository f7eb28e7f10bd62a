"""Batch-1 decode when another process takes a core: quiet machine vs busy-loop neighbours.

OpenMP thread teams stall when one member shares its core with another process (see
minserve/engine/threads.py). One run measures batch-1 greedy decode tok/s of minserve's fused C
path and PyTorch path, each with the adaptive thread count (the default) and with it switched off
(``MINSERVE_ADAPTIVE_THREADS=0``: PyTorch's fixed thread count, the behaviour before), and
llama.cpp on the same GGUF when ``llama_cpp`` is importable; first on the machine as it is, then
with ``--busy`` ``python -c "while True: pass"`` processes running. Engines alternate within each
phase so drifts hit all of them; each figure is a median of ``--runs``.

    .venv/bin/python benchmarks/bench_contention.py            # full run (about 5 min on 2 cores)
    .venv/bin/python benchmarks/bench_contention.py --quick    # smoke test (about 1.5 min)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from minserve import LLM, SamplingParams
from minserve.engine.threads import ENV_SWITCH

PROMPT = "The history of the printing press begins in fifteenth-century Europe, where a goldsmith named"
TARGET = 0.4          # busy / quiet with one of two cores busy (issue 8, item 10)
QUIET_TARGET = 0.95   # adaptive vs fixed threads on the quiet machine
_ids = itertools.count()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens per run (128; quick: 48)")
    ap.add_argument("--runs", type=int, default=None, help="runs per engine and phase (3; quick: 1)")
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes in the busy phase")
    ap.add_argument("--max-run-s", type=float, default=15.0,
                    help="stop a run after this long (fixed threads under contention run at ~2 tok/s)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/contention.json")
    a = ap.parse_args()
    a.decode_tokens = a.decode_tokens or (48 if a.quick else 128)
    a.runs = a.runs or (1 if a.quick else 3)
    return a


def cpu_seconds() -> tuple[float, float, float]:
    """(wall, busy CPU seconds of the whole machine, CPU seconds of this process)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return time.perf_counter(), busy, t.user + t.system


def other_cores(start: tuple[float, float, float]) -> float:
    end = cpu_seconds()
    return ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


@contextmanager
def busy_loops(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(1.0)   # let them start spinning
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ---- engines -------------------------------------------------------------------------------

def make_llm(model: str, fused: bool, adaptive: bool) -> LLM:
    old = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1" if adaptive else "0"   # read when the engine is built
    try:
        return LLM(model, max_num_seqs=1, kv_cache_memory="128MiB", fused_decode=fused)
    finally:
        os.environ.pop(ENV_SWITCH) if old is None else os.environ.__setitem__(ENV_SWITCH, old)


def minserve_rate(llm: LLM, prompt_ids: list[int], n: int, max_s: float) -> dict:
    """Decode tok/s from step timestamps (the first step is prefill), stopping after max_s."""
    eng = llm.llm_engine
    rid = f"contention-{next(_ids)}"
    eng.add_request(rid, {"prompt_token_ids": prompt_ids},
                    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    stamps, t0 = [], time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        stamps.append(time.perf_counter())
        if stamps[-1] - t0 > max_s:
            eng.abort_request(rid)
    ctl = eng.runner.threads
    return {"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "tokens": len(stamps),
            "threads_at_end": ctl.threads if ctl.enabled else torch.get_num_threads(),
            "probes": ctl.probes, "switches": ctl.switches}


def llama_cpp_engine():
    """llama.cpp on the GGUF minserve's default model comes from, or a note why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama_cpp not importable (pip install llama-cpp-python): skipped"
    from llama_cpp import Llama
    from minserve.models.loader import MODEL_ALIASES, _gguf_path
    gguf = _gguf_path(MODEL_ALIASES["smollm2-135m"])
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, verbose=False), f"{gguf.name}, {threads} threads"


def llama_cpp_rate(llm, n: int, max_s: float) -> dict:
    # Stream tokens with end-of-text banned (ignore_eos); time from the first token to the last.
    stamps, t0 = [], time.perf_counter()
    for _ in llm.create_completion(PROMPT, max_tokens=n, temperature=0, stream=True,
                                   logit_bias={llm.token_eos(): -1e9}):
        stamps.append(time.perf_counter())
        if stamps[-1] - t0 > max_s:
            break
    return {"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "tokens": len(stamps)}


# ---- phases and report ---------------------------------------------------------------------

def measure_phase(engines: dict, prompt_ids, args, phase: str) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    start = cpu_seconds()
    for r in range(args.runs):
        names = list(engines)
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotate the order
            eng = engines[name]
            res = (llama_cpp_rate(eng, args.decode_tokens, args.max_run_s) if name == "llama.cpp"
                   else minserve_rate(eng, prompt_ids, args.decode_tokens, args.max_run_s))
            runs[name].append(res)
            print(f"  {phase:5s} {name:18s} {res['tok_s']:6.1f} tok/s"
                  + (f"  (threads {res['threads_at_end']})" if "threads_at_end" in res else ""), flush=True)
    return {"other_avg_cores": other_cores(start),
            "engines": {n: {"tok_s": statistics.median(x["tok_s"] for x in v), "runs": v} for n, v in runs.items()}}


LABELS = {"fused adaptive": ("fused C", "adaptive threads (default)"),
          "fused fixed": ("fused C", f"fixed threads (before; {ENV_SWITCH}=0)"),
          "torch adaptive": ("PyTorch", "adaptive threads (default)"),
          "torch fixed": ("PyTorch", f"fixed threads (before; {ENV_SWITCH}=0)"),
          "llama.cpp": ("llama.cpp", "n_threads = CPUs")}


def markdown(res: dict) -> str:
    q, b = res["quiet"], res["busy"]
    lines = [f"Machine: {res['machine']['cpu']}, {res['machine']['cpus']} CPUs, torch {res['machine']['torch']} "
             f"({res['machine']['torch_threads']} threads); model `{res['model']}` fp32, batch 1, "
             f"{res['args']['decode_tokens']} greedy tokens, median of {res['args']['runs']}; busy phase: "
             f"{res['args']['busy']} busy-loop process(es)" + (" — **quick mode**" if res["quick"] else ""), ""]
    if q["other_avg_cores"] > 0.1:
        lines += [f"**Warning:** other processes kept {q['other_avg_cores']:.2f} cores busy during the quiet "
                  "phase; quiet figures are not from a quiet machine (rerun on one).", ""]
    lines += [f"Busy phase: other processes used {b['other_avg_cores']:.2f} cores on average.", "",
              "| path | threads | quiet tok/s | busy tok/s | busy / quiet | target | met |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, eq in q["engines"].items():
        ratio = b["engines"][name]["tok_s"] / eq["tok_s"]
        target = name.endswith("adaptive")
        lines.append(f"| {LABELS[name][0]} | {LABELS[name][1]} | {eq['tok_s']:.1f} | "
                     f"{b['engines'][name]['tok_s']:.1f} | {ratio:.2f}x | "
                     + (f">= {TARGET}x | {'yes' if ratio >= TARGET else '**no**'} |" if target else " | |"))
    for path in ("fused", "torch"):
        a, f = q["engines"][f"{path} adaptive"]["tok_s"], q["engines"][f"{path} fixed"]["tok_s"]
        lines.append(f"\nQuiet, {LABELS[path + ' fixed'][0]}: adaptive / fixed = {a / f:.2f} "
                     f"(target >= {QUIET_TARGET}: {'yes' if a / f >= QUIET_TARGET else '**no**'}).")
    lines.append(f"\nllama.cpp: {res['llama_cpp']}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
               platform.processor() or "unknown")
    res = {"model": args.model, "quick": args.quick, "args": vars(args),
           "machine": {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
                       "torch_threads": torch.get_num_threads()},
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    engines = {f"{path} {mode}": make_llm(args.model, path == "fused", mode == "adaptive")
               for path in ("fused", "torch") for mode in ("adaptive", "fixed")}
    res["llama_cpp"] = "skipped (--skip-llama-cpp)"
    if not args.skip_llama_cpp:
        lcpp, res["llama_cpp"] = llama_cpp_engine()
        if lcpp is not None:
            engines["llama.cpp"] = lcpp
    prompt_ids = engines["fused adaptive"].get_tokenizer()(PROMPT).input_ids
    for name, eng in engines.items():   # warm-up: first-call allocations, thread pools
        (llama_cpp_rate(eng, 8, 10) if name == "llama.cpp" else minserve_rate(eng, prompt_ids, 8, 10))
    print("quiet phase", flush=True)
    res["quiet"] = measure_phase(engines, prompt_ids, args, "quiet")
    print(f"busy phase ({args.busy} busy loop(s))", flush=True)
    with busy_loops(args.busy):
        res["busy"] = measure_phase(engines, prompt_ids, args, "busy")
    res["markdown"] = markdown(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print("\n" + res["markdown"] + f"\n\nresults: {out}")


if __name__ == "__main__":
    main()
