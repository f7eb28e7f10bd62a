"""minserve against vLLM's CPU build, side by side on this machine.

Same model folder (the Hugging Face directory minserve converts the default model into), same
prompt token ids, same scheduler limits, same cores, greedy decoding with ``ignore_eos`` so every
engine produces exactly the requested tokens (``--temperature`` / ``--top-p`` sample instead: the
same request shapes, each engine's own sampler on every step). Three measurements per engine:

1. a mixed offline workload (prompts 16-768 tokens, outputs 8-256, lognormal: mostly short, a long
   tail), all submitted at once: useful output tokens per second (the requested tokens only);
2. batch-1 decode: ``(n - 1) / (t(n tokens) - t(1 token))``, the same subtraction for every engine,
   so prefill and per-call overhead cancel;
3. batch-16 decode: the same subtraction for 16 requests of n tokens at once, and its ratio to
   batch 1 (how much a step gains from batching);
4. prefill: 1024-token prompts one at a time, one output token each, after one untimed (an
   engine's first step of a new size pays one-time costs): prompt tokens per second.

For each minserve engine the mixed workload's time is also split by kind of step (prefill, mixed,
decode; ``step_kinds.py``): the profile that says what bounds the mixed figure.

Engines: minserve fp32 / fp32-high (``fp32_matmul_precision="high"``) / bf16 (``dtype="bfloat16"``) /
int8 / int4 in this process
(``EngineConfig.quantization``), int8-a8 / int4-a8 (W8A8 / W4A8: the same weights with
``quantization_config={"activations": "int8"}``, integer dot products), vLLM fp32 /
bf16 each in a long-lived worker subprocess of vLLM's venv (``make vllm-venv``) that holds one
``vllm.LLM``. Any of them with ``-kv8`` keeps its K/V in 8 bits: ``kv_cache_dtype="int8"`` in
minserve (minserve-int4-a8-kv8), vLLM's ``"fp8"`` (vllm-bf16-kv8: its CPU backend's only quantized
cache, one scale per tensor). Runs alternate (engine after engine, the order rotated each round) and every figure
is the median over rounds: a noisy neighbour on a shared 2-core box then hurts all engines alike.
Each engine's round starts once the machine is quiet (``host_phase.start_round``: vLLM's worker
keeps a core busy for about a second after its last request) and with a host probe
(bench_roofline.host_probe: fp32 FMA on one thread and on all, AMX tiles), printed beside the round
and kept as ``host_probe_runs``: on this project's VM the arithmetic moves by 2-3x within minutes,
and the probe says which rounds ran slow. A matched pair whose rounds ran in different phases gets
a note under the ratios (``host_phase.phase_notes``). Under it, each row's fraction of this CPU's
ceilings (``roofline_share.py``): prefill and the batched step against the arithmetic its rounds'
probes measured, batch 1 against the read bandwidth.

Threads: vLLM's CPU build by default pins its OpenMP threads to all cores but one ("reserved" for
the server's other work); here it is given every core (``VLLM_CPU_OMP_THREADS_BIND=0-N``), as
minserve's torch is, so the comparison is core for core.

    .venv/bin/python benchmarks/bench_vs_vllm.py                      # issue 21's sizes (~25 min idle)
    .venv/bin/python benchmarks/bench_vs_vllm.py --num-requests 24 --runs 3
    .venv/bin/python benchmarks/bench_vs_vllm.py --quick              # smoke run (a few minutes)

The same file is the vLLM worker (``--vllm-worker``, run with vLLM's python): that path imports
only vLLM and the standard library, since minserve is not installed in vLLM's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from roofline_share import KV8, row_kv_cache_dtype

HERE = Path(__file__).resolve().parent
ENGINES = ("minserve-fp32", "minserve-fp32-high", "minserve-bf16", "minserve-int8", "minserve-int4",
           "minserve-int8-a8", "minserve-int4-a8", "vllm-fp32", "vllm-bf16")
# Engine pairs the targets compare (minserve, its peer), and every metric measured. The
# fp32-high row keeps float32 weights and activations and multiplies at PyTorch's "high" precision
# (fp32_matmul_precision="high": three bf16 products, ~16 mantissa bits); vLLM's fp32 runs at
# PyTorch's default, "highest": compared with it, but not bit for bit the same precision.
MATCHED = (("minserve-fp32", "vllm-fp32"), ("minserve-fp32-high", "vllm-fp32"), ("minserve-bf16", "vllm-bf16"))
METRICS = ("mixed_tok_s", "decode_tok_s", "decode16_tok_s", "prefill_tok_s")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    ap.add_argument("--num-requests", type=int, default=None, help="mixed workload size (48; quick: 8)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="batch-1 output tokens (128; quick: 32)")
    ap.add_argument("--prefill-prompts", type=int, default=None, help="1024-token prompts per round (3; quick: 1)")
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=None, help="alternating rounds, medians over them (3; quick: 1)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache per engine (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy, and minserve fp32's tokens are compared with vLLM fp32's")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/vs_vllm.json")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name, full, quick in (("num_requests", 48, 8), ("decode_tokens", 128, 32),
                              ("prefill_prompts", 3, 1), ("runs", 3, 1)):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    a.prompt_range, a.output_range = ((16, 128), (8, 32)) if a.quick else ((16, 768), (8, 256))
    return a


# ---- the vLLM worker (runs under vLLM's python) -------------------------------------------------

def vllm_worker(args) -> None:
    """One ``vllm.LLM``; reads jobs as JSON lines on stdin, answers each with one JSON line."""
    # vLLM logs to stdout; the answers get a private copy of it and everything else goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=True, enable_prefix_caching=False, seed=args.seed,
              kv_cache_dtype=args.kv_cache_dtype)
    answers.write(json.dumps({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("op") == "quit":
            break
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=m, ignore_eos=True)
                  for m in job["max_tokens"]]
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        answers.write(json.dumps({"seconds": seconds,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}) + "\n")


class VllmEngine:
    """A worker subprocess holding one ``vllm.LLM``; ``run`` times one ``generate`` there."""

    def __init__(self, name: str, dtype: str, args, model_dir: Path, log_dir: Path, kv_cache_dtype: str = "auto"):
        sys.path.insert(0, str(HERE.parent / "tests"))
        from vllm_peer import vllm_env, vllm_venv, vllm_venv_dir
        python = vllm_venv()
        if python is None:
            raise SystemExit(f"no vLLM venv at {vllm_venv_dir()}: run `make vllm-venv`, or leave the "
                             "vllm-* engines out of --engines")
        self.name = name
        cores = os.cpu_count() or 1
        env = vllm_env(python, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                       VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}")
        self.log_path = log_dir / f"{name}.log"
        cmd = [str(python), str(Path(__file__).resolve()), "--vllm-worker", "--dtype", dtype,
               "--model-dir", str(model_dir), "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", str(args.seed),
               "--temperature", str(args.temperature), "--top-p", str(args.top_p),
               "--kv-cache-dtype", kv_cache_dtype]
        with open(self.log_path, "wb") as log:
            # cwd: not the repository, whose kernels/ vLLM's helper processes (`python -m`, the
            # cwd first on their path) would find as Hugging Face's `kernels` package and fail on.
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=env, text=True, start_new_session=True, cwd=log_dir)
        self.info = {**self._read(), "kv_cache_dtype": kv_cache_dtype}

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{self.name}: the vLLM worker exited; log {self.log_path}:\n{tail}")
        return json.loads(line)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        ans = self._read()
        return ans["seconds"], ans["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                import signal
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class MinserveEngine:
    def __init__(self, name: str, quantization: str | None, args, dtype: str = "float32",
                 quantization_config: dict | None = None, fp32_matmul_precision: str = "highest",
                 kv_cache_dtype: str = "auto"):
        from minserve import LLM
        self.name = name
        self.llm = LLM("smollm2-135m", quantization=quantization, quantization_config=quantization_config,
                       dtype=dtype, fp32_matmul_precision=fp32_matmul_precision, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, kv_cache_memory=f"{args.kv_cache_gib}GiB",
                       enable_prefix_caching=False, seed=args.seed, kv_cache_dtype=kv_cache_dtype)
        self.info = {"quantization": quantization, "dtype": dtype, "quantization_config": quantization_config,
                     "fp32_matmul_precision": fp32_matmul_precision, "kv_cache_dtype": kv_cache_dtype}
        self.sampling = {"temperature": args.temperature, "top_p": args.top_p}

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        from minserve import SamplingParams
        params = [SamplingParams(**self.sampling, max_tokens=m, ignore_eos=True) for m in max_tokens]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        pass


def make_engine(name: str, args, model_dir: Path, log_dir: Path):
    kind, fmt = name.split("-", 1)
    kv = {"kv_cache_dtype": row_kv_cache_dtype(name)}   # minserve-int4-a8-kv8: K/V in int8; vLLM's in fp8
    fmt = fmt.removesuffix(KV8)
    if kind == "vllm":
        return VllmEngine(name, {"fp32": "float32", "bf16": "bfloat16"}[fmt], args, model_dir, log_dir, **kv)
    if fmt == "bf16":
        return MinserveEngine(name, None, args, dtype="bfloat16", **kv)
    if fmt == "fp32-high":
        return MinserveEngine(name, None, args, fp32_matmul_precision="high", **kv)
    if fmt.endswith("-a8"):
        return MinserveEngine(name, fmt[:-3], args, quantization_config={"activations": "int8"}, **kv)
    return MinserveEngine(name, None if fmt == "fp32" else fmt, args, **kv)


# ---- the three measurements ---------------------------------------------------------------------

def mixed(engine, work) -> dict:
    """The mixed workload once; for a minserve engine also where its time went, by kind of step
    (step_kinds.py: prefill, mixed and decode steps)."""
    kinds = None
    if isinstance(engine, MinserveEngine):
        from step_kinds import StepKinds
        kinds = StepKinds()
        engine.llm.llm_engine.add_step_observer(kinds)
    try:
        seconds, tokens = engine.run([w["prompt_token_ids"] for w in work], [w["max_tokens"] for w in work])
    finally:
        if kinds is not None:
            engine.llm.llm_engine.remove_step_observer(kinds)
    useful = sum(w["max_tokens"] for w in work)
    assert [len(t) for t in tokens] == [w["max_tokens"] for w in work], f"{engine.name}: short outputs"
    return {"seconds": seconds, "tok_s": useful / seconds, "tokens": tokens,
            "step_kinds": kinds.summary() if kinds else None, "step_table": kinds.table() if kinds else None}


def decode(engine, prompt: list[int], n: int) -> float:
    t_n, _ = engine.run([prompt], [n])
    t_1, _ = engine.run([prompt], [1])
    return (n - 1) / (t_n - t_1)


def decode_batch(engine, prompts: list[list[int]], n: int) -> float:
    """Output tok/s of len(prompts) requests decoding together, prefill subtracted as in decode()."""
    t_n, _ = engine.run(prompts, [n] * len(prompts))
    t_1, _ = engine.run(prompts, [1] * len(prompts))
    return len(prompts) * (n - 1) / (t_n - t_1)


def prefill(engine, prompts: list[list[int]]) -> float:
    """Median prompt tok/s of the long prompts, one at a time, after one untimed: an engine's first
    step of a new size pays one-time costs (oneDNN builds its kernels for each new shape; a fresh
    bf16 minserve engine's first 1024-token prompt took 303 ms against 267-271 after it,
    2026-12-06), which are not the prefill rate."""
    engine.run([prompts[0]], [1])
    rates = [len(p) / engine.run([p], [1])[0] for p in prompts]
    return statistics.median(rates)


def workloads(args, tokenizer):
    import numpy as np

    from bench_offline import corpus_tokens, lognormal_lengths
    rng = np.random.default_rng(args.seed)
    ids = corpus_tokens(tokenizer)
    p_lens = lognormal_lengths(rng, args.num_requests, *args.prompt_range)
    o_lens = lognormal_lengths(rng, args.num_requests, *args.output_range)
    # One start per mixed request, one for the decode prompt, one per prefill prompt.
    starts = rng.integers(0, len(ids) - max(max(p_lens), args.prefill_len),
                          args.num_requests + 1 + args.prefill_prompts)
    work = [{"prompt_token_ids": ids[s:s + p], "max_tokens": o} for s, p, o in zip(starts, p_lens, o_lens)]
    decode_prompt = ids[starts[args.num_requests]:starts[args.num_requests] + 32]
    long_prompts = [ids[s:s + args.prefill_len] for s in starts[args.num_requests + 1:]]
    # The batch-16 prompts: 32 tokens each from 16 places, so no two share a prefix.
    batch_prompts = [ids[s:s + 32] for s in rng.integers(0, len(ids) - 32, args.max_num_seqs)]
    return work, decode_prompt, long_prompts, batch_prompts


def leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def markdown(res: dict) -> str:
    seqs = res["args"]["max_num_seqs"]
    rows = [f"| | mixed (useful tok/s) | batch-1 decode (tok/s) | batch-{seqs} decode (tok/s) | "
            f"{seqs} / 1 | prefill (tok/s, {res['args']['prefill_len']}-token prompts) |",
            "| --- | --- | --- | --- | --- | --- |"]
    if res["args"].get("temperature"):
        rows.insert(0, f"Sampled: temperature {res['args']['temperature']:g}, top_p {res['args']['top_p']:g}.\n")
    for name, r in res["engines"].items():
        rows.append(f"| {name.replace('-', ' ')} | {r['mixed_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                    f"{r['decode16_tok_s']:.1f} | {r['decode16_tok_s'] / r['decode_tok_s']:.1f} | "
                    f"{r['prefill_tok_s']:.0f} |")
    if res.get("ratios"):
        rows += ["", "| minserve / vLLM | " + " | ".join(METRICS) + " |", "| --- |" + " --- |" * len(METRICS)]
        rows += [f"| {pair} | " + " | ".join(f"{x:.2f}" for x in r.values()) + " |"
                 for pair, r in res["ratios"].items()]
    rows += [f"\nNote: {n}." for n in res.get("phase_notes", [])]
    if res.get("ceiling_shares"):
        from roofline_share import markdown as shares_table
        rows += ["", shares_table(res["ceiling_shares"], seqs)]
    return "\n".join(rows)


# Rows whose format failed `minserve eval` on SmolLM2 on a host of ours (docs/engine/quality-gate.md:
# weight-only int8 misses exact match by one question of 64, W8A8 by two on the Zen 4 EPYC): timed
# and shown, but never "minserve's best". A -kv8 row counts only where that very row passed the gate
# (int8 K/V alone, fp32:kv_cache_dtype=int8, misses exact match by one question).
GATE_FAILS = ("minserve-int8", "minserve-int8-a8")
KV8_GATE_PASSES = ("minserve-int4-a8-kv8",)


def passes_gate(name: str) -> bool:
    """Whether a minserve row may stand for "minserve's best" (see GATE_FAILS)."""
    if name.endswith(KV8):
        return name in KV8_GATE_PASSES and passes_gate(name.removesuffix(KV8))
    return name not in GATE_FAILS


def ratios(engines: dict) -> dict:
    """The issue's comparisons, per round's medians: each matched pair, and minserve's best row
    that passes the quality gate against vLLM's best."""
    out = {}
    for mine, peer in MATCHED:
        if mine in engines and peer in engines:
            out[f"{mine} / {peer}"] = {m: engines[mine][m] / engines[peer][m] for m in METRICS}
    ours = [n for n in engines if n.startswith("minserve") and passes_gate(n)]
    theirs = [n for n in engines if n.startswith("vllm")]
    if ours and theirs:
        out["best minserve / best vLLM"] = {m: max(engines[n][m] for n in ours) / max(engines[n][m] for n in theirs)
                                            for m in METRICS}
    return out


def main() -> None:
    args = parse_args()
    if args.vllm_worker:
        vllm_worker(args)
        return
    import tempfile

    sys.path.insert(0, str(HERE))
    from bench_offline import machine_info
    import roofline_share
    from host_phase import phase_notes, probe_line, start_round
    from minserve.models.loader import load_tokenizer, resolve_model_dir

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    bad = [n for n in names if n.removesuffix(KV8) not in ENGINES]
    if bad:
        raise SystemExit(f"--engines must name only {', '.join(ENGINES)} (each optionally with {KV8}), "
                         f"got {bad}")
    model_dir = resolve_model_dir("smollm2-135m")
    work, decode_prompt, long_prompts, batch_prompts = workloads(args, load_tokenizer(model_dir))
    log_dir = Path(tempfile.mkdtemp(prefix="minserve-vs-vllm-"))
    load_start = os.getloadavg()
    engines = {}
    try:
        for name in names:
            print(f"starting {name} ...", flush=True)
            engines[name] = make_engine(name, args, model_dir, log_dir)
            # Warm-up: first allocations, thread pools, vLLM's first-batch paths.
            engines[name].run([w["prompt_token_ids"] for w in work[:4]], [8] * min(4, len(work)))
            engines[name].run([long_prompts[0]], [2])
        per = {n: {m: [] for m in METRICS} for n in names}
        tokens, step_kinds, probes = {}, {}, {n: [] for n in names}
        for r in range(args.runs):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate: no engine always first
            for name in order:
                e = engines[name]
                probes[name].append(start_round())   # a quiet machine, and its phase now
                m = mixed(e, work)
                tokens[name] = m["tokens"]
                if m["step_kinds"]:   # the last round's profile of the mixed workload
                    step_kinds[name] = {"summary": m["step_kinds"], "table": m["step_table"]}
                per[name]["mixed_tok_s"].append(m["tok_s"])
                per[name]["decode_tok_s"].append(decode(e, decode_prompt, args.decode_tokens))
                per[name]["decode16_tok_s"].append(decode_batch(e, batch_prompts, args.decode_tokens))
                per[name]["prefill_tok_s"].append(prefill(e, long_prompts))
                print(f"round {r + 1}/{args.runs} {name}: mixed {m['tok_s']:.1f} tok/s, decode "
                      f"{per[name]['decode_tok_s'][-1]:.1f} tok/s, batch-{len(batch_prompts)} "
                      f"{per[name]['decode16_tok_s'][-1]:.1f} tok/s, prefill "
                      f"{per[name]['prefill_tok_s'][-1]:.0f} tok/s ({probe_line(probes[name][-1])})", flush=True)
    finally:
        infos = {n: e.info for n, e in engines.items()}
        for e in engines.values():
            e.close()
    res = {"args": {k: v for k, v in vars(args).items() if k not in ("vllm_worker", "dtype", "model_dir")},
           "machine": machine_info(), "model_dir": str(model_dir), "engine_info": infos,
           "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
           "workload": {"num_requests": len(work), "prompt_tokens": sum(len(w["prompt_token_ids"]) for w in work),
                        "useful_output_tokens": sum(w["max_tokens"] for w in work)},
           "engines": {n: {**{k: statistics.median(v) for k, v in per[n].items()},
                           **{f"{k}_runs": v for k, v in per[n].items()},
                           "host_probe_runs": probes[n]} for n in names}}
    res["ratios"] = ratios(res["engines"])
    res["phase_notes"] = phase_notes(probes, MATCHED)
    res["ceiling_shares"] = roofline_share.for_run(res["engines"], model_dir, args)
    res["mixed_step_kinds"] = {n: k["summary"] for n, k in step_kinds.items()}
    for mine, key in (("minserve-fp32", "fp32"), ("minserve-fp32-high", "fp32_high")):   # against vLLM fp32
        if mine in tokens and "vllm-fp32" in tokens and args.temperature == 0:
            a, b = tokens[mine], tokens["vllm-fp32"]
            res[f"greedy_{key}_identical"] = sum(x == y for x, y in zip(a, b))
            res[f"greedy_{key}_leading_agreement"] = [leading_agreement(x, y) for x, y in zip(a, b)]
    res["markdown"] = markdown(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print("\n" + res["markdown"])
    for name, k in step_kinds.items():
        print(f"\n{name}, the mixed workload by kind of step (last round):\n{k['table']}")
    for key, label in (("fp32", "fp32"), ("fp32_high", "fp32 at \"high\"")):
        if f"greedy_{key}_identical" in res:
            print(f"\nminserve {label} and vLLM fp32 greedy outputs identical on "
                  f"{res[f'greedy_{key}_identical']}/{len(work)} mixed requests")
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
