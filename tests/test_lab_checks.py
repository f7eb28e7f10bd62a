"""minserve.lab.checks: every check kind fails on a wrong answer (with a teaching message) and
passes on the right one; unanswered checks nudge, or under CI prove the reference solution."""

import math

import pandas as pd
import pytest

from minserve.lab import checks
from minserve.lab.checks import (CheckFailed, ChoiceCheck, FunctionCheck, Mistake, NumberCheck,
                                 Verdict)
from minserve.lab.presets import CI_ENV


@pytest.fixture(autouse=True)
def not_ci(monkeypatch):
    monkeypatch.delenv(CI_ENV, raising=False)


def ttft_check(expected=52.0, solution="answer = 1000 * reqs.ttft_s[0]"):
    reqs = pd.DataFrame({"ttft_s": [0.052], "e2e_s": [1.2]})
    return NumberCheck("Q1", expected, unit="ms", abs_tol=1.0, rel_tol=0.02,
                       tolerance_why="the table rounds to 1 ms", hint="look at ttft_s",
                       solution=solution, namespace={"reqs": reqs},
                       mistakes=[Mistake("that is the E2E latency.", value=1200.0)])


# ---- NumberCheck ------------------------------------------------------------------------------

def test_number_check_passes_within_tolerance_and_says_why():
    v = ttft_check().evaluate(52.6)
    assert v.status == checks.CORRECT and v.ok
    assert "the table rounds to 1 ms" in v.message


def test_number_check_names_a_known_mistake():
    v = ttft_check().evaluate(1200)
    assert v.status == checks.WRONG and not v.ok
    assert "E2E" in v.message


def test_number_check_spots_a_unit_mixup():
    v = ttft_check().evaluate(0.052)  # seconds instead of ms
    assert not v.ok and "unit" in v.message and "ms" in v.message


def test_number_check_says_how_far_and_which_way_with_the_hint():
    v = ttft_check().evaluate(70)
    assert not v.ok
    assert "35 % too high" in v.message and "look at ttft_s" in v.message
    assert "too low" in ttft_check().evaluate(30).message


def test_number_check_rejects_non_numbers_politely():
    for bad in ("52", True, float("nan"), [52]):
        v = ttft_check().evaluate(bad)
        assert not v.ok and "should be a number" in v.message


def test_integer_check_is_exact():
    q = NumberCheck("steps", 13, integer=True, unit="steps", hint="h", solution="answer = 13",
                    mistakes=[Mistake("one too many.", value=14)])
    assert q.evaluate(13).ok
    assert not q.evaluate(13.2).ok
    assert "one too many" in q.evaluate(14).message
    assert "exact count" in q.evaluate(12).message


# ---- unanswered, CI, hint, solution -----------------------------------------------------------

def test_unanswered_nudges_without_raising(capsys):
    q = ttft_check()
    assert q.evaluate(None).status == checks.UNANSWERED
    q.check(None)  # outside IPython it prints; it must not raise
    out = capsys.readouterr().out
    assert "Unanswered" in out and "look at ttft_s" in out
    assert q.last.status == checks.UNANSWERED


def test_ci_checks_the_reference_solution_against_the_measurement(monkeypatch):
    monkeypatch.setenv(CI_ENV, "1")
    v = ttft_check().evaluate(None)
    assert v.status == checks.VERIFIED and v.ok and "52" in v.message
    # A solution that disagrees with the measurement fails CI loudly.
    with pytest.raises(CheckFailed, match="does not match"):
        ttft_check(expected=80.0).evaluate(None)
    # A learner's own answer is still judged normally under CI (wrong: a verdict, no raise).
    assert not ttft_check().evaluate(70).ok


def test_ci_fails_when_the_solution_code_is_broken(monkeypatch):
    monkeypatch.setenv(CI_ENV, "1")
    with pytest.raises(NameError):
        ttft_check(solution="answer = 1000 * nowhere.ttft_s[0]").evaluate(None)
    with pytest.raises(RuntimeError, match="does not set `answer`"):
        ttft_check(solution="x = 1").evaluate(None)


def test_hint_and_solution_show_text_code_and_this_runs_value(capsys):
    q = ttft_check()
    q.hint()
    q.solution()
    out = capsys.readouterr().out
    assert "look at ttft_s" in out
    assert "answer = 1000 * reqs.ttft_s[0]" in out and "gives 52" in out


def test_expected_may_be_computed_lazily():
    box = {"v": None}
    q = NumberCheck("lazy", lambda: box["v"], hint="h", solution="answer = 1", rel_tol=0.1)
    box["v"] = 10.0
    assert q.evaluate(10.5).ok and not q.evaluate(12).ok


def test_verdict_renders_as_text_and_html():
    v = Verdict(checks.WRONG, "a < b", "Q9")
    assert repr(v).startswith("Q9: Not quite.")
    assert "&lt;" in v._repr_html_() and "Not quite" in v._repr_html_()


# ---- ChoiceCheck ------------------------------------------------------------------------------

def choice(expected="slow start"):
    return ChoiceCheck("Q3", expected, options={"slow start": "B queued behind A.",
                                                "slow generation": "Look at the TPOT instead."},
                       hint="compare ratios", solution='answer = "slow start"')


def test_choice_check_right_wrong_and_unknown():
    assert choice().evaluate("Slow-Start ").ok
    wrong = choice().evaluate("slow generation")
    assert not wrong.ok and "Look at the TPOT instead." in wrong.message
    unknown = choice().evaluate("fast")
    assert not unknown.ok and "'slow start'" in unknown.message


def test_choice_check_under_ci_proves_the_claim_against_the_measurement(monkeypatch):
    monkeypatch.setenv(CI_ENV, "1")
    assert choice("slow start").evaluate(None).ok
    with pytest.raises(CheckFailed):
        choice("slow generation").evaluate(None)  # the run would contradict the lab's claim


# ---- FunctionCheck ----------------------------------------------------------------------------

def steps_check():
    cases = [({"P": 600, "N": 8, "B": 512}, 9), ({"P": 100, "N": 5, "B": 64}, 6),
             ({"P": 512, "N": 1, "B": 512}, 1)]
    return FunctionCheck("Q4", cases, hint="chunks, then decodes",
                         solution="def answer(P, N, B):\n    return math.ceil(P / B) + N - 1")


def test_function_check_passes_the_right_function_and_fails_others():
    q = steps_check()
    assert q.evaluate(lambda P, N, B: math.ceil(P / B) + N - 1).ok
    wrong = q.evaluate(lambda P, N, B: math.ceil(P / B) + N)
    assert not wrong.ok and "P=600, N=8, B=512" in wrong.message and "measured 9" in wrong.message
    assert "raised ZeroDivisionError" in q.evaluate(lambda P, N, B: 1 / 0).message
    assert "should be a function" in q.evaluate(9).message
    assert "not a number" in q.evaluate(lambda P, N, B: "nine").message


def test_function_check_reference_under_ci(monkeypatch):
    monkeypatch.setenv(CI_ENV, "1")
    assert steps_check().evaluate(None).ok


# (The labs' own exercises are tested beside each lab: tests/test_lab_exercises_*.py.)


# ---- named mistakes fire before the tolerance -------------------------------------------------

def test_a_mistake_inside_the_tolerance_is_named():
    """E2E / n lies within a 30 % tolerance of (E2E - TTFT) / (n - 1) on some runs: the learner who
    divided the wrong thing must hear so, not "Correct"."""
    q = NumberCheck("q", 100.0, solution="answer = 100.0", hint="h", rel_tol=0.3,
                    mistakes=[Mistake("that divides E2E by n", value=80.0)])
    v = q.evaluate(80.0)
    assert not v.ok and "divides E2E by n" in v.message
    assert q.evaluate(97.0).ok          # nearer the right value than the mistake: right
    assert q.evaluate(100.0).ok


def test_a_predicate_mistake_never_overrules_a_right_answer():
    q = NumberCheck("q", 9, solution="answer = 9", hint="h", integer=True,
                    mistakes=[Mistake("counts decode only", test=lambda a: a in (8, 9))])
    assert q.evaluate(9).ok
    assert "decode only" in q.evaluate(8).message


def test_indistinct_mistakes_are_reported():
    q = NumberCheck("q", 3, solution="answer = 3", hint="h", integer=True,
                    mistakes=[Mistake("rounds up", value=3), Mistake("forgets a step", value=2)])
    assert [m.message for m in q.indistinct_mistakes()] == ["rounds up"]


def test_a_small_miss_never_reads_zero_percent():
    q = NumberCheck("q", 1000.0, solution="answer = 1000.0", hint="h", integer=True)
    assert "0.40 % too high" in q.evaluate(1004).message


def test_the_nearest_matching_mistake_is_named():
    q = NumberCheck("q", 100.0, solution="answer = 100.0", hint="h", rel_tol=0.01,
                    mistakes=[Mistake("far slip", value=80.0, rel_tol=0.1),
                              Mistake("near slip", value=76.0, rel_tol=0.1)])
    assert "near slip" in q.evaluate(75.0).message
    assert "far slip" in q.evaluate(81.0).message
