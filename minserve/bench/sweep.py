"""``minserve bench sweep``: benchmark every combination of server and bench parameters, N times.

vLLM's ``bench sweep`` shape. ``serve_params`` (a JSON list of dicts of server flags) and
``bench_params`` (a list of dicts of ``bench serve`` flags) are crossed: every server combination
meets every bench combination, or only those whose *linked* variables agree
(``link=[("max_num_seqs", "max_concurrency")]`` keeps the pairs where the two are equal, so they
vary together). A JSON object of named dicts works too; the names then label the combinations.
Each combination runs ``num_runs`` times (default 3: one run is an anecdote), with the prefix
cache reset before every run, so run 2 does not find run 1's prompts cached.

Per server combination one target is started (a ``minserve serve`` process on a free port, or an
engine in this process; ``--base-url`` uses a running server and then has no server parameters),
warmed with one unmeasured request per bench combination, measured, and stopped. A combination
whose server does not start, or whose runs fail, is recorded with its reason and the sweep goes
on. Layout of ``output_dir``::

    manifest.json                    the sweep: its parameters, plan and shared manifest
    summary.csv, summary.json        one row per run (failed combinations included)
    SERVE--<k=v...>-BENCH--<k=v...>/
        run=0.json ...               bench serve's result file, with the run's manifest
        failed.json                  why the combination failed (when it did)
        server.log                   the server's output (servers the sweep started)
    plots/                           p99 TTFT against offered load, Pareto fronts (PNG)

``resume=True`` skips runs whose result file exists (failed ones are tried again); without it an
``output_dir`` that already holds results is refused rather than mixed with. ``dry_run=True``
prints the plan (commands and combinations) and runs nothing. Notebooks read the results with
:func:`load_results` (a DataFrame), :func:`pareto_frame` and :func:`plot`.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from minserve.bench.sweep_plot import (load_results, pareto_frame, plot, plot_pareto,  # noqa: F401
                                       write_default_plots)
from minserve.bench.sweep_targets import ExistingServer, InProcessEngines, ServerProcesses

__all__ = ["Combination", "SweepConfig", "load_params", "plan", "run_sweep", "load_results",
           "pareto_frame", "plot", "plot_pareto"]
RUN_FILE = re.compile(r"^run=(\d+)\.json$")
FAILED_FILE = "failed.json"


@dataclass(frozen=True)
class Combination:
    serve: dict
    bench: dict
    serve_label: str = ""
    bench_label: str = ""

    @property
    def name(self) -> str:
        """vLLM's directory name: ``SERVE--k=v-k=v-BENCH--k=v`` (or the given labels)."""
        def part(label, params):
            text = label or "-".join(f"{k}={_short(v)}" for k, v in params.items()) or "default"
            return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", text)[:120]
        return f"SERVE--{part(self.serve_label, self.serve)}-BENCH--{part(self.bench_label, self.bench)}"


def _short(v) -> str:
    return json.dumps(v, separators=(",", ":")) if isinstance(v, (dict, list)) else str(v)


def load_params(value: str | list | dict | None) -> list[tuple[str, dict]]:
    """``(label, params)`` pairs from a JSON list of dicts, a JSON object of named dicts, a file
    holding either, or None (one empty combination: the defaults)."""
    if value is None or value == "":
        return [("", {})]
    if isinstance(value, str):
        path = Path(value)
        text = path.read_text(encoding="utf-8") if path.is_file() else value
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"parameters must be a JSON list of dicts (or a file holding one), "
                             f"got {text[:80]!r}: {e}") from None
    items = list(value.items()) if isinstance(value, dict) else [("", v) for v in value]
    if not items or any(not isinstance(p, dict) for _, p in items):
        raise ValueError(f"parameters must be a non-empty list of dicts, got {value!r}")
    return [(str(label), dict(p)) for label, p in items]


def parse_link(pairs: list[str] | str | None) -> list[tuple[str, str]]:
    """``["max_num_seqs=max_concurrency", ...]`` or vLLM's comma list -> pairs."""
    if not pairs:
        return []
    items = pairs.split(",") if isinstance(pairs, str) else [x for p in pairs for x in p.split(",")]
    out = []
    for item in (i.strip() for i in items if i.strip()):
        serve_key, sep, bench_key = item.partition("=")
        if not sep or not serve_key or not bench_key:
            raise ValueError(f"link must be SERVE_KEY=BENCH_KEY, got {item!r}")
        out.append((serve_key, bench_key))
    return out


def plan(serve: list[tuple[str, dict]], bench: list[tuple[str, dict]],
         link: list[tuple[str, str]] = ()) -> list[Combination]:
    """The Cartesian product, less the pairs whose linked variables disagree (a variable absent
    from either side links nothing)."""
    combos = []
    for (sl, s), (bl, b) in itertools.product(serve, bench):
        if all(s[sk] == b[bk] for sk, bk in link if sk in s and bk in b):
            combos.append(Combination(s, b, sl, bl))
    if not combos:
        raise ValueError(f"no combination of the server and bench parameters agrees on the linked "
                         f"variables {link}")
    names = [c.name for c in combos]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two combinations share the name {dup[0]!r}: give them labels (a JSON "
                         "object of named dicts) or different values")
    return combos


@dataclass
class SweepConfig:
    serve_params: list[tuple[str, dict]]
    bench_params: list[tuple[str, dict]]
    bench_args: argparse.Namespace       # the base `bench serve` flags every run starts from
    output_dir: Path
    link: list[tuple[str, str]] = field(default_factory=list)
    num_runs: int = 3
    model: str | None = None
    base_url: str | None = None
    in_process: bool = False
    serve_cmd: list[str] | None = None
    ready_timeout_s: float = 300.0
    dry_run: bool = False
    resume: bool = False
    show_progress: bool = True
    plots: bool = True

    def target(self):
        if self.in_process:
            return InProcessEngines(self.model)
        if self.base_url:
            return ExistingServer(self.base_url)
        return ServerProcesses(self.serve_cmd, self.model, self.ready_timeout_s)


def bench_args_for(cfg: SweepConfig, combo: Combination, base_url: str | None):
    """The base bench flags with the combination's bench parameters applied."""
    args = copy.copy(cfg.bench_args)
    known = set(vars(args))
    for key, value in combo.bench.items():
        if key not in known or key.startswith("_"):
            raise ValueError(f"bench parameter {key!r} is not a `minserve bench serve` flag; known: "
                             f"{sorted(k for k in known if not k.startswith('_'))}")
        setattr(args, key, str(value) if key == "request_rate" else value)
    if "," in str(args.request_rate):
        raise ValueError(f"a sweep runs one request rate per combination; put rates in bench "
                         f"parameters instead of {args.request_rate!r}")
    args.model = args.model or cfg.model
    args.disable_tqdm, args.save_result = True, False
    if cfg.in_process:
        args.backend = "inprocess"
    elif base_url:
        args.base_url = base_url
    return args


def _done_runs(combo_dir: Path) -> set[int]:
    if not combo_dir.is_dir():
        return set()
    return {int(m.group(1)) for p in combo_dir.iterdir() if (m := RUN_FILE.match(p.name))}


def _bench_command(cfg: SweepConfig, combo: Combination) -> str:
    from minserve.bench.sweep_targets import param_flags
    return " ".join(["minserve bench serve", *getattr(cfg.bench_args, "_argv", []),
                     *map(shlex.quote, param_flags(combo.bench))])


def describe_plan(cfg: SweepConfig, combos: list[Combination]) -> str:
    """What ``--dry-run`` prints: per server combination its command, then its bench runs."""
    target, lines = cfg.target(), []
    for serve, group in itertools.groupby(combos, key=lambda c: json.dumps(c.serve, sort_keys=True)):
        group = list(group)
        lines.append(f"server {' '.join(map(shlex.quote, target.command(group[0].serve)))}")
        for c in group:
            done = _done_runs(cfg.output_dir / c.name) if cfg.resume else set()
            todo = [k for k in range(cfg.num_runs) if k not in done]
            lines.append(f"  {c.name}: {len(todo)} of {cfg.num_runs} runs"
                         + (f" (runs {sorted(done)} done)" if done else ""))
            lines.append(f"    {_bench_command(cfg, c)}")
    total = len(combos) * cfg.num_runs
    lines.append(f"{len(combos)} combinations x {cfg.num_runs} runs = {total} runs into {cfg.output_dir}")
    return "\n".join(lines)


def _existing_results(out: Path) -> list[Path]:
    return [p for p in out.glob("SERVE--*/*.json") if RUN_FILE.match(p.name)] if out.is_dir() else []


def run_sweep(cfg: SweepConfig) -> "object":
    """Run the sweep (module docstring); returns :func:`load_results` of the output directory,
    or the plan's text with ``dry_run``."""
    combos = plan(cfg.serve_params, cfg.bench_params, cfg.link)
    for c in combos:  # every bench parameter checked before anything starts
        bench_args_for(cfg, c, None)
    if cfg.num_runs < 1:
        raise ValueError(f"num_runs must be >= 1, got {cfg.num_runs}")
    if cfg.dry_run:
        text = describe_plan(cfg, combos)
        print(text)
        return text
    if _existing_results(cfg.output_dir) and not cfg.resume:
        raise ValueError(f"{cfg.output_dir} already holds sweep results: pass --resume to add the "
                         "missing runs, or choose another --output-dir")
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    from minserve.bench.sweep_run import SweepRun
    SweepRun(cfg, combos).run()
    results = load_results(cfg.output_dir)
    write_summary(cfg.output_dir, results)
    if cfg.plots:
        for path in write_default_plots(results, cfg.output_dir / "plots"):
            print(f"plot {path}")
    return results


def write_summary(out: Path, results) -> None:
    """summary.csv and summary.json (rows plus the sweep's manifest)."""
    results.to_csv(out / "summary.csv", index=False)
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else None
    rows = json.loads(results.to_json(orient="records"))
    (out / "summary.json").write_text(json.dumps({"manifest": manifest, "rows": rows}, indent=1))


def sweep_manifest(cfg: SweepConfig, combos: list[Combination]) -> dict:
    """manifest.json: the sweep's parameters and the parts of the run manifest all runs share."""
    from minserve.bench.manifest import hardware_info, kernel_info, minserve_info
    return {"sweep": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "num_runs": cfg.num_runs,
                      "target": cfg.target().kind, "model": cfg.model, "base_url": cfg.base_url,
                      "link": cfg.link, "bench_base": getattr(cfg.bench_args, "_argv", []),
                      "combinations": [{"name": c.name, "serve": c.serve, "bench": c.bench} for c in combos]},
            "minserve": minserve_info(), "kernels": kernel_info(), "hardware": hardware_info()}
