"""Lab 05 (quantization): the release gate, live on a small slice and as shipped.

:func:`gate_slice` runs ``minserve eval``'s own measurement (:func:`minserve.eval.gate.measure`)
on a few texts and questions, on engines the lab has already built, and judges each row with the
gate's documented thresholds (:func:`minserve.eval.gate.check`). A slice that small is quick and
noisy: one question out of 16 is 6.25 points of exact match, more than a threshold.

:data:`SHIPPED_GATE` is the full run that docs/engine/quality-gate.md records (20 texts, 40
agreement prompts, 64 questions), produced by :data:`SHIPPED_COMMAND` on SmolLM2-135M;
:func:`shipped_frame` re-judges it with the same thresholds, so what passes here is what the
gate's code says, not a copied word.
"""

from __future__ import annotations

from minserve.eval import metrics
from minserve.eval.gate import EvalData, FormatResult, check, measure, parse_format, thresholds_for

SHIPPED_COMMAND = (".venv/bin/python -m minserve.cli eval --model smollm2-135m --quantization "
                   "fp32,int8,int4,int4:lm_head=quantize,int4:lm_head=keep,int4:group_size=64,"
                   "int4-awq:group_size=64,int4-awq")
SHIPPED_QUESTIONS, SHIPPED_TEXTS = 64, 20
SHIPPED_AGREEMENT_PROMPTS, SHIPPED_AGREEMENT_TOKENS = 40, 32
# (format, weights MB streamed per token, perplexity, mean KL, greedy agreement (mean first
# difference / length), questions answered right): docs/engine/quality-gate.md, as printed there.
SHIPPED_GATE = [
    ("fp32", 538.1, 20.540, 0.0, 1.000, 46),
    ("int8", 135.4, 20.537, 0.00495, 0.517, 44),
    ("int4", 108.3, 20.530, 0.00130, 0.687, 47),
    ("int4:lm_head=quantize", 101.0, 21.788, 0.05656, 0.198, 44),
    ("int4:lm_head=keep", 193.0, 20.540, 0.0, 1.000, 46),
    ("int4:group_size=64", 95.0, 27.597, 0.31831, 0.101, 40),
    ("int4-awq:group_size=64", 95.0, 23.551, 0.14696, 0.141, 44),
    ("int4-awq", 108.3, 20.530, 0.00130, 0.687, 47),
]


def _result(name, weights_mb, ppl, kl, agreement, right, questions=SHIPPED_QUESTIONS) -> FormatResult:
    """A FormatResult from printed numbers, for the gate's own ``check``."""
    # First differing positions whose mean is the printed agreement (only the mean was printed).
    n, length = SHIPPED_AGREEMENT_PROMPTS, SHIPPED_AGREEMENT_TOKENS
    total = round(agreement * n * length)
    firsts = [total // n + (i < total % n) for i in range(n)]
    return FormatResult(parse_format(name), weight_bytes=int(weights_mb * 1e6), perplexity=ppl, mean_kl=kl,
                        agreement=metrics.Agreement(firsts, length),
                        exact_match=metrics.ExactMatch([""] * questions,
                                                       [True] * right + [False] * (questions - right)))


def judge(results: list[FormatResult]) -> list[FormatResult]:
    """Set every row's ``failures`` with the documented thresholds, against the first row (fp32)."""
    ref = results[0]
    for r in results:
        r.failures = check(r, ref, thresholds_for(r.spec))
    return results


def gate_frame(results: list[FormatResult], labels: list[str] | None = None):
    """The gate's table: one row per format (fp32 first), its numbers, the change against fp32,
    and the verdict with the reasons."""
    import pandas as pd
    ref = results[0]
    rows = []
    for label, r in zip(labels or [r.spec.label for r in results], results):
        em = r.exact_match
        rows.append({
            "format": label, "weights MB streamed": r.weight_bytes / 1e6, "perplexity": r.perplexity,
            "perplexity change (%)": 100 * (r.perplexity / ref.perplexity - 1),
            "mean KL (nats)": r.mean_kl, "greedy agreement": r.agreement.mean_fraction,
            "exact match": f"{sum(em.correct)}/{len(em.correct)}",
            "exact match change (points)": 100 * (em.accuracy - ref.exact_match.accuracy),
            "gate": "pass" if r.passed else "FAIL", "why": "; ".join(r.failures)})
    return pd.DataFrame(rows).set_index("format")


def shipped_results() -> list[FormatResult]:
    return judge([_result(*row) for row in SHIPPED_GATE])


def shipped_frame():
    """The documented full gate run, judged again here with the documented thresholds."""
    return gate_frame(shipped_results())


def gate_slice(ref_llm, engines: dict, num_texts: int, num_questions: int, agreement_tokens: int = 16):
    """The gate, live, on the first ``num_texts`` prose paragraphs and ``num_questions`` questions:
    fp32 (``ref_llm``) first, then every ``{label: (gate name, LLM)}`` of ``engines``. Returns
    (the frame of :func:`gate_frame`, the FormatResults)."""
    from minserve.eval.data import load_questions, load_texts
    from minserve.lab.live import Progress
    data = EvalData(load_texts()[:num_texts], load_questions()[:num_questions],
                    agreement_lengths=(16,), agreement_tokens=agreement_tokens)
    bar = Progress(len(engines) + 1, f"gate slice: {num_texts} texts, {num_questions} questions", "formats")
    bar.update(0, "now: fp32")
    ref = measure(parse_format("fp32"), ref_llm, data)
    results, labels = [ref], ["fp32"]
    for k, (label, (name, llm)) in enumerate(engines.items()):
        bar.update(k + 1, f"now: {label}")
        results.append(measure(parse_format(name), llm, data, ref_llm, ref.greedy))
        labels.append(label)
    bar.update(len(engines) + 1)
    return gate_frame(judge(results), labels), results


def smallest_passing(results: list[FormatResult], among: list[str]) -> str | None:
    """Of the rows named in ``among`` that pass, the one that streams the fewest weight bytes."""
    passing = [r for r in results if r.spec.label in among and r.passed]
    return min(passing, key=lambda r: r.weight_bytes).spec.label if passing else None


# ---- the gate's verdicts in words (every sentence from the frame it describes) ---------------

def verdict(row) -> str:
    """One row of :func:`gate_frame` in words: "passes", or "fails: <the thresholds it misses>"."""
    return "passes" if row["gate"] == "pass" else f"fails: {row['why']}"


def verdicts(frame, skip: tuple[str, ...] = ("fp32",)) -> str:
    """Every row's verdict, one sentence: "int8 fails: perplexity +1.04% > +1.00%; int4 passes"."""
    return "; ".join(f"{label} {verdict(row)}" for label, row in frame.iterrows() if label not in skip)


def kl_order(frame, labels) -> list[str]:
    """``labels`` sorted by the frame's mean KL, smallest first."""
    return sorted(labels, key=lambda k: float(frame.loc[k, "mean KL (nats)"]))


def _kinds(row) -> set[str]:
    """Which measures a row fails on ("perplexity", "mean KL", "exact match", ...), numbers aside."""
    return {" ".join(r.split()[:2]) if r.startswith(("mean KL", "exact match", "greedy agreement"))
            else r.split()[0] for r in str(row["why"]).split("; ") if r}


def _only_exact_match(row) -> bool:
    reasons = [r for r in str(row["why"]).split("; ") if r]
    return bool(reasons) and all(r.startswith("exact match") for r in reasons)


def _questions_to_pass(ref, r, limit: float) -> int:
    """How many more right answers ``r`` needed to stay within ``limit`` (a drop in accuracy)."""
    n = len(r.exact_match.correct)
    drop = ref.exact_match.accuracy - r.exact_match.accuracy
    k = 0
    while drop - k / n > limit + 1e-12:
        k += 1
    return k


def second_look(shipped: list[FormatResult], live_frame=None, live_texts: int | None = None,
                live_label: str = "int8") -> str:
    """Two rows of the shipped run worth a second look, in sentences worked out from the results:
    int8's verdict (and, when it fails on exact match alone, how many questions decide it), next
    to the live slice's verdict for the same format; and AWQ against plain int4 at groups of 64."""
    by = {r.spec.label: r for r in shipped}
    frame = gate_frame(shipped)
    ref, r8 = by["fp32"], by["int8"]
    row = frame.loc["int8"]
    n = len(r8.exact_match.correct)
    text = [f"In the shipped run, int8 {verdict(row)} ({row['exact match']} questions right against "
            f"fp32's {frame.loc['fp32', 'exact match']}, perplexity {row['perplexity change (%)']:+.2f} %, "
            f"mean KL {row['mean KL (nats)']:.4f})."]
    if row["gate"] != "pass" and _only_exact_match(row):
        k = _questions_to_pass(ref, r8, thresholds_for(r8.spec).max_em_drop)
        text.append(f"It fails on exact match alone: on {n} questions one answer is {100 / n:.1f} points, "
                    f"and {k} more right answer{'s' if k != 1 else ''} would have passed it, so a release "
                    "would want a larger question set before trusting that verdict either way.")
    if live_frame is not None and live_label in live_frame.index:
        live = live_frame.loc[live_label]
        same = live["gate"] == row["gate"] and _kinds(live) == _kinds(row)
        questions = str(live["exact match"]).split("/")[-1]
        size = f"{live_texts} texts, " if live_texts is not None else ""
        text.append(f"On this run's live slice ({size}{questions} questions; the shipped run had "
                    f"{SHIPPED_TEXTS} and {SHIPPED_QUESTIONS}), {live_label} {verdict(live)}"
                    + (": the same verdict, for the same reason." if same else
                       ". That is not the shipped run's verdict or reason: a slice this small "
                       "measures fewer texts and far fewer questions, and its verdict can differ."))
    g64, awq = frame.loc["int4:group_size=64"], frame.loc["int4-awq:group_size=64"]
    kl_g, kl_a = float(g64["mean KL (nats)"]), float(awq["mean KL (nats)"])
    if kl_g > 0:
        share = 1 - kl_a / kl_g
        how = ("more than half" if share > 0.5 else "less than half" if share > 0 else "none")
        text.append(f"AWQ at groups of 64 takes back {how} of the mean KL plain int4 g64 adds "
                    f"({kl_g:.2f} to {kl_a:.2f} nats, {share:.0%}), "
                    + (f"yet still fails the gate ({awq['why']}): an improvement is not a pass."
                       if awq["gate"] != "pass" else "and passes the gate."))
    return " ".join(text)
