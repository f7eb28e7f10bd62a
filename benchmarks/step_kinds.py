"""Where a minserve workload's time goes, by kind of step: the profile behind a mixed-workload figure.

A step is *prefill* (prompt chunks only), *decode* (decode or verify rows only, the fused C step
on a CPU) or *mixed* (both: it runs through the PyTorch model, its decode rows at the chunk's
pace). :class:`StepKinds` is a step observer (minserve/engine/observers.py): it clocks each step
from its schedule to its sampled tokens and adds the time, the step's rows and its prompt tokens to
its kind. Nothing is patched; an engine without the observer runs as before.

    kinds = StepKinds()
    llm.llm_engine.add_step_observer(kinds)
    llm.generate(...)
    llm.llm_engine.remove_step_observer(kinds)
    print(kinds.table())
"""

from __future__ import annotations

import time

from minserve.engine.observers import ScheduledBatch, StepObserver, StepResult

KINDS = ("prefill", "mixed", "decode")


class StepKinds(StepObserver):
    def __init__(self) -> None:
        self.totals = {k: {"steps": 0, "seconds": 0.0, "prompt_tokens": 0, "decode_rows": 0}
                       for k in KINDS}
        self.rows: dict[str, list[int]] = {k: [] for k in KINDS}   # each step's rows (tokens)
        self._open: tuple[str, float] | None = None

    def on_schedule(self, batch: ScheduledBatch) -> None:
        prompt, decode = batch.num_prefill_tokens, batch.num_decode_tokens
        kind = "mixed" if prompt and decode else ("prefill" if prompt else "decode")
        t = self.totals[kind]
        t["steps"] += 1
        t["prompt_tokens"] += prompt
        t["decode_rows"] += decode
        self.rows[kind].append(prompt + decode)
        self._open = (kind, time.perf_counter())

    def on_step_end(self, result: StepResult) -> None:
        if self._open is not None:
            kind, t0 = self._open
            self.totals[kind]["seconds"] += time.perf_counter() - t0
            self._open = None

    def summary(self) -> dict:
        """Per kind: steps, seconds, share of all stepped seconds, prompt tokens, decode rows,
        median rows per step."""
        total = sum(t["seconds"] for t in self.totals.values()) or 1.0
        out = {}
        for k, t in self.totals.items():
            rows = sorted(self.rows[k])
            out[k] = {**t, "share": t["seconds"] / total,
                      "median_rows": rows[len(rows) // 2] if rows else 0}
        return out

    def table(self) -> str:
        lines = ["| step kind | steps | seconds | share | prompt tokens | decode rows | median rows a step |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]
        for k, s in self.summary().items():
            lines.append(f"| {k} | {s['steps']} | {s['seconds']:.1f} | {s['share']:.0%} | "
                         f"{s['prompt_tokens']} | {s['decode_rows']} | {s['median_rows']} |")
        return "\n".join(lines)
