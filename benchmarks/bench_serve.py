"""Online serving: `minserve bench serve` against `minserve serve`, mix workload, rising rates.

Reports, in one run on one machine:
- the rate sweep (throughput, TTFT/TPOT percentiles, goodput under the SLO);
- the knee: the first rate whose p99 TTFT leaves the SLO, and the goodput there;
- the HTTP + serving overhead: the same workload at one rate through the server and straight on an
  in-process engine with the same engine arguments (mean/median TTFT and TPOT side by side).

Client and server share the machine's cores, so the client's own CPU time is part of what the
HTTP path costs here; on a real deployment they would be apart.

    .venv/bin/python benchmarks/bench_serve.py [--rates 0.5,1,2,4,8 --num-prompts 48 --length-scale 0.5]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from minserve.bench.cli import build_parser, run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "minserve.cli", "serve", "--model", model,
                             "--port", str(port), "--log-level", "warning"])
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy within 180 s")


def bench(extra: list[str], a, seed: int, num_prompts: int | None = None) -> dict:
    """One `minserve bench serve` run. Every measured run gets its own seed, hence its own
    requests: repeating the same prompts would let the prefix cache replay earlier runs."""
    argv = ["--dataset-name", "mix", "--num-prompts", str(num_prompts or a.num_prompts), "--seed", str(seed),
            "--length-scale", str(a.length_scale), "--goodput", f"ttft:{a.slo_ttft_ms}", f"tpot:{a.slo_tpot_ms}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", *extra]
    return run(build_parser().parse_args(argv))[0]


def inprocess(a, seed: int) -> dict:
    """The same workload straight on an engine with the server's (default) engine arguments,
    after a warm-up run of other requests."""
    from minserve.bench.datasets import get_samples
    from minserve.bench.inprocess import run_inprocess
    from minserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_engine_args(a.model)
    kw = dict(ignore_eos=True, percentile_metrics=["ttft", "tpot", "itl", "e2el"], metric_percentiles=[50.0, 99.0],
              goodput={"ttft": a.slo_ttft_ms, "tpot": a.slo_tpot_ms})
    warm = get_samples("mix", engine.tokenizer, 8, seed + 1000, length_scale=a.length_scale)
    run_inprocess(engine, warm, **kw)
    reqs = get_samples("mix", engine.tokenizer, a.num_prompts, seed, length_scale=a.length_scale)
    return run_inprocess(engine, reqs, a.overhead_rate, 1.0, seed, **kw).summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rates", default="0.5,1,2,4,8")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--length-scale", type=float, default=0.5)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000)
    ap.add_argument("--slo-tpot-ms", type=float, default=250)
    ap.add_argument("--overhead-rate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/serve.json")
    a = ap.parse_args()
    port = free_port()
    server = start_server(a.model, port)
    rates = [float(r) for r in a.rates.split(",")]
    try:
        # Warm-up (not reported): a fresh process pays one-off costs on its first long prefills
        # (allocator growth, thread pools), which would land in the first rate's p99 TTFT.
        bench(["--port", str(port), "--request-rate", "inf"], a, seed=a.seed + 999, num_prompts=8)
        sweep = [bench(["--port", str(port), "--request-rate", str(r)], a, seed=a.seed + i)
                 for i, r in enumerate(rates)]
        http = bench(["--port", str(port), "--request-rate", str(a.overhead_rate)], a, seed=a.seed + 100)
    finally:
        server.terminate()
        server.wait(timeout=60)
    inproc = inprocess(a, seed=a.seed + 100)
    report(sweep, http, inproc, a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"sweep": sweep, "http": http, "inprocess": inproc}, indent=2, default=str))


def report(sweep: list[dict], http: dict, inproc: dict, a) -> None:
    print(f"\nmix workload, {a.num_prompts} requests per rate, length scale {a.length_scale}, {a.model}; "
          f"SLO: p99 TTFT <= {a.slo_ttft_ms:.0f} ms, TPOT <= {a.slo_tpot_ms:.0f} ms\n")
    print("| rate (req/s) | completed | req/s | output tok/s | p50 TTFT (ms) | p99 TTFT (ms) | p50 TPOT (ms) "
          "| p99 TPOT (ms) | goodput (req/s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    knee = None
    for s in sweep:
        print(f"| {s['request_rate']} | {s['completed']} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} "
              f"| {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | {s['median_tpot_ms']:.0f} "
              f"| {s['p99_tpot_ms']:.0f} | {s['request_goodput']:.2f} |")
        if knee is None and s["p99_ttft_ms"] > a.slo_ttft_ms:
            knee = s
    if knee:
        print(f"\nknee: p99 TTFT leaves the SLO at {knee['request_rate']} req/s "
              f"(p99 TTFT {knee['p99_ttft_ms']:.0f} ms); goodput there {knee['request_goodput']:.2f} req/s")
    else:
        print("\nknee: not reached in this sweep (p99 TTFT within the SLO at every rate)")
    print(f"\nHTTP + serving overhead at {a.overhead_rate} req/s (same workload, same engine arguments):\n")
    print("| path | mean TTFT (ms) | median TTFT (ms) | mean TPOT (ms) | median TPOT (ms) | mean ITL (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, s in (("HTTP (minserve serve)", http), ("in-process engine", inproc)):
        print(f"| {name} | {s['mean_ttft_ms']:.0f} | {s['median_ttft_ms']:.0f} | {s['mean_tpot_ms']:.1f} "
              f"| {s['median_tpot_ms']:.1f} | {s['mean_itl_ms']:.1f} |")
    print(f"\nTTFT +{http['mean_ttft_ms'] - inproc['mean_ttft_ms']:.0f} ms mean, "
          f"TPOT x{http['mean_tpot_ms'] / inproc['mean_tpot_ms']:.2f} through HTTP")


if __name__ == "__main__":
    main()
