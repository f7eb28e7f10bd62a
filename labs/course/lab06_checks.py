"""Lab 06's exercises: the checks of the learner's answers."""

from __future__ import annotations

import math
import numbers
from typing import Sequence

from minserve.lab.checks import ChoiceCheck, FunctionCheck, Mistake, NumberCheck
from course.lab06_measure import Pair
from course.lab06_model import expected_tokens, stops_paying


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


SLIP_TOL = 0.01


def q4_speedup(a: float, k: int, c: float, measured: float,
               tokens_per_step: float | None = None) -> NumberCheck:
    """The learner's predicted speed-up from the measured acceptance rate ``a``, ``k`` and the
    measured verify cost ``c`` (in plain steps): the model's value, E(a, k) / c. The measured
    speed-up (and tokens per target step) are quoted beside it and recognised as answers that
    read the run instead of applying the model (the model's error is sections 5 and 6's subject).

    An answer that is the measured speed-up is judged as such, first: a measured value can land
    near a formula slip by chance (on copy, bursty acceptance makes the real tokens per step
    close to 1 + k * a, so the measured 2.00x sat next to (1 + k * a) / c), and calling it that
    slip would be a wrong diagnosis. Where the two coincide, the message says so."""
    E = expected_tokens(a, k)
    model = E / c
    # A slip is computed from the same printed a, k and c as the right answer, so it is matched
    # closely (1 %: an answer rounded to two decimals still matches): on a typical run two slips
    # lie a few percent apart (E(a, k) and (1 + k * a) / c did, 2.67 and 2.74), and a wider
    # tolerance would name the wrong one.
    formula = [
        Mistake(f"that is E(a, k) = {E:.2f}, the tokens per verify step. A verify step also "
                f"takes longer than a plain one ({c:.2f}x here): divide by that cost.",
                value=E, rel_tol=SLIP_TOL),
        Mistake(f"that divides by k + 1 = {k + 1}, as if checking k + 1 positions cost k + 1 "
                f"plain steps. The measured cost is c = {c:.2f}: the rows share one read of "
                "the weights.", value=E / (k + 1), rel_tol=SLIP_TOL),
        Mistake("that multiplies by the cost; a dearer step makes speculation slower, so divide.",
                value=E * c, rel_tol=SLIP_TOL),
        Mistake("that uses 1 + k * a tokens per step, as if each proposal were judged on its "
                "own: proposal i counts only when all before it were kept (a^i).",
                value=(1 + k * a) / c, rel_tol=SLIP_TOL),
        Mistake("that leaves out the target's own token in each verify step (E - 1).",
                value=(E - 1) / c, rel_tol=SLIP_TOL),
    ]

    def also(value: float) -> str:
        near = sorted((m for m in formula if m.matches(value)), key=lambda m: abs(m.resolved() - value))
        if not near:
            return ""
        return (" (On this run it also happens to be close to a formula slip; if that is how you "
                f"got it: {near[0].message})")

    read_off = []
    if measured and math.isfinite(measured) and abs(measured / model - 1) > 0.03:
        read_off.append(Mistake(f"that is the speed-up this run measured ({measured:.2f}x, in the table). "
                                "The exercise asks what the model predicts from a, k and c alone; the "
                                "notebook compares the two right after." + also(measured),
                                value=measured, rel_tol=0.01))
    if tokens_per_step and math.isfinite(tokens_per_step) and abs(tokens_per_step / E - 1) > 0.03:
        read_off.append(Mistake(f"that divides the measured tokens per target step ({tokens_per_step:.2f}) "
                                "by c. The model's tokens per step come from a and k: E(a, k)."
                                + also(tokens_per_step / c),
                                value=tokens_per_step / c, rel_tol=0.01))
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
        # The measured values first: they are judged on their own (see the docstring).
        mistakes=[*read_off, *formula])


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
