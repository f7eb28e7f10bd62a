"""Lab 05 (quantization): the release gate, live on a small slice and as shipped.

:func:`gate_slice` runs ``minserve eval``'s own measurement (:func:`minserve.eval.gate.measure`)
on a few texts and questions, on engines the lab has already built, and judges each row with the
gate's documented thresholds (:func:`minserve.eval.gate.check`). A slice that small is quick and
noisy: one question out of 16 is 6.25 points of exact match, more than a threshold.

:data:`SHIPPED_GATE` is the full run that README.md records (20 texts, 40 agreement prompts, 64
questions), produced by :data:`SHIPPED_COMMAND` on SmolLM2-135M; :func:`shipped_frame` re-judges
it with the same thresholds, so what passes here is what the gate's code says, not a copied word.
"""

from __future__ import annotations

from minserve.eval import metrics
from minserve.eval.gate import EvalData, FormatResult, check, measure, parse_format, thresholds_for

SHIPPED_COMMAND = (".venv/bin/python -m minserve.cli eval --model smollm2-135m --quantization "
                   "fp32,int8,int4,int4:lm_head=quantize,int4:lm_head=keep,int4:group_size=64,"
                   "int4-awq:group_size=64,int4-awq")
SHIPPED_QUESTIONS = 64
SHIPPED_AGREEMENT_PROMPTS, SHIPPED_AGREEMENT_TOKENS = 40, 32
# (format, weights MB streamed per token, perplexity, mean KL, greedy agreement (mean first
# difference / length), questions answered right): README.md, "int4-awq", as printed there.
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
    """The README's full gate run, judged again here with the documented thresholds."""
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
