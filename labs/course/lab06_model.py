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
