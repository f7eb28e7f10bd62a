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

``--workload NAME|FILE`` takes a versioned workload file instead of a dataset
(:mod:`minserve.bench.workloads`: short_qa, rag, codegen, agent, capstone_mix): its lengths, its
arrival process (unless ``--burstiness`` is given), its request classes (sent as
``x-priority-class``) and each class's SLO, judged per class in the result's ``classes``. Every
result file carries the run's manifest (:mod:`minserve.bench.manifest`). ``minserve bench sweep``
(:mod:`minserve.bench.sweep_cli`) runs many of these over server and bench parameters.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path
from types import SimpleNamespace

from minserve.bench.datasets import DATASET_NAMES, SYNTHETIC, get_samples
from minserve.bench.manifest import LoadSampler, build_manifest, dataset_workload
from minserve.bench.metrics import DEFAULT_PERCENTILE_METRICS, METRIC_NAMES, parse_goodput
from minserve.bench.results import (BenchOptions, default_filename, format_summary, save_result,
                                    sweep_table)
from minserve.bench.workloads import load_workload, workload_names

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
    ap.add_argument("--dataset-name", choices=DATASET_NAMES, default=None,
                    help="vLLM's datasets and our scenarios (default: random)")
    ap.add_argument("--workload", default=None, metavar="NAME|FILE",
                    help=f"a versioned workload file ({', '.join(workload_names())}, or a path): "
                         "lengths, arrivals (unless --burstiness), classes and SLOs; not with --dataset-name")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT JSON file for --dataset-name sharegpt")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--request-rate", default="inf",
                    help="requests/s; inf sends all at once; a comma list (1,2,4) runs a sweep")
    ap.add_argument("--burstiness", type=float, default=None,
                    help="gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 more regular "
                         "(default: 1, or the workload's arrival process)")
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


def workload_of(args):
    """The --workload file, loaded and hash-checked once per args; None for a dataset."""
    if not getattr(args, "workload", None):
        return None
    if getattr(args, "_workload", None) is None or args._workload_key != args.workload:
        if args.dataset_name is not None:
            raise ValueError("give either --workload or --dataset-name, not both")
        args._workload, args._workload_key = load_workload(args.workload), args.workload
    return args._workload


def workload_entry(args) -> dict:
    """The manifest's ``workload`` entry for these flags (a workload file or a dataset)."""
    w = workload_of(args)
    common = {"seed": args.seed, "num_prompts": args.num_prompts, "length_scale": args.length_scale}
    if w is not None:
        return {**w.describe(), **common}
    name = args.dataset_name or "random"
    keys = {"random": ("random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len"),
            "sharegpt": ("dataset_path", "sharegpt_output_len")}.get(name, ("length_scale",))
    return {**dataset_workload(name, **{k: getattr(args, k) for k in keys}), **common}


def build_requests(args, tokenizer, seed: int, n: int):
    """The ``n`` requests these flags ask for, drawn with ``seed``."""
    w = workload_of(args)
    if w is not None:
        return w.requests(tokenizer, n, seed, args.length_scale)
    return get_samples(
        args.dataset_name or "random", tokenizer, n, seed, dataset_path=args.dataset_path,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len,
        sharegpt_output_len=args.sharegpt_output_len, length_scale=args.length_scale)


def options(args, rate: float) -> BenchOptions:
    w = workload_of(args)
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRIC_NAMES]
    if bad:
        raise ValueError(f"percentile_metrics must name only {', '.join(METRIC_NAMES)}, got {bad}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
    burstiness = args.burstiness if args.burstiness is not None else (w.burstiness if w else 1.0)
    return BenchOptions(
        request_rate=rate, burstiness=burstiness, seed=args.seed,
        max_concurrency=args.max_concurrency,
        # Workloads are synthetic too: their output lengths are part of the file.
        ignore_eos=args.ignore_eos or w is not None or (args.dataset_name or "random") in SYNTHETIC,
        disable_tqdm=args.disable_tqdm, percentile_metrics=metrics,
        metric_percentiles=_floats("metric_percentiles", args.metric_percentiles),
        goodput=parse_goodput(args.goodput), class_slos=w.class_slos() if w else None)


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
    """Runs one rate on the chosen backend; holds the engine or the HTTP target between rates.
    ``engine``: an engine to drive in process (the sweep builds one per server combination)."""

    def __init__(self, args, engine=None):
        self.args = args
        if args.backend == "inprocess":
            if engine is None and not args.model:
                raise ValueError("--backend inprocess needs --model (an alias or a local directory)")
            from minserve.engine.llm_engine import LLMEngine
            self.engine = engine or LLMEngine.from_engine_args(args.model, seed=args.seed)
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
                                ignore_eos=opts.ignore_eos, manifest=False)
            return [SimpleNamespace(success=bool(r.success), error=r.error)
                    for r in res.requests.itertuples()]
        from minserve.bench.client import warm_up
        return asyncio.run(warm_up(self.target, req, opts.ignore_eos, count, opts.max_concurrency))

    def run(self, requests, opts: BenchOptions, server: dict | None = None, pids: tuple = ()):
        """One measured run, its manifest attached (``server``: how the target is served, from
        the sweep; ``pids``: server processes whose CPU is ours, not "other load")."""
        workload = workload_entry(self.args)
        if self.args.backend == "inprocess":
            from minserve.bench.inprocess import run_inprocess
            fields = {k: v for k, v in vars(opts).items()
                      if k not in ("request_rate", "burstiness", "seed", "max_concurrency")}
            result = run_inprocess(self.engine, requests, opts.request_rate, opts.burstiness,
                                   opts.seed, opts.max_concurrency, workload=workload, **fields)
            if server:  # the sweep's account of the target (the engine's config is already there)
                result.manifest["server"] = {k: v for k, v in server.items() if k != "engine"}
            return result
        from minserve.bench.client import run_http
        load = LoadSampler(pids).start()
        result = asyncio.run(run_http(self.target, requests, opts, self.tokenizer,
                                      self.args.metrics_interval))
        server = server or {"kind": "external", "base_url": self.target.base_url}
        result.manifest = build_manifest(
            workload=workload, model=self.target.model, engine=server.get("engine"),
            server={k: v for k, v in server.items() if k != "engine"}, bench=vars(opts),
            load=load.stop())
        return result


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
        return build_requests(args, runner.tokenizer, seed, n)

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


BENCH_USAGE = ("usage: minserve bench serve [options]\n"
               "       minserve bench sweep {serve,plot,plot_pareto} [options]\n"
               "       minserve bench compare BASE NEW [options]\n"
               "       minserve bench gate --policy POLICY --baseline B --candidate C")


def bench_main(argv: list[str]) -> int:
    """``minserve bench serve | sweep | compare | gate ...``."""
    if argv and argv[0] == "serve":
        return main(argv[1:])
    if argv and argv[0] == "compare":
        from minserve.bench.compare_report import main as compare_main
        return compare_main(argv[1:])
    if argv and argv[0] == "gate":
        from minserve.bench.gate_cli import main as gate_main
        return gate_main(argv[1:])
    if argv and argv[0] == "sweep":
        from minserve.bench.sweep_cli import main as sweep_main
        return sweep_main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):  # every bench command's options, on one page
        print(BENCH_USAGE + "\n\n" + build_parser().format_help())
        from minserve.bench.compare_report import build_parser as compare_parser
        from minserve.bench.gate_cli import build_parser as gate_parser
        print(compare_parser().format_help() + "\n" + gate_parser().format_help())
        from minserve.bench.sweep_cli import main as sweep_main
        return sweep_main(["--help"])
    print(BENCH_USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
