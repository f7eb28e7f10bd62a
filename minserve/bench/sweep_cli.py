"""``minserve bench sweep serve | plot | plot_pareto``: the command line of :mod:`minserve.bench.sweep`.

Examples::

    minserve bench sweep serve --model tiny-llama \\
        --serve-params '[{"max_num_seqs": 4}, {"max_num_seqs": 16}]' \\
        --bench-params '[{"request_rate": 1}, {"request_rate": 4}]' \\
        --bench-cmd "minserve bench serve --workload short_qa --num-prompts 20 --length-scale 0.25" \\
        --num-runs 3 -o results/sweep1
    minserve bench sweep serve ... --dry-run          # the plan, nothing run
    minserve bench sweep serve ... --resume           # only the runs still missing
    minserve bench sweep serve --in-process --model tiny-llama --serve-params '[...]' ...
    minserve bench sweep serve --base-url http://127.0.0.1:8000 --bench-params '[...]' ...
    minserve bench sweep plot results/sweep1 --var-x request_rate --var-y p99_ttft_ms
    minserve bench sweep plot_pareto results/sweep1 --var-y request_goodput
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

BENCH_PREFIXES = (["minserve", "bench", "serve"], ["vllm", "bench", "serve"],
                  ["python", "-m", "minserve.cli", "bench", "serve"])


def serve_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="minserve bench sweep serve",
        description="Benchmark every combination of server parameters x bench parameters, each "
                    "--num-runs times, the prefix cache reset between runs (vllm bench sweep serve's shape).")
    ap.add_argument("--serve-params", default=None, metavar="JSON|FILE",
                    help="JSON list of dicts of `minserve serve` flags (or an object of named dicts, or a "
                         "file holding either), e.g. '[{\"max_num_seqs\": 4}, {\"max_num_seqs\": 16}]'; "
                         "with --in-process: engine arguments")
    ap.add_argument("--bench-params", default=None, metavar="JSON|FILE",
                    help="JSON list of dicts of `minserve bench serve` flags, e.g. "
                         "'[{\"request_rate\": 1}, {\"request_rate\": 4}]'")
    ap.add_argument("--link-vars", "--link", dest="link", action="append", default=None,
                    metavar="SERVE_KEY=BENCH_KEY",
                    help="vary a server and a bench parameter together: keep only the combinations where "
                         "they are equal (repeatable, or a comma list)")
    ap.add_argument("--num-runs", type=int, default=3, help="runs per combination (default: 3)")
    ap.add_argument("-o", "--output-dir", default="results", help="where results go (default: results)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (commands, combinations), run nothing")
    ap.add_argument("--resume", action="store_true",
                    help="skip the runs whose result file exists in --output-dir (failed ones are retried)")
    ap.add_argument("--model", default=None, help="the model to serve and to count tokens with")
    target = ap.add_mutually_exclusive_group()
    target.add_argument("--base-url", default=None,
                        help="a running server (minserve or vLLM) instead of servers the sweep starts; "
                             "--serve-params must then be empty")
    target.add_argument("--in-process", action="store_true",
                        help="an engine in this process per server combination, no HTTP")
    ap.add_argument("--serve-cmd", default=None,
                    help="the server command to start (default: `minserve serve MODEL`); the sweep adds "
                         "--host, --port and each combination's flags")
    ap.add_argument("--bench-cmd", default="",
                    help="the base `minserve bench serve ...` command every run starts from (dataset or "
                         "--workload, --num-prompts, ...); bench parameters override its flags")
    ap.add_argument("--server-ready-timeout", type=float, default=300.0,
                    help="seconds to wait for a started server's /health (default: 300)")
    ap.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    ap.add_argument("--no-plots", action="store_true", help="do not write plots/ at the end")
    return ap


def plot_parser(pareto: bool) -> argparse.ArgumentParser:
    name = "plot_pareto" if pareto else "plot"
    ap = argparse.ArgumentParser(
        prog=f"minserve bench sweep {name}",
        description=("The Pareto front of tokens/s per user (or goodput) against tokens/s" if pareto else
                     "A metric against a parameter, one curve per server combination") + " from sweep results.")
    ap.add_argument("OUTPUT_DIR", help="a sweep's --output-dir (or a directory of bench serve result files)")
    ap.add_argument("--var-x", default="output_throughput" if pareto else "request_rate",
                    help="x-axis column of load_results() (default: %(default)s)")
    ap.add_argument("--var-y", default="tokens_per_s_per_user" if pareto else "p99_ttft_ms",
                    help="y-axis column (default: %(default)s; e.g. request_goodput, "
                         "short_qa.p99_ttft_ms)")
    if pareto:
        ap.add_argument("--label-by", default="combination", help="column naming the front's points")
    else:
        ap.add_argument("--curve-by", default="serve_label",
                        help="comma list of columns: one curve per value (default: serve_label)")
    ap.add_argument("--fig-dir", default="plots", help="directory for the PNG, relative to OUTPUT_DIR")
    return ap


def bench_base(command: str):
    """The base bench flags from ``--bench-cmd`` (its leading program words dropped)."""
    from minserve.bench.cli import build_parser
    words = shlex.split(command)
    for prefix in BENCH_PREFIXES:
        if words[:len(prefix)] == prefix:
            words = words[len(prefix):]
            break
    args = build_parser().parse_args(words)
    args._argv = words
    return args


def run_serve(argv: list[str]) -> int:
    from minserve.bench.sweep import SweepConfig, load_params, parse_link, run_sweep
    a = serve_parser().parse_args(argv)
    cfg = SweepConfig(
        serve_params=load_params(a.serve_params), bench_params=load_params(a.bench_params),
        bench_args=bench_base(a.bench_cmd), output_dir=Path(a.output_dir), link=parse_link(a.link),
        num_runs=a.num_runs, model=a.model, base_url=a.base_url, in_process=a.in_process,
        serve_cmd=shlex.split(a.serve_cmd) if a.serve_cmd else None,
        ready_timeout_s=a.server_ready_timeout, dry_run=a.dry_run, resume=a.resume,
        show_progress=not a.disable_tqdm, plots=not a.no_plots)
    if a.base_url and any(p for _, p in cfg.serve_params):
        raise ValueError("--base-url targets a running server: --serve-params must be empty")
    results = run_sweep(cfg)
    if not a.dry_run:
        ok = int((results.status == "ok").sum()) if len(results) else 0
        print(f"sweep: {ok} runs measured, {len(results) - ok} failed; table {cfg.output_dir / 'summary.csv'}")
    return 0


def run_plot(argv: list[str], pareto: bool) -> int:
    from minserve.bench.sweep_plot import load_results, pareto_frame, plot, plot_pareto
    a = plot_parser(pareto).parse_args(argv)
    out = Path(a.OUTPUT_DIR)
    df = load_results(out)
    fig_dir = out / a.fig_dir
    if pareto:
        path = fig_dir / f"pareto_{a.var_y}.png"
        plot_pareto(df, a.var_x, a.var_y, a.label_by, path=path)
        pareto_frame(df, a.var_x, a.var_y).to_csv(fig_dir / f"pareto_{a.var_y}.csv", index=False)
    else:
        path = fig_dir / f"{a.var_y}_vs_{a.var_x}.png"
        plot(df, a.var_x, a.var_y, [c for c in a.curve_by.split(",") if c], path=path)
    print(f"plot {path}")
    return 0


USAGE = "usage: minserve bench sweep {serve,plot,plot_pareto} [options]  (-h after one for its options)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        for parser in (serve_parser(), plot_parser(False), plot_parser(True)):
            print("\n" + parser.format_help())
        return 0
    commands = {"serve": run_serve, "plot": lambda r: run_plot(r, False),
                "plot_pareto": lambda r: run_plot(r, True)}
    if argv[0] not in commands:
        print(f"unknown sweep command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
