"""Serving goodput, minserve against vLLM: ``minserve bench serve`` against each server in turn.

The offline comparison (``bench_vs_vllm.py``) times each engine's ``generate``; this one measures
what a user of the server sees. Every server is started once and kept up (idle servers take no
CPU, once the ~1 s after a request is over: each round waits for a quiet machine and probes the
host, as bench_vs_vllm.py does), on the same model folder and with the same limits; then each round runs the same
``minserve bench serve`` command against every server, the order rotated each round, and every
figure is the median over rounds. The bench client is the one a user would run, over real HTTP:

    minserve bench serve --base-url URL --dataset-name mix --length-scale 0.25 --num-prompts 32 \\
        --seed 7 --request-rate 1,2,4 --goodput ttft:2000 tpot:250 --save-result

Goodput is the rate of requests that met both SLOs (TTFT 2 s, TPOT 250 ms: a chat user on a
laptop CPU). ``bench serve`` sends one unmeasured test request first, so the first rate does not
carry a cold server; each rate gets fresh prompts (seed + k), the same for every server.

Servers: ``minserve serve`` fp32 / fp32-high (``--fp32-matmul-precision high``) / bf16 (``--dtype
bfloat16``) / int8 / int4 (``--quantization``) /
int8-a8 / int4-a8 (the same with ``--quantization-config '{"activations": "int8"}'``),
vLLM fp32 / bf16 (its CPU build, ``make vllm-venv``; given every core with
``VLLM_CPU_OMP_THREADS_BIND``, as minserve's torch has them). Both with ``--max-num-seqs 16`` and prefix caching off, so that every prefill is paid.

    .venv/bin/python benchmarks/bench_vs_vllm_serve.py                  # 2 rounds (~25 min idle)
    .venv/bin/python benchmarks/bench_vs_vllm_serve.py --quick          # 1 round, 8 prompts, 2 rates
    .venv/bin/python benchmarks/bench_vs_vllm_serve.py --servers minserve-fp32,vllm-bf16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))   # vllm_peer: how to start vLLM's CPU build, and wait for a server
SERVERS = ("minserve-fp32", "minserve-fp32-high", "minserve-bf16", "minserve-int8", "minserve-int4",
           "minserve-int8-a8", "minserve-int4-a8", "vllm-fp32", "vllm-bf16")
FIGURES = ("request_goodput", "request_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma list of {', '.join(SERVERS)}")
    ap.add_argument("--request-rates", default=None, help="comma list of req/s (1,2,4; quick: 1,4)")
    ap.add_argument("--num-prompts", type=int, default=None, help="per rate (32; quick: 8)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds over all servers (2; quick: 1)")
    ap.add_argument("--dataset-name", default="mix")
    ap.add_argument("--length-scale", type=float, default=0.25)
    ap.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:250"])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/vs_vllm_serve.json")
    a = ap.parse_args(argv)
    for name, full, quick in (("request_rates", "1,2,4", "1,4"), ("num_prompts", 32, 8),
                              ("rounds", 2, 1)):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    a.rates = [float(r) for r in str(a.request_rates).split(",")]
    a.names = [n.strip() for n in a.servers.split(",") if n.strip()]
    bad = [n for n in a.names if n not in SERVERS]
    if bad:
        ap.error(f"--servers must name only {', '.join(SERVERS)}, got {bad}")
    return a


# ---- the servers --------------------------------------------------------------------------------

@contextlib.contextmanager
def minserve_server(fmt: str, args, log_dir: Path):
    """``minserve serve`` on a free port, the format's ``--quantization`` (bf16: ``--dtype
    bfloat16``; fp32-high: ``--fp32-matmul-precision high``), until the block ends."""
    from vllm_peer import free_port, wait_healthy
    port = free_port()
    quant = {"fp32": [], "fp32-high": ["--fp32-matmul-precision", "high"],
             "bf16": ["--dtype", "bfloat16"]}.get(fmt, ["--quantization", fmt.removesuffix("-a8")])
    if fmt.endswith("-a8"):   # W8A8 / W4A8: the same weights, int8 activations
        quant += ["--quantization-config", json.dumps({"activations": "int8"})]
    cmd = [sys.executable, "-m", "minserve.cli", "serve", "smollm2-135m", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--no-enable-prefix-caching", *quant]
    log_path = log_dir / f"minserve-{fmt}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path, 300, name=f"minserve serve ({fmt})")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_server(stack: contextlib.ExitStack, name: str, args, log_dir: Path) -> str:
    kind, fmt = name.split("-", 1)
    if kind == "minserve":
        return stack.enter_context(minserve_server(fmt, args, log_dir))
    from vllm_peer import vllm_server, vllm_venv, vllm_venv_dir
    if vllm_venv() is None:
        raise SystemExit(f"no vLLM venv at {vllm_venv_dir()}: run `make vllm-venv`, or leave the "
                         "vllm-* servers out of --servers")
    cores = os.cpu_count() or 1
    peer = stack.enter_context(vllm_server(
        dtype={"fp32": "float32", "bf16": "bfloat16"}[fmt], max_model_len=args.max_model_len,
        extra_args=("--no-enable-prefix-caching", "--max-num-seqs", str(args.max_num_seqs)),
        log_dir=log_dir, env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}))
    return peer.base_url


# ---- one bench serve run ------------------------------------------------------------------------

def bench(base: str, args, out_dir: Path) -> dict[float, dict]:
    """``minserve bench serve`` over every rate against ``base``; {rate: the result's figures}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "minserve.cli", "bench", "serve", "--base-url", base,
           "--model", "smollm2-135m", "--dataset-name", args.dataset_name,
           "--length-scale", str(args.length_scale), "--num-prompts", str(args.num_prompts),
           "--seed", str(args.seed), "--request-rate", ",".join(f"{r:g}" for r in args.rates),
           "--goodput", *args.goodput, "--disable-tqdm", "--save-result",
           "--result-dir", str(out_dir)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(f"bench serve against {base} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    found = {}
    for path in out_dir.glob("*.json"):
        res = json.loads(path.read_text())
        found[float(res["request_rate"])] = {k: res.get(k) for k in (*FIGURES, "completed", "failed")}
        path.unlink()
    missing = [r for r in args.rates if r not in found]
    if missing:
        raise RuntimeError(f"bench serve wrote no result for rates {missing} (found {sorted(found)})")
    return found


def markdown(res: dict) -> str:
    rates = res["args"]["rates"]
    head = " / ".join(f"{r:g}" for r in rates)
    lines = [f"| server | goodput, req/s at {head} req/s | mean TTFT (ms) | mean TPOT (ms) |",
             "| --- | --- | --- | --- |"]
    for name, per in res["servers"].items():
        def col(key, fmt):
            return " / ".join(fmt.format(per[f"{r:g}"][key]) for r in rates)
        lines.append(f"| {name} | {col('request_goodput', '{:.2f}')} | {col('mean_ttft_ms', '{:.0f}')} "
                     f"| {col('mean_tpot_ms', '{:.0f}')} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(HERE))
    from bench_offline import machine_info
    from host_phase import phase_notes, probe_line, start_round

    log_dir = Path(tempfile.mkdtemp(prefix="minserve-vs-vllm-serve-"))
    runs: dict[str, list[dict]] = {n: [] for n in args.names}
    probes: dict[str, list[dict]] = {n: [] for n in args.names}
    load_start = os.getloadavg()
    with contextlib.ExitStack() as stack:
        bases = {}
        for name in args.names:
            print(f"starting {name} ...", flush=True)
            bases[name] = start_server(stack, name, args, log_dir)
        for r in range(args.rounds):
            order = args.names[r % len(args.names):] + args.names[:r % len(args.names)]
            for name in order:
                probe = start_round()   # vLLM keeps a core busy for ~1 s after its last request
                probes[name].append(probe)
                figs = bench(bases[name], args, log_dir / f"{name}-{r}")
                runs[name].append(figs)
                print(f"round {r + 1}/{args.rounds} {name}: goodput "
                      + " / ".join(f"{figs[x]['request_goodput']:.2f}" for x in args.rates)
                      + f" req/s at {args.request_rates} req/s ({probe_line(probe)})", flush=True)
    res = {"args": {k: v for k, v in vars(args).items()}, "machine": machine_info(),
           "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "logs": str(log_dir),
           "servers": {n: {f"{rate:g}": {k: statistics.median(run[rate][k] for run in runs[n])
                                         for k in FIGURES}
                           for rate in args.rates} for n in args.names},
           "runs": {n: [{f"{k:g}": v for k, v in run.items()} for run in runs[n]] for n in args.names},
           "host_probe_runs": probes}
    pairs = [(n, "vllm-" + n.split("-", 1)[1]) for n in args.names if n.startswith("minserve-")]
    res["phase_notes"] = phase_notes(probes, pairs)
    res["markdown"] = markdown(res) + "".join(f"\n\nNote: {n}." for n in res["phase_notes"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print("\n" + res["markdown"] + f"\n\nresults: {out}")


if __name__ == "__main__":
    main()
