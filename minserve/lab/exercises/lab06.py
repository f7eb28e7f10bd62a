"""Lab 06 (speculative decoding): the three workloads, side-by-side runs of plain and speculative
decoding on the same prompts, the live board that shows them, and the exercises' checks.

How a comparison is measured (:func:`compare`, after ``benchmarks/bench_spec.py``): two engines
that differ only in ``speculative_config`` get the same group of prompts, greedy, and are stepped
*in turn*, one step each, so that a burst of other work on a shared machine slows both alike.
Each engine's step records give its own time; only decode-only steps count (a prefill chunk is the
same work for both and would blur the comparison). From them:

- speed-up: output tokens per second of decode-only steps, speculative over plain (a step many
  times slower than its neighbours is capped, :func:`steady_time`, so that a hiccup of a shared
  machine does not decide the result);
- tokens per target step: output tokens a request got per forward pass of the target model;
- verify cost: the median time of a step that verified proposals over that of a plain step;
- the vLLM counters' deltas: drafts, draft tokens, accepted tokens, and accepted tokens by position.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import statistics
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from minserve.lab.checks import ChoiceCheck, FunctionCheck, Mistake, NumberCheck, _fmt

WORKLOADS = ("copy", "code", "chat")
WORKLOAD_TEXT = {
    "copy": "fix the spelling of a paragraph given in the prompt and write it out again",
    "code": "add type hints to a Python function given in the prompt and return it whole",
    "chat": "free-form questions whose answers are nowhere in the prompt",
}

_CHAT = ["Tell me a short story about a lighthouse keeper.", "Why do cats purr? Explain briefly.",
         "Give three tips for learning to cook.", "What makes a good team leader?",
         "Describe a walk through a forest in autumn.", "How do airplanes stay in the air?",
         "Write a short poem about the sea.", "What should I pack for a weekend of hiking?"]


def _code_sources() -> list[str]:
    """Small standard-library functions, as written (the code workload edits them)."""
    import calendar
    import fnmatch
    import posixpath
    funcs = (textwrap.dedent, textwrap.indent, inspect.cleandoc, statistics.median, json.dumps,
             fnmatch.translate, posixpath.join, calendar.isleap, posixpath.splitext)
    out = []
    for f in funcs:
        try:
            out.append(textwrap.dedent(inspect.getsource(f)))
        except (OSError, TypeError):  # no source (a build without .py files): skip it
            continue
    return out


def _paragraph(text: str, sentences: int | None) -> str:
    if sentences is None:
        return text
    parts = text.split(". ")
    return ". ".join(parts[:sentences]).rstrip(".") + "."


def conversations(kind: str, n: int, sentences: int | None = None) -> list[list[dict]]:
    """``n`` one-turn chats of workload ``kind`` (copy, code or chat), cycling through the texts
    when ``n`` is larger than their number. ``sentences``: copy only, keep that many sentences
    of each paragraph (shorter prompts, for the large batches)."""
    if kind == "copy":
        from minserve.eval.data import load_texts
        texts = []
        for d in load_texts():
            d = _paragraph(d, sentences)
            texts.append("Correct the spelling mistakes in this text and write the whole text out "
                         f"again:\n\n{d.replace(' the ', ' teh ', 2).replace('which', 'whcih', 1)}")
    elif kind == "code":
        texts = ["Add a type hint to every parameter of this Python function and return it whole:"
                 f"\n\n{src}" for src in _code_sources()]
    elif kind == "chat":
        texts = list(_CHAT)
    else:
        raise ValueError(f"kind must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]


def prompt_ids(tokenizer, kind: str, n: int, sentences: int | None = None) -> list[list[int]]:
    """The token ids of :func:`conversations`, chat template applied (as ``LLM.chat`` does)."""
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            for c in conversations(kind, n, sentences)]


def spec_config(k: int, adaptive: bool = False, prompt_lookup_min: int = 1) -> dict:
    """This lab's ``speculative_config``: prompt lookup (n-gram), ``k`` proposals per step, from a
    match of 4 tokens down to ``prompt_lookup_min`` (1, the engine's default, which also proposes
    after a single matching token; ``benchmarks/bench_spec.py`` asks for 2)."""
    return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 4,
            "prompt_lookup_min": int(prompt_lookup_min), "adaptive": bool(adaptive)}


def make_engine(preset, k: int | None = None, adaptive: bool = False, prompt_lookup_min: int = 1,
                **engine_args):
    """An ``LLM`` with the preset's engine arguments (plus ``engine_args``), speculating with
    ``k`` proposals when ``k`` is given (:func:`spec_config`), warmed up. Several can live side
    by side (unlike ``lab.engine_for``): a comparison needs a plain and a speculative engine."""
    from minserve import LLM
    from minserve.lab.session import warm
    args = preset.engine_kwargs(**engine_args)
    if k:
        args["speculative_config"] = spec_config(k, adaptive, prompt_lookup_min)
    llm = LLM(preset.model, **args)
    warm(llm)
    return llm


# ---- the counters ------------------------------------------------------------------------------

_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """The engine's speculative-decoding counters now: ``drafts``, ``draft_tokens``,
    ``accepted``, and ``per_pos`` (an array, ``vllm:spec_decode_num_accepted_tokens_per_pos``
    by its ``position`` label). ``engine.snapshot()`` sums a labelled counter over its labels,
    so the positions are read from the Prometheus registry itself."""
    eng = getattr(llm, "llm_engine", llm)
    out: dict[str, Any] = {v: 0.0 for v in _COUNTERS.values()}
    per_pos: dict[int, float] = {}
    for family in eng.metrics.registry.collect():
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue  # the _created timestamps
            if family.name in _COUNTERS:
                out[_COUNTERS[family.name]] += s.value
            elif family.name == PER_POS:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    n = max(per_pos) + 1 if per_pos else 0
    out["per_pos"] = np.array([per_pos.get(i, 0.0) for i in range(n)])
    return out


def _add(a: dict, b: dict, sign: float = 1.0) -> dict:
    out = {k: a[k] + sign * b[k] for k in _COUNTERS.values()}
    x, y = a["per_pos"], b["per_pos"]
    n = max(len(x), len(y))
    out["per_pos"] = np.pad(x, (0, n - len(x))) + sign * np.pad(y, (0, n - len(y)))
    return out


def _zero() -> dict:
    return {**{k: 0.0 for k in _COUNTERS.values()}, "per_pos": np.zeros(0)}


# ---- runs --------------------------------------------------------------------------------------

@dataclass
class EngineRun:
    """One engine's run of one group of prompts (all added at once, stepped to the end)."""
    outputs: list[list[int]]
    steps: Any               # the engine's step records of this run (a DataFrame)
    counters: dict           # speculative-decoding counter deltas (zeros for a plain engine)
    trace: list[tuple[int, int]] = field(default_factory=list)  # (steps so far, tokens decoded so far)

    @property
    def decode(self):
        return decode_steps(self.steps)

    @property
    def decode_rate(self) -> float:
        """Output tokens per second over the decode-only steps, timed robustly (:func:`steady_time`)."""
        d = self.decode
        return float(d.produced.sum() / steady_time(d)) if len(d) else math.nan


def decode_steps(steps):
    """Decode-only steps (no prefill chunk) of a step frame, with ``rows`` (requests decoding
    in the step) and ``produced`` (output tokens the step gave them) added."""
    d = steps[(steps.num_prefill_tokens == 0) & (steps.num_decode_tokens > 0)].copy()
    d["rows"] = d.num_decode_tokens - d.num_spec_tokens
    d["produced"] = d.rows + d.num_accepted_spec_tokens
    return d


def steady_time(decode, window: int = 9, limit: float = 3.0) -> float:
    """The time of a run's decode steps with the machine's hiccups capped: a step that took more
    than ``limit`` times the median of the ``window`` steps around it (itself included) counts as
    that many medians. On a shared machine another process can take the CPU for a moment and make
    one step ten times slower; a plain sum would charge that to whichever engine was stepping.
    Real changes of cost (a verify step among plain ones, a batch that shrinks) stay well inside
    the limit and count in full."""
    t = decode.step_time_s.reset_index(drop=True)
    if t.empty:
        return 0.0
    med = t.rolling(window, center=True, min_periods=1).median()
    return float(np.minimum(t, limit * med).sum())


def run_side_by_side(llms: Sequence, prompts: Sequence[Sequence[int]], params,
                     on_step: Callable[[list], None] | None = None) -> list[EngineRun]:
    """Add ``prompts`` (token ids) to each engine at once, then step the engines in turn (one step
    each) until all are done. ``on_step(traces)`` is called after each round; a trace is the list
    of (steps taken, tokens decoded) of one engine."""
    from minserve.sampling_params import RequestOutputKind
    engs = [llm.llm_engine for llm in llms]
    for e in engs:
        if e.has_unfinished_requests():
            raise RuntimeError("an engine still has unfinished requests; a measured run needs it alone")
    p = params.clone()
    p.output_kind = RequestOutputKind.FINAL_ONLY
    before = [spec_counters(e) for e in engs]
    first = [e.num_steps for e in engs]
    tag = time.perf_counter_ns()
    ids = [f"lab06-{tag}-{i}" for i in range(len(prompts))]
    for e in engs:
        for rid, prompt in zip(ids, prompts):
            e.add_request(rid, {"prompt_token_ids": list(prompt)}, p)
    done: list[dict] = [{} for _ in engs]
    traces = [[(0.0, 0)] for _ in engs]
    while any(e.has_unfinished_requests() for e in engs):
        for j, e in enumerate(engs):
            if not e.has_unfinished_requests():
                continue
            for out in e.step():
                if out.finished:
                    done[j][out.request_id] = out
            s = e.last_step_stats
            if s is not None:
                steps_so_far, n = traces[j][-1]
                got = s.num_decode_tokens - s.num_spec_tokens + s.num_accepted_spec_tokens
                traces[j].append((steps_so_far + 1, n + got))
        if on_step is not None:
            on_step(traces)
    runs = []
    for j, e in enumerate(engs):
        steps = e.steps_frame()
        steps = steps[steps.step >= first[j]].reset_index(drop=True)
        outs = [list(done[j][r].outputs[0].token_ids) for r in ids]
        runs.append(EngineRun(outs, steps, _add(spec_counters(e), before[j], -1.0), traces[j]))
    return runs


@dataclass
class Pair:
    """Plain and speculative runs of the same groups of prompts: one row of the lab's tables."""
    workload: str
    k: int
    batch: int
    adaptive: bool
    plain: list[EngineRun] = field(default_factory=list)
    spec: list[EngineRun] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.workload}, k={self.k}, batch {self.batch}" + (", adaptive" if self.adaptive else "")

    @property
    def identical(self) -> bool:
        """Every request's greedy output is the same token for token with and without speculation."""
        return all(p.outputs == s.outputs for p, s in zip(self.plain, self.spec))

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for r in self.plain for o in r.outputs)

    @property
    def speedups(self) -> list[float]:
        return [s.decode_rate / p.decode_rate for p, s in zip(self.plain, self.spec)]

    @property
    def speedup(self) -> float:
        """Decode speed-up: median over the groups of (speculative / plain decode rate)."""
        v = [x for x in self.speedups if math.isfinite(x)]
        return statistics.median(v) if v else math.nan

    def counters(self) -> dict:
        out = _zero()
        for r in self.spec:
            out = _add(out, r.counters)
        return out

    @property
    def acceptance_rate(self) -> float:
        """vLLM's acceptance rate: accepted tokens / draft tokens."""
        c = self.counters()
        return c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else math.nan

    @property
    def mean_accepted_len(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted / drafts (tokens per verify step)."""
        c = self.counters()
        return 1 + c["accepted"] / c["drafts"] if c["drafts"] else math.nan

    def _decode(self, runs):
        import pandas as pd
        return pd.concat([r.decode for r in runs], ignore_index=True)

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per request per target forward pass, over all decode-only steps of the
        speculative runs (a step that found nothing to propose counts with its one token)."""
        d = self._decode(self.spec)
        return float(d.produced.sum() / d.rows.sum()) if len(d) else math.nan

    @property
    def draft_step_share(self) -> float:
        """Share of the speculative engine's decode-only steps that verified proposals."""
        d = self._decode(self.spec)
        return float((d.num_spec_tokens > 0).mean()) if len(d) else math.nan

    @property
    def cost_ratio(self) -> float:
        """What a verify step costs, in plain steps: the median time of the speculative engine's
        decode-only steps that verified proposals over the median time of the plain engine's
        decode-only steps, both taken while (nearly) the whole group was decoding, at least 90 %
        of its requests: the speculative engine's requests finish at different steps, and the
        last steps of a run, with few requests left, are cheaper."""
        d, p = self._decode(self.spec), self._decode(self.plain)
        d = d[d.num_spec_tokens > 0]
        floor = 0.9 * self.batch
        full_d, full_p = d[d.rows >= floor], p[p.rows >= floor]
        if len(full_d) and len(full_p):
            d, p = full_d, full_p
        if not len(d) or not len(p):
            return math.nan
        return float(d.step_time_s.median() / p.step_time_s.median())

    def row(self) -> dict:
        return {"workload": self.workload, "k": self.k, "batch": self.batch, "adaptive": self.adaptive,
                "speed-up": self.speedup, "acceptance rate": self.acceptance_rate,
                "mean accepted length": self.mean_accepted_len,
                "tokens per target step": self.tokens_per_step,
                "steps with drafts": self.draft_step_share,
                "verify cost (plain steps)": self.cost_ratio,
                "plain tok/s": statistics.median(r.decode_rate for r in self.plain),
                "spec tok/s": statistics.median(r.decode_rate for r in self.spec),
                "identical": self.identical}


def compare(plain, spec, prompts: Sequence[Sequence[int]], params, *, batch: int = 1,
            workload: str = "", k: int | None = None, board: "Board | None" = None) -> Pair:
    """Plain and speculative decoding on the same prompts, ``batch`` at a time (each group
    stepped side by side, see :func:`run_side_by_side`); ``board`` shows it live."""
    cfg = spec.llm_engine.config.speculative_config
    pair = Pair(workload, int(k if k is not None else cfg.num_speculative_tokens), int(batch),
                bool(cfg.adaptive))
    if board is not None:
        board.add(pair)
    for i in range(0, len(prompts) - batch + 1, batch):
        group = prompts[i:i + batch]
        on_step = board.tick if board is not None else None
        p, s = run_side_by_side([plain, spec], group, params, on_step=on_step)
        pair.plain.append(p)
        pair.spec.append(s)
        if board is not None:
            board.update()
    if board is not None:
        board.update()
    return pair


def table(pairs: Sequence[Pair]):
    """One row per comparison (:meth:`Pair.row`)."""
    import pandas as pd
    return pd.DataFrame([p.row() for p in pairs])


# ---- the model a learner builds ------------------------------------------------------------------

def expected_tokens(a: float, k: int) -> float:
    """Tokens per verify step when each of k proposals is accepted with probability ``a``
    independently, until the first refusal: 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    a = float(a)
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def per_position(pair: Pair) -> "object":
    """The per-position acceptance of a pair's speculative runs, one row per proposal position:
    ``accepted`` (the counter), ``reached`` = accepted / drafts (the share of drafts whose first
    i + 1 proposals were all accepted), ``conditional`` = accepted at i / accepted at i - 1 (the
    chance that proposal i is right once all before it were), and ``independent``: a^(i+1), what
    independent acceptance at the overall rate a would give."""
    import pandas as pd
    c = pair.counters()
    k = pair.k
    acc = np.pad(c["per_pos"], (0, max(0, k - len(c["per_pos"]))))[:k]
    drafts = c["drafts"]
    prev = np.concatenate([[drafts], acc[:-1]])
    a = pair.acceptance_rate
    return pd.DataFrame({
        "position": np.arange(1, k + 1), "accepted": acc.astype(int),
        "reached": acc / drafts if drafts else np.full(k, math.nan),
        "conditional": np.divide(acc, prev, out=np.full(k, math.nan), where=prev > 0),
        "independent": a ** np.arange(1, k + 1) if math.isfinite(a) else np.full(k, math.nan),
    })


def roofline_costs(model, batches: Sequence[int], k: int, context_len: int = 256,
                   hardware: str = "this"):
    """The planner's roofline (minserve.plan) for a plain decode step of ``b`` rows and a verify
    step of ``b * (k + 1)`` rows, for each batch size ``b``: times, what bounds each, and the
    ratio. Every row of a step reads the weights once between them (that is what batching
    shares) and does its own arithmetic."""
    import pandas as pd
    from minserve.plan import budget, plan
    from minserve.plan.hardware import get_hardware
    from minserve.plan.planner import model_config
    hw = get_hardware(hardware)
    p = plan(model, hardware=hw, context_len=context_len)
    _, cfg = model_config(model)
    rate = hw.flops_per_s(p.dtype)
    rows = []
    for b in batches:
        plain_ = budget.decode_step(cfg, p.weight_bytes_per_step, p.kv_bytes_per_token, b, context_len,
                                    hw.bandwidth_bytes_per_s, rate)
        ver = budget.decode_step(cfg, p.weight_bytes_per_step, p.kv_bytes_per_token, b * (k + 1),
                                 context_len, hw.bandwidth_bytes_per_s, rate)
        rows.append({"batch": b, "plain rows": b, "verify rows": b * (k + 1),
                     "plain step (ms)": 1000 * plain_.seconds, "plain bound": plain_.bound,
                     "verify step (ms)": 1000 * ver.seconds, "verify bound": ver.bound,
                     "verify cost (plain steps)": ver.seconds / plain_.seconds})
    return pd.DataFrame(rows), hw


def roofline_curve(model, rows: Sequence[int], context_len: int = 256, hardware: str = "this"):
    """The planner's decode-step roofline against the rows of one forward pass: the time to read
    the weights (and KV), the time of the arithmetic, and the step time, the larger of the two."""
    import pandas as pd
    from minserve.plan import budget, plan
    from minserve.plan.hardware import get_hardware
    from minserve.plan.planner import model_config
    hw = get_hardware(hardware)
    p = plan(model, hardware=hw, context_len=context_len)
    _, cfg = model_config(model)
    rate = hw.flops_per_s(p.dtype)
    out = []
    for r in rows:
        t = budget.decode_step(cfg, p.weight_bytes_per_step, p.kv_bytes_per_token, int(r), context_len,
                               hw.bandwidth_bytes_per_s, rate)
        out.append({"rows": int(r), "memory (ms)": 1000 * t.bytes / hw.bandwidth_bytes_per_s,
                    "compute (ms)": 1000 * t.flops / rate, "step (ms)": 1000 * t.seconds, "bound": t.bound})
    return pd.DataFrame(out)


def contention_note(rows, k: int) -> str:
    """A warning when a verify step cost more than ``k + 1`` plain steps: more than its extra
    rows' arithmetic can explain (k + 1 rows cost at most k + 1 times one row), so something
    else was competing for the CPU while it ran. Empty when every cost is plausible."""
    col = rows["verify cost (plain steps)"]
    bad = rows[col > k + 1]
    if bad.empty:
        return ""
    worst = float(bad["verify cost (plain steps)"].max())
    return (f"Note: a verify step cost up to {worst:.1f} plain steps here, more than the k + 1 = {k + 1} "
            "that its rows' arithmetic can explain. Something else was competing for the CPU while "
            "it ran, so these timings (not the token counts) are unreliable: rerun the cell when "
            "the machine is quieter.")


def stops_paying(rows) -> str:
    """The smallest batch size at which speculation ran slower than plain decoding
    (speed-up below 1), as a string, or ``"never"``; ``rows``: a table with batch and speed-up."""
    for _, r in rows.sort_values("batch").iterrows():
        if r["speed-up"] < 1.0:
            return str(int(r["batch"]))
    return "never"


# ---- the live board ----------------------------------------------------------------------------

class Board:
    """One figure, redrawn in place while comparisons run: tokens decoded against target steps
    taken for the group in flight (plain and speculative), and the speed-up of every comparison
    so far.

    Frames are spaced at least ``interval_s`` apart and at least 8 times the last frame's drawing
    time (as in :mod:`minserve.lab.live`: a frame delays the steps after it). Without a notebook
    nothing is shown and :meth:`finish` just returns the figure; under ``MINSERVE_LAB_CI=1`` only
    the final frame is rendered."""

    def __init__(self, title: str, label: Callable[[Pair], str] | None = None,
                 interval_s: float = 1.0):
        from minserve.lab.live import in_notebook
        from minserve.lab.presets import is_ci
        self.title, self.interval_s = title, interval_s
        self.label = label or (lambda p: p.label)
        self.pairs: list[Pair] = []
        self.enabled = in_notebook()
        self.frames = self.enabled and not is_ci()
        self.num_frames = 0
        self._fig = self._handle = None
        self._traces: list | None = None
        self._last = 0.0
        self._gap = 0.0

    def add(self, pair: Pair) -> None:
        if all(p is not pair for p in self.pairs):
            self.pairs.append(pair)

    def tick(self, traces) -> None:
        """Called after each round of steps with the traces of the group in flight."""
        self._traces = traces
        if not self.frames:
            return
        now = time.perf_counter()
        if now - self._last >= max(self.interval_s, self._gap):
            self._show(self.draw(running=True))
            t = time.perf_counter()
            self._gap, self._last = 8 * (t - now), t

    def update(self) -> None:
        """Called when a group has finished: redraw now."""
        self._traces = None
        if self.frames:
            self._show(self.draw(running=True))
            self._last = time.perf_counter()

    def draw(self, running: bool = False):
        from minserve.lab.live import new_figure
        if self._fig is None:
            self._fig = new_figure(2, width=12.0, height=3.8)
            self._fig.subplots_adjust(bottom=0.3)
        fig = self._fig
        ax1, ax2 = fig.axes
        for ax in fig.axes:
            ax.cla()
        traces, current = self._traces, self.pairs[-1] if self.pairs else None
        if traces is None and current is not None and current.spec:
            traces = [current.plain[-1].trace, current.spec[-1].trace]
        if traces:
            for tr, name, color in zip(traces, ("plain", "speculative"), ("tab:gray", "tab:blue")):
                x, n = zip(*tr)
                ax1.step(x, n, where="post", color=color, label=name)
            ax1.legend(loc="upper left")
        ax1.set_title(f"tokens per target step: {self.label(current)}" if current else "tokens per target step")
        ax1.set_xlabel("target steps (forward passes) so far")
        ax1.set_ylabel("tokens decoded (all requests)")
        done = [p for p in self.pairs if p.spec]
        values = [p.speedup for p in done]
        ax2.bar(range(len(values)), values,
                color=["tab:green" if v >= 1 else "tab:red" for v in values])
        ax2.axhline(1.0, color="black", lw=0.8)
        ax2.set_xticks(range(len(values)))
        ax2.set_xticklabels([self.label(p) for p in done], rotation=20, fontsize=8, ha="right")
        ax2.set_ylabel("decode speed-up (x)")
        ax2.set_title("speed-up so far (above 1: speculation paid)")
        fig.suptitle(self.title + (" (running...)" if running else ""), fontsize=11)
        return fig

    def _show(self, fig) -> None:
        from IPython.display import Image, display
        from minserve.lab.live import figure_png
        img = Image(data=figure_png(fig), format="png")
        if self._handle is None:
            self._handle = display(img, display_id=True)
        else:
            self._handle.update(img)
        self.num_frames += 1

    def finish(self):
        """The final frame (it stays in a saved notebook); returns the figure."""
        self._traces = None
        fig = self.draw()
        if self.enabled:
            self._show(fig)
        return fig


# ---- exploring by hand ---------------------------------------------------------------------------

class Explorer:
    """Runs one comparison with the settings of the panel (or of a direct call): workload, k,
    batch size, output tokens, adaptive rule. Keeps the last speculative engine it built, so
    that trying another workload with the same k does not reload the model."""

    def __init__(self, preset, plain, tokenizer, sentences: int | None = 2):
        self.preset, self.plain, self.tok, self.sentences = preset, plain, tokenizer, sentences
        self._spec_key = None
        self._spec = None
        self.results: list[Pair] = []

    def adopt(self, spec, k: int, adaptive: bool = False) -> None:
        """Use an engine the notebook already built for these settings."""
        self._spec_key, self._spec = (int(k), bool(adaptive)), spec

    def spec_engine(self, k: int, adaptive: bool):
        key = (int(k), bool(adaptive))
        if self._spec_key != key:
            self._spec = None  # free the old one first: one extra model in memory at a time
            self._spec = make_engine(self.preset, k=int(k), adaptive=bool(adaptive))
            self._spec_key = key
        return self._spec

    def run(self, workload: str = "copy", k: int = 4, batch: int = 1, max_tokens: int = 48,
            groups: int = 1, adaptive: bool = False, board: Board | None = None) -> Pair:
        from minserve import SamplingParams
        if batch > self.plain.llm_engine.config.max_num_seqs:
            raise ValueError(f"batch must be at most the engine's max_num_seqs "
                             f"({self.plain.llm_engine.config.max_num_seqs}), got {batch}")
        spec = self.spec_engine(k, adaptive)
        sentences = self.sentences if workload == "copy" and batch > 1 else None
        prompts = prompt_ids(self.tok, workload, batch * groups, sentences)
        params = SamplingParams(temperature=0, max_tokens=int(max_tokens))
        board = board or Board(f"{workload}, k={k}, batch {batch}")
        pair = compare(self.plain, spec, prompts, params, batch=batch, workload=workload, k=k, board=board)
        board.finish()
        self.results.append(pair)
        return pair


def panel(explorer: Explorer, **defaults):
    """Widgets for :meth:`Explorer.run` (a k slider, the workload, batch size, output tokens, the
    adaptive rule) and a Run button; returns the widget, or None with a note without ipywidgets."""
    try:
        import ipywidgets as w
    except ImportError:
        print("ipywidgets is not installed: call explorer.run(...) directly "
              "(pip install ipywidgets for the panel).")
        return None
    from IPython.display import display
    d = {"workload": "copy", "k": 4, "batch": 1, "max_tokens": 48, "adaptive": False, **defaults}
    style, layout = {"description_width": "150px"}, w.Layout(width="420px")
    max_b = explorer.plain.llm_engine.config.max_num_seqs
    ctl = {
        "workload": w.Dropdown(description="workload", options=list(WORKLOADS), value=d["workload"],
                               style=style, layout=layout),
        "k": w.IntSlider(description="k (proposals per step)", value=d["k"], min=1, max=7,
                         style=style, layout=layout),
        "batch": w.IntSlider(description="batch (requests)", value=min(d["batch"], max_b), min=1,
                             max=max_b, style=style, layout=layout),
        "max_tokens": w.IntSlider(description="output tokens", value=d["max_tokens"], min=8, max=256,
                                  step=8, style=style, layout=layout),
        "adaptive": w.Checkbox(description="adaptive rule", value=d["adaptive"], style=style),
    }
    button = w.Button(description="Run", button_style="primary", icon="play")
    out = w.Output()

    def on_click(_):
        button.disabled = True
        try:
            with out:
                out.clear_output()
                pair = explorer.run(**{k: c.value for k, c in ctl.items()})
                display(table([pair]).round(3))
        finally:
            button.disabled = False

    button.on_click(on_click)
    return w.VBox([w.HTML("<b>Speculative decoding: one comparison</b>"), *ctl.values(), button, out])


# ---- the exercises -------------------------------------------------------------------------------

def _num(a) -> bool:
    return isinstance(a, numbers.Number) and not isinstance(a, bool)


class _TokensCheck(FunctionCheck):
    """FunctionCheck that recognises the usual slips in the expected-tokens formula."""

    SLIPS = (
        (lambda a, k: expected_tokens(a, k) - 1,
         "it leaves out the token every verify step gives for free: the target's own token at "
         "the first refused position (or the bonus token after k accepted ones). Even with "
         "a = 0 a verify step yields 1 token."),
        (lambda a, k: 1 + k * a,
         "it adds k * a, as if every proposal were judged on its own. Proposal i only counts when "
         "all before it were accepted too, so its term is a^i, not a."),
        (lambda a, k: k * a,
         "k * a counts the proposals accepted on average if each were judged on its own; a verify "
         "step keeps proposals only up to the first refusal, and always adds one token of its own."),
        (lambda a, k: expected_tokens(a, k - 1),
         "one term short: with k proposals a step yields between 1 and k + 1 tokens, so the sum "
         "runs 1 + a + ... + a^k."),
    )

    def compare(self, answer, expected):
        ok, why = super().compare(answer, expected)
        if ok or not callable(answer):
            return ok, why
        got = []
        for kwargs, _ in expected:
            try:
                got.append((float(answer(**kwargs)), kwargs))
            except ZeroDivisionError:
                return False, ("it divides by zero at a = 1. When every proposal is accepted the "
                               "sum 1 + a + ... + a^k is simply k + 1: handle a == 1 on its own.")
            except Exception:  # noqa: BLE001 - the base message already says it raised
                return ok, why
        for slip, message in self.SLIPS:
            if all(abs(g - slip(kw["a"], kw["k"])) < 1e-6 for g, kw in got):
                return False, message
        return ok, why


def q3_tokens_per_step(measured: dict[str, float]) -> FunctionCheck:
    """The learner's ``tokens_per_step(a, k)``: expected tokens per verify step under independent
    acceptance. ``measured``: this run's acceptance rates by workload (at k = 4), used as cases."""
    cases = [({"a": round(float(a), 3), "k": 4}, expected_tokens(round(float(a), 3), 4))
             for a in measured.values() if math.isfinite(a)]
    cases += [({"a": 0.5, "k": 4}, 1.9375), ({"a": 0.0, "k": 3}, 1.0), ({"a": 0.8, "k": 6}, expected_tokens(0.8, 6)),
              ({"a": 1.0, "k": 4}, 5.0)]
    shown = ", ".join(f"{w} a = {a:.3f}" for w, a in measured.items() if math.isfinite(a))
    return _TokensCheck(
        "Exercise 3", cases,
        hint="a verify step always yields at least one token (the target's own). The first "
             "proposal adds one more with probability a, the second only if the first was kept "
             "too (a * a), and so on up to the k-th: add the k + 1 terms.",
        solution="def answer(a, k):\n"
                 "    if a >= 1:\n"
                 "        return k + 1.0\n"
                 "    return (1 - a ** (k + 1)) / (1 - a)",
        namespace={}, rel_tol=1e-6,
        tolerance_why="a formula: exact up to floating point",
        explanation=f"The cases include this run's acceptance rates ({shown}), a = 0 (one token, "
                    "never worse than plain decoding in tokens) and a = 1 (k + 1 tokens, the most a "
                    "step can give).")


class _EngineCheck(ChoiceCheck):
    """A ChoiceCheck about what the theory says, which also fails when the run contradicts the
    theory: then the engine, not the learner, is wrong, and the message says so."""

    def __init__(self, *args, run_agrees: bool, bug: str, **kw):
        super().__init__(*args, **kw)
        self.run_agrees, self.bug = run_agrees, bug

    def compare(self, answer, expected):
        if not self.run_agrees:
            return False, self.bug
        return super().compare(answer, expected)


def q1_identical(pairs: Sequence[Pair]) -> ChoiceCheck:
    """Did speculation change any greedy output? The theory says "same"; the check also fails
    (naming the engine) when the run produced different tokens."""
    pairs = list(pairs)
    differing = [p.label for p in pairs if not p.identical]
    n_req = sum(len(r.outputs) for p in pairs for r in p.plain)
    n_tok = sum(p.output_tokens for p in pairs)
    proposed = int(sum(p.counters()["draft_tokens"] for p in pairs))
    accepted = int(sum(p.counters()["accepted"] for p in pairs))
    return _EngineCheck(
        "Exercise 1", "same",
        options={
            "same": (f"all {n_req} requests ({n_tok} output tokens) came out token for token the "
                     f"same, although {proposed} proposals were verified and only {accepted} "
                     "kept. Every token that stays is one the target model picked itself at that "
                     "position: a proposal only decides how many positions one step checks."),
            "different": ("a greedy request keeps a proposal only where it equals the target "
                          "model's own choice at that position, and the first mismatch is "
                          "replaced by the model's choice. Whatever the proposer guesses, the "
                          "text is the one plain decoding writes; only the number of steps changes."),
        },
        hint="in a verify step the target model computes its own next token at every proposed "
             "position. Which tokens does the request keep?",
        solution='answer = "same" if all(p.identical for p in pairs) else "different"',
        namespace=lambda: {"pairs": pairs},
        run_agrees=not differing,
        bug=(f"the theory says 'same', but this engine produced different greedy tokens with "
             f"speculation in: {', '.join(differing)}. That is an engine bug (verification or "
             "rollback), not a wrong answer: report it with this notebook's settings."))


def q2_best_workload(pairs: Sequence[Pair]) -> ChoiceCheck:
    """Which workload gets the most tokens out of each target step (and so, at batch 1, the
    largest speed-up)? Decided by tokens per target step, which greedy decoding makes
    deterministic; the speed-ups are quoted."""
    by = {p.workload: p for p in pairs}
    best = max(by, key=lambda w: by[w].tokens_per_step)
    fastest = max(by, key=lambda w: by[w].speedup)

    def facts(w):
        p = by[w]
        acc = "no proposals" if not math.isfinite(p.acceptance_rate) else \
            f"acceptance rate {p.acceptance_rate:.2f}"
        return (f"{w}: {p.tokens_per_step:.2f} tokens per target step ({acc}, drafts in "
                f"{p.draft_step_share:.0%} of steps), speed-up {p.speedup:.2f}x")

    options = {}
    for w in by:
        if w == best:
            options[w] = (facts(w) + ". Its answer repeats long runs of its prompt, so the lookup "
                          "finds the continuation and the model agrees with it." +
                          ("" if fastest == best else
                           f" (The speed-up of {fastest} came out a little higher on this run: "
                           "timings move with the machine's load; token counts do not.)"))
        else:
            options[w] = (facts(w) + f"; compare {facts(best)}.")
    return ChoiceCheck(
        "Exercise 2", best, options=options,
        hint="prompt lookup can only propose text that already appears in the request. In which "
             "workload does the answer copy most of its prompt? The table has tokens per target "
             "step for each.",
        solution='answer = max(by_workload, key=lambda w: by_workload[w].tokens_per_step)',
        namespace=lambda: {"by_workload": by})


def q4_speedup(a: float, k: int, c: float, measured: float,
               tokens_per_step: float | None = None) -> NumberCheck:
    """The learner's predicted speed-up from the measured acceptance rate ``a``, ``k`` and the
    measured verify cost ``c`` (in plain steps): the model's value, E(a, k) / c. The measured
    speed-up (and tokens per target step) are quoted beside it and recognised as answers that
    read the run instead of applying the model (the model's error is sections 5 and 6's subject)."""
    E = expected_tokens(a, k)
    read_off = []
    if measured and math.isfinite(measured) and abs(measured / (E / c) - 1) > 0.03:
        read_off.append(Mistake(f"that is the speed-up this run measured ({measured:.2f}x, in the table). "
                                "The exercise asks what the model predicts from a, k and c alone; the "
                                "notebook compares the two right after.", value=measured, rel_tol=0.01))
    if tokens_per_step and math.isfinite(tokens_per_step) and abs(tokens_per_step / E - 1) > 0.03:
        read_off.append(Mistake(f"that divides the measured tokens per target step ({tokens_per_step:.2f}) "
                                "by c. The model's tokens per step come from a and k: E(a, k).",
                                value=tokens_per_step / c, rel_tol=0.01))
    model = E / c
    off = (model / measured - 1) if measured and math.isfinite(measured) else math.nan
    return NumberCheck(
        "Exercise 4", model, unit="x", rel_tol=0.03,
        tolerance_why="a, k and c are given to three digits; rounding moves the result by less",
        hint="a verify step yields E(a, k) tokens (your Exercise 3) where a plain step yields one, "
             "and it takes c plain steps' time. Tokens per unit of time, relative to plain decoding?",
        solution="answer = tokens_per_step_model(a, k) / c",
        namespace=lambda: {"a": a, "k": k, "c": c, "tokens_per_step_model": expected_tokens},
        explanation=(f"The run itself measured {measured:.2f}x: the model is {abs(off):.0%} "
                     f"{'high' if off > 0 else 'low'}. It assumes a proposal at every step and "
                     "independent acceptance; sections 5 and 6 show where each holds."
                     if math.isfinite(off) else ""),
        mistakes=[
            Mistake(f"that is E(a, k) = {E:.2f}, the tokens per verify step. A verify step also "
                    f"takes longer than a plain one ({c:.2f}x here): divide by that cost.",
                    value=E, rel_tol=0.03),
            Mistake(f"that divides by k + 1 = {k + 1}, as if checking k + 1 positions cost k + 1 "
                    f"plain steps. The measured cost is c = {c:.2f}: the rows share one read of "
                    "the weights.", value=E / (k + 1), rel_tol=0.03),
            Mistake("that multiplies by the cost; a dearer step makes speculation slower, so divide.",
                    value=E * c, rel_tol=0.03),
            Mistake("that uses 1 + k * a tokens per step, as if each proposal were judged on its "
                    "own: proposal i counts only when all before it were kept (a^i).",
                    value=(1 + k * a) / c, rel_tol=0.03),
            Mistake("that leaves out the target's own token in each verify step (E - 1).",
                    value=(E - 1) / c, rel_tol=0.03),
            *read_off,
        ])


def q5_stops_paying(rows) -> ChoiceCheck:
    """At which batch size of the sweep did speculation first run slower than plain decoding?
    ``rows``: the sweep's table (batch, speed-up, verify cost, tokens per target step)."""
    rows = rows.sort_values("batch")
    truth = stops_paying(rows)
    desc = {str(int(r["batch"])): (float(r["speed-up"]), float(r["verify cost (plain steps)"]),
                                   float(r["tokens per target step"]))
            for _, r in rows.iterrows()}

    def line(b):
        s, c, e = desc[b]
        return f"at batch {b}: {s:.2f}x (a verify step cost {c:.2f} plain steps and gave {e:.2f} tokens)"

    options = {}
    for b in desc:
        if b == truth:
            options[b] = (line(b) + ": the first batch size of the sweep where the extra rows cost "
                          "more than the extra tokens they brought.")
        else:
            options[b] = line(b) + ("; look for the first batch size below 1." if desc[b][0] >= 1
                                    else "; it was below 1, but not first.")
    options["never"] = ("speculation paid at every batch size of this sweep: " + "; ".join(
        line(b) for b in desc) + "." if truth == "never"
        else f"it stopped paying at batch {truth}: {line(truth)}.")
    return ChoiceCheck(
        "Exercise 5", truth, options=options,
        hint="read the speed-up column (or the figure): the first batch size with a speed-up below 1. "
             "Answer with that batch size, or \"never\".",
        solution="answer = first_batch_below_one(batch_table)",
        namespace=lambda: {"batch_table": rows, "first_batch_below_one": stops_paying})
