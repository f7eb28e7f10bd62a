"""The sweep's loop: per server combination start a target, warm it, run its bench combinations
``num_runs`` times with the prefix cache reset before each, record results or failures, stop it.
(:mod:`minserve.bench.sweep` plans; this runs; :mod:`minserve.bench.sweep_targets` starts.)

Failures are data, not crashes: a server that does not start fails every bench combination
under it (one ``failed.json`` each, with the reason and the server log's tail), a run that
raises (the initial test request refused, the client's connection lost) fails that run; the
sweep goes on with the next. Each run's result is written as soon as it exists, so a sweep
killed halfway keeps what it measured and ``--resume`` continues from there.
"""

from __future__ import annotations

import itertools
import json
import time
import traceback
from pathlib import Path

from minserve.bench.sweep import (FAILED_FILE, Combination, SweepConfig, _done_runs, bench_args_for,
                                  sweep_manifest)
from minserve.bench.sweep_targets import StartFailed


class SweepRun:
    def __init__(self, cfg: SweepConfig, combos: list[Combination]):
        self.cfg, self.combos = cfg, combos
        self.target = cfg.target()
        self.pending = {c.name: [k for k in range(cfg.num_runs) if k not in _done_runs(cfg.output_dir / c.name)]
                        for c in combos}
        self.pbar = None

    def run(self) -> None:
        (self.cfg.output_dir / "manifest.json").write_text(
            json.dumps(sweep_manifest(self.cfg, self.combos), indent=1, default=str))
        total = sum(len(v) for v in self.pending.values())
        skipped = len(self.combos) * self.cfg.num_runs - total
        print(f"sweep: {len(self.combos)} combinations x {self.cfg.num_runs} runs: {total} to run"
              + (f", {skipped} already done (--resume)" if skipped else ""), flush=True)
        if self.cfg.show_progress and total:
            from tqdm import tqdm
            self.pbar = tqdm(total=total, desc="sweep", unit="run")
        try:
            key = lambda c: json.dumps(c.serve, sort_keys=True)  # noqa: E731
            for _, group in itertools.groupby(self.combos, key=key):
                group = [c for c in group if self.pending[c.name]]
                if group:
                    self.serve_group(group)
        finally:
            if self.pbar is not None:
                self.pbar.close()

    def _tick(self, combo: Combination, status: str) -> None:
        if self.pbar is not None:
            self.pbar.set_postfix_str(f"{status}: {combo.name[:60]}")
            self.pbar.update(1)

    def serve_group(self, group: list[Combination]) -> None:
        """One server combination: start it, run every bench combination under it, stop it."""
        log_dir = self.cfg.output_dir / group[0].name
        try:
            started = self.target.start(group[0].serve, log_dir)
        except StartFailed as e:
            for combo in group:
                self.fail(combo, "server start", str(e), self.pending[combo.name])
            return
        try:
            for combo in group:
                self.bench_combination(combo, started)
        finally:
            self.target.stop(started)

    def bench_combination(self, combo: Combination, started) -> None:
        from minserve.bench.cli import _Runner, build_requests, initial_test_run, options
        runs = self.pending[combo.name]
        try:
            args = bench_args_for(self.cfg, combo, started.base_url)
            runner = _Runner(args, engine=started.engine)
            opts = options(args, float(args.request_rate))
            requests = build_requests(args, runner.tokenizer, args.seed, args.num_prompts)
            # One unmeasured request first, as bench serve does: the server's cold start and a
            # wrong flag show here, not in run 0. Drawn apart (seed + 1), so nothing is cached.
            initial_test_run(runner, build_requests(args, runner.tokenizer, args.seed + 1, 1)[0],
                             opts, args.num_warmups)
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            self.fail(combo, "bench setup", f"{type(e).__name__}: {e}", runs)
            return
        for k in runs:
            try:
                reset = self.target.reset(started)
                result = runner.run(requests, opts, server={**started.info, **reset}, pids=started.pids)
            except Exception as e:  # noqa: BLE001
                self.fail(combo, f"run {k}", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}", [k])
                continue
            out = result.to_json()
            out.update(sweep_combination=combo.name, sweep_run=k, serve_params=combo.serve,
                       bench_params=combo.bench)
            path = self.cfg.output_dir / combo.name / f"run={k}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, default=str))
            self._tick(combo, "ok")
        self._clear_failure(combo)

    def fail(self, combo: Combination, stage: str, reason: str, runs: list[int]) -> None:
        """Record why ``runs`` of ``combo`` have no result; print it and move on."""
        combo_dir = self.cfg.output_dir / combo.name
        combo_dir.mkdir(parents=True, exist_ok=True)
        path = combo_dir / FAILED_FILE
        previous = json.loads(path.read_text()).get("failures", []) if path.is_file() else []
        entry = {"stage": stage, "reason": reason, "runs": runs, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path.write_text(json.dumps({"sweep_combination": combo.name, "serve_params": combo.serve,
                                    "bench_params": combo.bench, "failures": [*previous, entry]},
                                   indent=1, default=str))
        first_line = reason.strip().splitlines()[0] if reason.strip() else "?"
        print(f"sweep: {combo.name} failed at {stage}: {first_line}", flush=True)
        for _ in runs:
            self._tick(combo, "failed")

    def _clear_failure(self, combo: Combination) -> None:
        """A combination whose every run now has a result is no longer failed (a resumed retry)."""
        path: Path = self.cfg.output_dir / combo.name / FAILED_FILE
        if path.is_file() and len(_done_runs(path.parent)) >= self.cfg.num_runs:
            path.unlink()
