"""``minserve bench serve``: the flags and result files of ``vllm bench serve``.

Examples::

    minserve bench serve --model tiny-llama --dataset-name qa --num-prompts 50 \\
        --request-rate 2 --save-result --result-dir results/
    minserve bench serve --dataset-name mix --request-rate 1,2,4,8 --goodput ttft:2000 tpot:200
    minserve bench serve --backend inprocess --model tiny-llama --dataset-name agent

Before anything is measured, as ``vllm bench serve`` does, an initial test run sends the first
prompt once and waits for its answer: a server that cannot answer it (wrong model or endpoint, a
missing key, a server still loading) stops the command with "Initial test run failed" and the
server's own error, instead of a table of failures; and a server that just started pays its cold
start (first allocations, kernel compilation, lazy imports) there, not in the first measured
request. ``--num-warmups N`` (vLLM's flag) sends that prompt N more times. Neither counts in any
result. Where we differ from vLLM: its test prompt is the first measured prompt, which a server
with prefix caching then serves from its cache; ours is a prompt of the same dataset drawn apart
(seed + number of rates), so no measured request finds it cached.

A comma list of rates runs one benchmark per rate, all after the one test run (the server stays
warm between rates), then prints a table. Rate k draws its prompts with ``--seed`` + k: the same
workload, fresh prompts, since with the very same prompts every rate after the first would be
served from the prefix cache (one rate alone uses ``--seed``, as before). Result files are written only with ``--save-result``,
as vLLM does: in ``--result-dir`` (default: the working directory), named
``--result-filename`` (default vLLM's ``{backend}-{rate}qps[-concurrencyN]-{model}-{date}.json``;
in a sweep the rate is added to a given name, one file per rate). Our additions to vLLM's flags: the scenario datasets (qa, rag, code, agent, mix) with
``--length-scale``, ``--metrics-interval`` (``/metrics`` sampling) and ``--backend inprocess``
(an engine in this process, no server). As vLLM does for ``random``, synthetic datasets send
``ignore_eos`` so the workload, not the model, sets output lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path
from types import SimpleNamespace

from minserve.bench.datasets import DATASET_NAMES, SYNTHETIC, get_samples
from minserve.bench.metrics import DEFAULT_PERCENTILE_METRICS, METRIC_NAMES, parse_goodput
from minserve.bench.results import (BenchOptions, default_filename, format_summary, save_result,
                                    sweep_table)

BACKENDS = ("openai", "openai-chat", "inprocess")
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minserve bench serve",
                                 description="Benchmark online serving (vllm bench serve compatible).")
    ap.add_argument("--backend", choices=BACKENDS, default="openai")
    ap.add_argument("--base-url", default=None, help="server URL, instead of --host/--port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--endpoint", default=None,
                    help="API path (default /v1/completions; /v1/chat/completions for openai-chat)")
    ap.add_argument("--model", default=None, help="model id (default: first from GET /v1/models)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer for lengths (default: --model)")
    ap.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT JSON file for --dataset-name sharegpt")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--request-rate", default="inf",
                    help="requests/s; inf sends all at once; a comma list (1,2,4) runs a sweep")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 more regular")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    ap.add_argument("--percentile-metrics", default=DEFAULT_PERCENTILE_METRICS,
                    help=f"comma list of {','.join(METRIC_NAMES)}")
    ap.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    ap.add_argument("--num-warmups", type=int, default=0,
                    help="requests of the first prompt sent after the initial test run, unmeasured")
    ap.add_argument("--save-result", action="store_true", help="write a JSON result file per rate")
    ap.add_argument("--result-dir", default=None,
                    help="where --save-result writes (default: the working directory)")
    ap.add_argument("--result-filename", default=None,
                    help="file name for --save-result (default: vLLM's {backend}-{rate}qps-...json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--metrics-interval", type=float, default=1.0,
                    help="seconds between /metrics samples during the run")
    g = ap.add_argument_group("dataset options")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply the scenario datasets' lengths (e.g. 0.25 on a laptop CPU)")
    return ap


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request_rate must be a number > 0, inf, or a comma list of them, got {text!r}")
    return rates


def _floats(name: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"{name} must be a comma list of numbers in [0, 100], got {text!r}")
    return values


def load_bench_tokenizer(name: str):
    """A minserve alias or local directory first (offline); else transformers' own lookup."""
    from minserve.models.loader import load_tokenizer, resolve_model_dir
    try:
        return load_tokenizer(resolve_model_dir(name))
    except ValueError:
        pass
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - re-raised as a flag error
        raise ValueError(f"could not load a tokenizer for {name!r} ({type(e).__name__}); pass "
                         "--tokenizer with a minserve alias or a local model directory") from e


def options(args, rate: float) -> BenchOptions:
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRIC_NAMES]
    if bad:
        raise ValueError(f"percentile_metrics must name only {', '.join(METRIC_NAMES)}, got {bad}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
    return BenchOptions(
        request_rate=rate, burstiness=args.burstiness, seed=args.seed,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos or args.dataset_name in SYNTHETIC,
        disable_tqdm=args.disable_tqdm, percentile_metrics=metrics,
        metric_percentiles=_floats("metric_percentiles", args.metric_percentiles),
        goodput=parse_goodput(args.goodput))


def _result_path(args, summary: dict, sweep: bool) -> Path:
    if args.result_filename:
        name = Path(args.result_filename)
        if sweep:  # one file per rate: keep the user's name, tag it with the rate
            name = name.with_name(f"{name.stem}-{summary['request_rate']}qps{name.suffix or '.json'}")
    else:
        rate = summary["request_rate"]
        name = Path(default_filename(args.backend, math.inf if rate == "inf" else rate,
                                     args.max_concurrency, summary["model_id"], summary["date"]))
    return Path(args.result_dir) / name if args.result_dir else name


class _Runner:
    """Runs one rate on the chosen backend; holds the engine or the HTTP target between rates."""

    def __init__(self, args):
        self.args = args
        if args.backend == "inprocess":
            if not args.model:
                raise ValueError("--backend inprocess needs --model (an alias or a local directory)")
            from minserve.engine.llm_engine import LLMEngine
            self.engine = LLMEngine.from_engine_args(args.model, seed=args.seed)
            self.tokenizer = self.engine.tokenizer
            return
        from minserve.bench.client import Target, fetch_model_id
        base = args.base_url.rstrip("/") if args.base_url else (
            f"http://[{args.host}]:{args.port}" if ":" in args.host else f"http://{args.host}:{args.port}")
        model = args.model or asyncio.run(fetch_model_id(base))
        endpoint = args.endpoint or ENDPOINTS[args.backend]
        self.tokenizer = load_bench_tokenizer(args.tokenizer or model)
        self.target = Target(api_url=base + endpoint, base_url=base, model=model,
                             chat=args.backend == "openai-chat", tokenizer_id=args.tokenizer or model)

    def warm_up(self, req, opts: BenchOptions, count: int) -> list:
        """``count`` unmeasured requests of ``req``; their RequestRecords."""
        if self.args.backend == "inprocess":
            from minserve.bench.inprocess import run_inprocess
            res = run_inprocess(self.engine, [req] * count, max_concurrency=opts.max_concurrency,
                                ignore_eos=opts.ignore_eos)
            return [SimpleNamespace(success=bool(r.success), error=r.error)
                    for r in res.requests.itertuples()]
        from minserve.bench.client import warm_up
        return asyncio.run(warm_up(self.target, req, opts.ignore_eos, count, opts.max_concurrency))

    def run(self, requests, opts: BenchOptions):
        if self.args.backend == "inprocess":
            from minserve.bench.inprocess import run_inprocess
            fields = {k: v for k, v in vars(opts).items()
                      if k not in ("request_rate", "burstiness", "seed", "max_concurrency")}
            return run_inprocess(self.engine, requests, opts.request_rate, opts.burstiness,
                                 opts.seed, opts.max_concurrency, **fields)
        from minserve.bench.client import run_http
        return asyncio.run(run_http(self.target, requests, opts, self.tokenizer,
                                    self.args.metrics_interval))


def initial_test_run(runner: _Runner, req, opts: BenchOptions, num_warmups: int) -> None:
    """vLLM's initial single-prompt test run, then ``num_warmups`` more; nothing is measured."""
    print("Starting initial single prompt test run...", flush=True)
    rec, = runner.warm_up(req, opts, 1)
    if not rec.success:
        raise ValueError("Initial test run failed - please make sure the benchmark arguments "
                         "(--base-url/--host/--port, --endpoint, --backend, --model, "
                         f"$OPENAI_API_KEY) match the server. Error: {rec.error}")
    print("Initial test run completed.", flush=True)
    if num_warmups:
        print(f"Warming up with {num_warmups} requests...", flush=True)
        runner.warm_up(req, opts, num_warmups)  # their outcome does not matter, as in vLLM
        print("Warmup run completed.", flush=True)
    print("Starting main benchmark run...", flush=True)


def run(args) -> list[dict]:
    rates = parse_rates(args.request_rate)
    if args.num_warmups < 0:
        raise ValueError(f"num_warmups must be >= 0, got {args.num_warmups}")
    if not args.save_result and (args.result_dir or args.result_filename):
        print("note: --result-dir/--result-filename only apply with --save-result; nothing is "
              "written without it (as in vLLM)", file=sys.stderr)
    for r in rates:
        options(args, r)  # validate every flag before loading anything
    if not args.metrics_interval > 0:
        raise ValueError(f"metrics_interval must be > 0 seconds, got {args.metrics_interval}")
    runner = _Runner(args)

    def prompts(seed: int, n: int):
        return get_samples(
            args.dataset_name, runner.tokenizer, n, seed, dataset_path=args.dataset_path,
            random_input_len=args.random_input_len, random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
            sharegpt_output_len=args.sharegpt_output_len, length_scale=args.length_scale)

    # Rate k draws its prompts with seed + k, and the test run a prompt of its own (seed + the
    # number of rates): replaying one set of prompts, every rate after the first (and the first
    # measured request, with vLLM's choice of test prompt) would find its prompts in the server's
    # prefix cache and skip their prefill. That, more than the server's cold start, is what made
    # the lightest rate of a sweep look the slowest.
    initial_test_run(runner, prompts(args.seed + len(rates), 1)[0], options(args, rates[0]),
                     args.num_warmups)
    summaries, sweep = [], len(rates) > 1
    for k, rate in enumerate(rates):
        opts = options(args, rate)
        print(f"Traffic request rate: {rate}  burstiness: {opts.burstiness}  "
              f"max concurrency: {opts.max_concurrency}  prompts: seed {args.seed + k}", flush=True)
        result = runner.run(prompts(args.seed + k, args.num_prompts), opts)
        print(format_summary(result.summary, opts.metric_percentiles), flush=True)
        if args.save_result:
            path = save_result(result.to_json(), _result_path(args, result.summary, sweep))
            print(f"saved {path}")
        summaries.append(result.summary)
    if sweep:
        print(sweep_table(summaries))
    return summaries


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
