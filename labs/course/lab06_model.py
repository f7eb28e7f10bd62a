"""Lab 06's model of speculation: tokens per step from an acceptance rate, acceptance by position,
and the planner's roofline that says where verify steps stop being nearly free."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from course.lab06_measure import Pair


# ---- the model a learner builds ------------------------------------------------------------------

def expected_tokens(a: float, k: int) -> float:
    """Tokens per verify step when each of k proposals is accepted with probability ``a``
    independently, until the first refusal: 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    a = float(a)
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def model_gaps(pairs: Sequence[Pair]):
    """Section 5's table: for each comparison with proposals, the model's prediction E(a, k) / c
    against the measured speed-up, and the two things the model assumes, as this run measured
    them: the tokens a verify step really yielded (vLLM's mean accepted length, against E(a, k))
    and the share of steps that had anything to verify (the model: all of them).

    ``refined`` puts both measured values in place of the assumptions: tokens per step
    s * L + (1 - s) over time per step s * c + (1 - s), with s the share of steps with drafts and
    L the mean accepted length. What is left between it and the measurement is timing (the
    speed-up is a ratio of rates, c a ratio of medians). ``runs effect`` and ``draft-free effect``
    are the factors each assumption alone moves the prediction by."""
    import pandas as pd
    rows = []
    for p in pairs:
        a, c, s, L = p.acceptance_rate, p.cost_ratio, p.draft_step_share, p.mean_accepted_len
        if not all(math.isfinite(x) for x in (a, c, s, L)) or c <= 0:
            continue
        E = expected_tokens(a, k=p.k)
        predicted = E / c
        draft_free = (s * E + 1 - s) / (s * c + 1 - s)
        refined = (s * L + 1 - s) / (s * c + 1 - s)
        rows.append({"comparison": p.label, "workload": p.workload, "k": p.k,
                     "predicted": predicted, "measured": p.speedup, "error": predicted / p.speedup - 1,
                     "E(a, k)": E, "tokens per verify step": L, "steps with drafts": s,
                     "runs effect": L / E, "draft-free effect": draft_free / predicted,
                     "refined": refined, "refined error": refined / p.speedup - 1})
    return pd.DataFrame(rows)


def explain_gaps(gaps, close: float = 0.1) -> list[str]:
    """One sentence per workload of :func:`model_gaps`'s table: how far off the model was
    (median over its comparisons) and which of its assumptions the run broke most, both read off
    the table, never assumed; then how close the refined prediction came."""
    out = []
    for w, t in gaps.groupby("workload", sort=False):
        err = float(t.error.median())
        n = len(t)
        head = f"{w} ({n} comparison{'s' if n > 1 else ''}): the model is "
        if abs(err) <= close:
            out.append(head + f"within {abs(err):.0%} of the run (median)")
            continue
        runs = float(np.exp(np.median(np.log(t["runs effect"]))))
        free = float(np.exp(np.median(np.log(t["draft-free effect"]))))
        s = float(t["steps with drafts"].median())
        text = head + f"{abs(err):.0%} {'high' if err > 0 else 'low'} (median)"
        if abs(math.log(runs)) >= abs(math.log(free)):
            text += (f": its verify steps yielded {runs:.2f} times the tokens E(a, k) expects from its "
                     f"acceptance rate, with drafts in {s:.0%} of its steps. Acceptance is not "
                     "independent: " +
                     ("accepted guesses come in runs (section 6)" if runs > 1 else
                      "refusals come together more than an overall rate says"))
        else:
            text += (f": only {s:.0%} of its steps had anything to verify, and the others were plain "
                     f"steps, one token for the cost of one, where the model charges every step c for "
                     f"E(a, k) tokens")
        out.append(text + f". With both measured in place of the assumptions it is off by "
                   f"{abs(float(t['refined error'].median())):.0%}")
    return out


def rule_stops(pair: Pair, min_plain: int = 2) -> dict:
    """Where an adaptive engine stopped proposing: ``stops`` counts the stretches of at least
    ``min_plain`` decode steps without drafts, ``after_refusal`` those that came right after a
    verify step that kept nothing, and ``plain_steps`` the steps in such stretches; ``single``
    counts lone steps without drafts between verify steps (the rule probing the other choice, or
    a lookup that found nothing). Read per group (a group's requests start afresh)."""
    stops = after = plain = single = 0
    for run in pair.spec:
        d = run.decode
        has = (d.num_spec_tokens.to_numpy() > 0)
        acc = d.num_accepted_spec_tokens.to_numpy()
        i = 0
        while i < len(has):
            if has[i]:
                i += 1
                continue
            j = i
            while j < len(has) and not has[j]:
                j += 1
            if j - i >= min_plain and i > 0:
                stops += 1
                plain += j - i
                after += int(acc[i - 1] == 0)
            elif j - i == 1 and 0 < i and j < len(has):
                single += 1
            i = j
    return {"stops": stops, "after_refusal": after, "plain_steps": plain, "single": single}


def adaptive_cost(always: Pair, adaptive: Pair, most: float = 0.95) -> str:
    """What the adaptive rule cost on a workload where proposals pay, in words, from the two runs
    (``always``: proposing at every step; ``adaptive``: with the rule): how much of the speed-up
    it kept and, where it kept less than ``most``, where the rest went, as measured: stretches of
    plain steps (and whether a refused draft came right before them), lone probes, dearer verify
    steps."""
    kept = adaptive.speedup / always.speedup
    head = (f"On {adaptive.workload} the rule kept {kept:.0%} of the speed-up of always proposing "
            f"({adaptive.speedup:.2f}x against {always.speedup:.2f}x)")
    if kept >= most:
        return head + "."
    st = rule_stops(adaptive)
    why = []
    if st["stops"]:
        why.append(f"it stopped proposing {st['stops']} time{'s' if st['stops'] > 1 else ''} for two "
                   f"steps or more ({st['plain_steps']} plain steps in all), {st['after_refusal']} of "
                   "them right after a verify step that kept nothing: a stretch of refused guesses "
                   "pulls its estimate of the steps with proposals below plain steps, and it looks "
                   "again only at its next probe")
    if st["single"]:
        why.append(f"{st['single']} lone step{'s' if st['single'] > 1 else ''} without drafts between "
                   "verify steps (its probes of the other choice, one token each)")
    if adaptive.cost_ratio > 1.05 * always.cost_ratio:
        why.append(f"its verify steps cost {adaptive.cost_ratio:.2f} plain steps against "
                   f"{always.cost_ratio:.2f} without the rule (timing, not the rule's choice)")
    if not why:
        return head + ": no stretch of plain steps, no probe and no dearer verify step explain the rest."
    return head + ". Where the rest went, as measured: " + "; ".join(why) + "."


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


def _decode_step_time(model, context_len: int, hardware: str):
    """The planner's roofline for ``model`` on ``hardware``: (hardware, FLOP/s, a function from the
    rows of one decode step to its budget.decode_step estimate)."""
    from minserve.plan import budget, plan
    from minserve.plan.hardware import get_hardware
    from minserve.plan.planner import model_config
    hw = get_hardware(hardware)
    p = plan(model, hardware=hw, context_len=context_len)
    _, cfg = model_config(model)
    rate = hw.flops_per_s(p.dtype)

    def step(rows: int):
        return budget.decode_step(cfg, p.weight_bytes_per_step, p.kv_bytes_per_token, int(rows), context_len,
                                  hw.bandwidth_bytes_per_s, rate)
    return hw, rate, step


def roofline_costs(model, batches: Sequence[int], k: int, context_len: int = 256,
                   hardware: str = "this"):
    """The planner's roofline (minserve.plan) for a plain decode step of ``b`` rows and a verify
    step of ``b * (k + 1)`` rows, for each batch size ``b``: times, what bounds each, and the
    ratio. Every row of a step reads the weights once between them (that is what batching
    shares) and does its own arithmetic."""
    import pandas as pd
    hw, _, step = _decode_step_time(model, context_len, hardware)
    rows = []
    for b in batches:
        plain_, ver = step(b), step(b * (k + 1))
        rows.append({"batch": b, "plain rows": b, "verify rows": b * (k + 1),
                     "plain step (ms)": 1000 * plain_.seconds, "plain bound": plain_.bound,
                     "verify step (ms)": 1000 * ver.seconds, "verify bound": ver.bound,
                     "verify cost (plain steps)": ver.seconds / plain_.seconds})
    return pd.DataFrame(rows), hw


def roofline_curve(model, rows: Sequence[int], context_len: int = 256, hardware: str = "this"):
    """The planner's decode-step roofline against the rows of one forward pass: the time to read
    the weights (and KV), the time of the arithmetic, and the step time, the larger of the two."""
    import pandas as pd
    hw, rate, step = _decode_step_time(model, context_len, hardware)
    out = []
    for r in rows:
        t = step(r)
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
