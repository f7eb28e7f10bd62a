"""``minserve eval``: the quality table of every weight format, and its gate as the exit status.

    minserve eval --model smollm2-135m --quantization fp32,int8,int4

prints one table (format, weight bytes, perplexity, mean KL vs fp32, greedy agreement, exact
match, gate) and exits 1 when a row misses its threshold (eval/gate.py documents them), 0 when all
pass, so a release's CI can run it. ``--lm-eval`` adds lm-eval's numbers on the shipped tasks.
"""

from __future__ import annotations

import argparse
import json
import sys

from minserve.eval import data as eval_data
from minserve.eval.gate import EvalData, FormatResult, Thresholds, parse_format, run_gate


EPILOG = """default thresholds against fp32 (minserve/eval/gate.py documents them):
  int8                          perplexity +1 %, mean KL <= 0.01, exact match at most 3 points lower
  int4, int4-awq, other formats perplexity +5 %, mean KL <= 0.05, exact match at most 6 points lower
  fp32 weights + other settings as int8 (e.g. fp32:kv_cache_dtype=int8)
exit status: 0 every row passes, 1 a row fails (or could not be built), 2 bad arguments or data"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="minserve eval", description="The quality table of every weight format against fp32, "
        "and its gate as the exit status.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="fp32,int8,int4",
                    help="comma-separated rows: fp32 (or none), a quantization= value (int8, int4, "
                         "int4-awq, ...), each optionally NAME:key=value for more engine arguments")
    ap.add_argument("--data-dir", default=None, help="default: datasets/eval (minserve/datasets/eval in a wheel)")
    ap.add_argument("--max-texts", type=int, default=None, help="use only the first N texts")
    ap.add_argument("--max-questions", type=int, default=None, help="use only the first N questions")
    ap.add_argument("--agreement-lengths", default="16,48",
                    help="prompt lengths (tokens) cut from each text for greedy agreement")
    ap.add_argument("--agreement-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-ppl-increase", type=float, default=None, help="e.g. 0.01 for +1 %%")
    ap.add_argument("--max-kl", type=float, default=None, help="nats per token")
    ap.add_argument("--max-em-drop", type=float, default=None, help="e.g. 0.03 for 3 points")
    ap.add_argument("--min-exact-match", type=float, default=None, help="absolute, every row")
    ap.add_argument("--min-greedy-agreement", type=float, default=None, help="mean fraction, every row")
    ap.add_argument("--lm-eval", action="store_true", help="also run lm-eval on the shipped tasks")
    ap.add_argument("--json", default=None, help="write the results to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        specs = [parse_format(f) for f in a.quantization.split(",") if f.strip()]
        texts = eval_data.load_texts(a.data_dir)[:a.max_texts]
        questions = eval_data.load_questions(a.data_dir)[:a.max_questions]
        lengths = tuple(int(n) for n in a.agreement_lengths.split(","))
    except (ValueError, FileNotFoundError) as e:
        print(f"minserve eval: {e}", file=sys.stderr)
        return 2
    lm_eval_fn = None
    if a.lm_eval:
        try:
            from minserve.eval.lm_eval_adapter import run_lm_eval
        except ImportError as e:
            print(f"minserve eval: --lm-eval needs lm-eval (pip install 'minserve[eval]'): {e}", file=sys.stderr)
            return 2
        lm_eval_fn = (lambda llm: run_lm_eval(llm, a.data_dir))
    overrides = Thresholds(a.max_ppl_increase, a.max_kl, a.max_em_drop, a.min_exact_match, a.min_greedy_agreement)
    engine_args = dict(kv_cache_memory=a.kv_cache_memory, max_num_seqs=a.max_num_seqs)
    results = run_gate(a.model, specs, EvalData(texts, questions, lengths, a.agreement_tokens), engine_args,
                       overrides, lm_eval_fn)
    print(format_table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([as_dict(r) for r in results], f, indent=2)
    return 0 if all(r.passed for r in results) else 1


def format_table(results: list[FormatResult]) -> str:
    head = ("format", "weights MB", "perplexity", "mean KL", "greedy agree", "exact match", "gate")
    ref = results[0]
    rows = []
    for r in results:
        label = r.spec.label + (" (ref)" if r is ref else "")
        if r.error is not None:
            rows.append((label, "-", "-", "-", "-", "-", "FAIL"))
            continue
        ppl = f"{r.perplexity:.3f}" + ("" if r is ref else f" ({r.perplexity / ref.perplexity - 1:+.2%})")
        ag = r.agreement
        em = r.exact_match
        rows.append((label, f"{r.weight_bytes / 1e6:.1f}", ppl, f"{r.mean_kl:.5f}",
                     f"{ag.mean_fraction:.1%} ({ag.num_identical}/{len(ag.first_difference)} same)",
                     f"{sum(em.correct)}/{len(em.correct)} ({em.accuracy:.1%})", "pass" if r.passed else "FAIL"))
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        lines += [f"{r.spec.label}: {why}" for why in r.failures]
        lines += [f"{r.spec.label}: lm-eval {k} = {v:.4f}" for k, v in r.lm_eval.items()]
    return "\n".join(lines)


def as_dict(r: FormatResult) -> dict:
    return {"format": r.spec.label, "quantization": r.spec.quantization, "engine_args": r.spec.engine_args,
            "weight_bytes": r.weight_bytes, "perplexity": r.perplexity, "mean_kl": r.mean_kl,
            "greedy_agreement": None if r.agreement is None else r.agreement.mean_fraction,
            "greedy_first_difference": None if r.agreement is None else r.agreement.first_difference,
            "exact_match": None if r.exact_match is None else r.exact_match.accuracy,
            "lm_eval": r.lm_eval, "error": r.error, "failures": r.failures, "passed": r.passed}


if __name__ == "__main__":
    sys.exit(main())
