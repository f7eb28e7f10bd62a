"""Answer checks in the style of Kaggle's learntools: ``q1.check(answer)``, ``q1.hint()``,
``q1.solution()``.

A check compares the learner's answer with what the engine measured in *this* run (or what a
formula gives for it), within a tolerance that states why it is that wide. A wrong answer gets a
message that teaches: a known mistake (TTFT in seconds instead of milliseconds, queue time instead
of TTFT, forgetting that the last prefill step already samples the first token, ...) is named,
otherwise the message says how far off and in which direction, and points at the hint.

Exercise cells ship unanswered (``answer = None  # your answer``). An unanswered check prints a
nudge and the hint and lets "Run All" go on. Under CI (``MINSERVE_LAB_CI=1``, which ``make test``
sets) an unanswered check instead runs the reference solution — the very code that
``solution()`` shows — against this run's measurements, and raises if they disagree: CI proves the
solution and the measurement agree.

Check kinds: :class:`NumberCheck` (a value within a tolerance), :class:`ChoiceCheck` (one of a
few named options, each wrong one with its own explanation), :class:`FunctionCheck` (a function
the learner writes, tried on measured cases). Each has :meth:`~Check.evaluate` (pure: returns a
:class:`Verdict`, for tests) and :meth:`~Check.check` (displays it).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from minserve.lab.presets import is_ci

CORRECT, WRONG, UNANSWERED, VERIFIED = "correct", "wrong", "unanswered", "verified"
_STYLE = {CORRECT: ("Correct", "#1a7f37"), WRONG: ("Not quite", "#b35900"),
          UNANSWERED: ("Unanswered", "#0969da"), VERIFIED: ("CI check", "#1a7f37")}


class CheckFailed(AssertionError):
    """CI: the reference solution disagrees with this run's measurement."""


@dataclass
class Verdict:
    status: str
    message: str
    name: str = ""

    @property
    def ok(self) -> bool:
        return self.status in (CORRECT, VERIFIED)

    def __repr__(self) -> str:
        label = _STYLE[self.status][0]
        return f"{self.name}: {label}. {self.message}" if self.name else f"{label}. {self.message}"

    def _repr_html_(self) -> str:
        from html import escape
        label, color = _STYLE[self.status]
        name = f"{escape(self.name)}: " if self.name else ""
        body = escape(self.message).replace("\n", "<br>")
        return (f'<div style="border-left:4px solid {color};padding:2px 8px">'
                f'<b style="color:{color}">{name}{label}.</b> {body}</div>')


def _emit(obj) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
        if get_ipython() is not None:
            display(obj)
            return
    except ImportError:
        pass
    print(repr(obj))


class _Text:
    """Plain text shown as-is (hints and solutions), monospace for code."""

    def __init__(self, title: str, text: str, code: str | None = None):
        self.title, self.text, self.code = title, text, code

    def __repr__(self) -> str:
        parts = [f"{self.title}: {self.text}".rstrip()]
        if self.code:
            parts.append(self.code)
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        from html import escape
        code = f"<pre>{escape(self.code)}</pre>" if self.code else ""
        return (f'<div style="border-left:4px solid #8250df;padding:2px 8px"><b>{escape(self.title)}:</b> '
                f"{escape(self.text)}{code}</div>")


def _fmt(x) -> str:
    if isinstance(x, bool) or not isinstance(x, numbers.Number):
        return repr(x)
    x = float(x)
    if x == int(x) and abs(x) < 1e12:
        return str(int(x))
    return f"{x:.4g}" if abs(x) >= 1e-3 else f"{x:.3g}"


class Check:
    """One exercise.

    ``expected``: the measured (or formula) value, or a zero-argument function giving it (so it
    can be computed after the check is built). ``solution``: Python code that sets ``answer``; it
    runs in ``namespace`` (a dict, or a function returning one — the names the notebook uses), so
    what :meth:`solution` shows is exactly what CI runs. ``hint``: a nudge, not the answer.
    """

    def __init__(self, name: str, expected: Any, *, solution: str, hint: str,
                 namespace: dict | Callable[[], dict] | None = None, explanation: str = ""):
        self.name, self._expected, self.solution_code = name, expected, solution.strip()
        self.hint_text, self._namespace, self.explanation = hint, namespace, explanation
        self.last: Verdict | None = None

    # -- values -----------------------------------------------------------------------------
    def expected(self):
        return self._expected() if callable(self._expected) else self._expected

    def reference(self):
        """Run the solution code; returns the ``answer`` it computes on this run."""
        ns = self._namespace() if callable(self._namespace) else dict(self._namespace or {})
        ns = {"math": math, **ns}
        exec(compile(self.solution_code, f"<solution of {self.name}>", "exec"), ns)  # noqa: S102
        if "answer" not in ns:
            raise RuntimeError(f"the solution of {self.name} does not set `answer`")
        return ns["answer"]

    # -- judging ----------------------------------------------------------------------------
    def compare(self, answer, expected) -> tuple[bool, str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def evaluate(self, answer) -> Verdict:
        """The verdict on ``answer`` (None: unanswered; under CI, the reference is judged)."""
        if answer is None:
            if not is_ci():
                return Verdict(UNANSWERED, "no answer yet: replace the None in the answer cell "
                               f"above, run it, then run this cell again. Hint: {self.hint_text}",
                               self.name)
            ref = self.reference()
            ok, why = self.compare(ref, self.expected())
            if not ok:
                raise CheckFailed(f"{self.name}: the reference solution gives {_fmt(ref)}, which "
                                  f"does not match this run's measurement: {why}")
            return Verdict(VERIFIED, f"no answer given, so the reference solution was checked "
                           f"against this run instead: {why}", self.name)
        ok, why = self.compare(answer, self.expected())
        if ok and self.explanation:
            why = f"{why} {self.explanation}".strip()
        return Verdict(CORRECT if ok else WRONG, why, self.name)

    def check(self, answer=None) -> None:
        """Judge ``answer`` and show the verdict (it is also kept in ``self.last``)."""
        self.last = self.evaluate(answer)
        _emit(self.last)

    def hint(self) -> None:
        _emit(_Text(f"{self.name} hint", self.hint_text))

    def solution(self) -> None:
        try:
            value = f"On this run it gives {_fmt(self.reference())}."
        except Exception as e:  # noqa: BLE001 - show the code even if the run lacks its data
            value = f"(It could not run here: {type(e).__name__}: {e})"
        _emit(_Text(f"{self.name} solution", value, self.solution_code))


@dataclass
class Mistake:
    """A known wrong answer and what to say about it: ``value`` (a number, or a zero-argument
    function giving it) matched within ``rel_tol``, or ``test`` (a predicate on the answer)."""
    message: str
    value: Any = None
    rel_tol: float = 0.02
    test: Callable[[Any], bool] | None = None

    def resolved(self) -> float | None:
        """The mistake's value on this run (None for a predicate mistake)."""
        if self.test is not None:
            return None
        v = self.value() if callable(self.value) else self.value
        return None if v is None else float(v)

    def matches(self, answer) -> bool:
        if self.test is not None:
            try:
                return bool(self.test(answer))
            except Exception:  # noqa: BLE001
                return False
        v = self.value() if callable(self.value) else self.value
        if v is None or not isinstance(answer, numbers.Number):
            return False
        return math.isclose(float(answer), float(v), rel_tol=self.rel_tol, abs_tol=1e-9)


class NumberCheck(Check):
    """A number within ``max(abs_tol, rel_tol * |expected|)``; ``tolerance_why`` says why the
    tolerance is that wide (shown with every verdict). ``unit`` is named in messages;
    ``integer=True`` asks for an exact whole number (counts: steps, tokens, blocks)."""

    def __init__(self, name: str, expected: Any, *, solution: str, hint: str, unit: str = "",
                 rel_tol: float = 0.0, abs_tol: float = 0.0, tolerance_why: str = "",
                 mistakes: list[Mistake] | None = None, integer: bool = False, **kw):
        super().__init__(name, expected, solution=solution, hint=hint, **kw)
        self.unit, self.rel_tol, self.abs_tol = unit, rel_tol, abs_tol
        self.tolerance_why, self.mistakes, self.integer = tolerance_why, list(mistakes or []), integer

    def _u(self, x) -> str:
        return f"{_fmt(x)} {self.unit}".strip()

    def compare(self, answer, expected) -> tuple[bool, str]:
        if (isinstance(answer, bool) or not isinstance(answer, numbers.Number)
                or not math.isfinite(float(answer))):
            return False, (f"the answer should be a number{' in ' + self.unit if self.unit else ''}, "
                           f"got {answer!r}.")
        a, e = float(answer), float(expected)
        if self.integer:
            tol, tol_text = 0.0, "an exact count"
        else:
            tol = max(self.abs_tol, self.rel_tol * abs(e))
            tol_text = f"within ± {self._u(tol)}"
        why = f" ({tol_text}: {self.tolerance_why})" if self.tolerance_why else f" ({tol_text})"
        # Named mistakes first: a tolerance wide enough for a noisy measurement can also contain a
        # typical mistake (E2E / n beside (E2E - TTFT) / n), and the learner who made it must hear
        # which one it was. A value mistake wins only where the answer is nearer to it than to
        # this run's value, so a right answer is never called a mistake.
        mistake = self._mistake(a, e, abs(a - e) <= tol)
        if mistake is not None:
            return False, f"{self._u(a)} is not it: {mistake.message}"
        if abs(a - e) <= tol:
            return True, f"{self._u(a)} matches this run's {self._u(e)}{why}."
        msg = f"{self._u(a)} is not this run's value"
        if e != 0 and a != 0:
            ratio = a / e
            if any(math.isclose(ratio, f, rel_tol=0.05) for f in (1000, 0.001, 1e6, 1e-6)):
                return False, (f"{msg}, but it is off by a factor of {_fmt(ratio)}: a unit mix-up? "
                               f"The question asks for {self.unit or 'a different unit'}.")
            side = "high" if a > e else "low"
            pct = abs(ratio - 1) * 100   # enough digits that a small miss never reads "0 %"
            msg += f": it is {pct:.{0 if pct >= 10 else 1 if pct >= 1 else 2}f} % too {side}{why}."
        else:
            msg += f"{why}."
        return False, f"{msg} Hint: {self.hint_text}"


    def _mistake(self, a: float, e: float, within: bool) -> Mistake | None:
        """The named mistake this answer made: a predicate that matches it (unless the predicate
        also accepts this run's value), else the nearest value mistake it matches, provided the
        answer is nearer to that mistake than to this run's value."""
        near = []
        for m in self.mistakes:
            if not m.matches(a):
                continue
            v = m.resolved()
            if v is None:   # a predicate that also accepts this run's value cannot overrule it
                if not (within and m.matches(e)):
                    return m
            elif abs(a - v) < abs(a - e):
                near.append((abs(a - v), m))
        return min(near, key=lambda t: t[0])[1] if near else None

    def indistinct_mistakes(self) -> list[Mistake]:
        """Value mistakes that this run cannot tell from the right answer (within the tolerance
        of the expected value): an exercise whose data makes a mistake right tests nothing."""
        e = float(self.expected())
        tol = 0.0 if self.integer else max(self.abs_tol, self.rel_tol * abs(e))
        return [m for m in self.mistakes if m.resolved() is not None
                and abs(float(m.resolved()) - e) <= max(tol, 1e-9)]


class ChoiceCheck(Check):
    """One of ``options`` (``{option: why it is wrong, or right}``); case and spaces ignored."""

    def __init__(self, name: str, expected: Any, *, options: dict[str, str], solution: str,
                 hint: str, **kw):
        super().__init__(name, expected, solution=solution, hint=hint, **kw)
        self.options = {self._norm(k): v for k, v in options.items()}
        self._names = list(options)

    @staticmethod
    def _norm(x) -> str:
        return " ".join(str(x).strip().lower().replace("_", " ").replace("-", " ").split())

    def compare(self, answer, expected) -> tuple[bool, str]:
        a, e = self._norm(answer), self._norm(expected)
        if a not in self.options:
            return False, f"answer with one of {', '.join(repr(n) for n in self._names)}; got {answer!r}."
        if a == e:
            return True, f"{answer!r}. {self.options[a]}".strip()
        return False, f"{answer!r} is not what this run shows. {self.options[a]}"


class FunctionCheck(Check):
    """A function the learner writes, called on ``cases`` = ``[(kwargs, expected), ...]`` (the
    expected values measured in this run); ``rel_tol`` / ``abs_tol`` as in NumberCheck (0: exact).
    The reference solution defines the function as ``answer``."""

    def __init__(self, name: str, cases: Any, *, solution: str, hint: str, rel_tol: float = 0.0,
                 abs_tol: float = 0.0, tolerance_why: str = "", **kw):
        super().__init__(name, cases, solution=solution, hint=hint, **kw)
        self.rel_tol, self.abs_tol, self.tolerance_why = rel_tol, abs_tol, tolerance_why

    def compare(self, answer, expected) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"the answer should be a function (def f(...): ...), got {answer!r}."
        for kwargs, want in expected:
            args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            try:
                got = answer(**kwargs)
            except Exception as e:  # noqa: BLE001 - the learner's code: report, don't crash
                return False, f"calling it with {args} raised {type(e).__name__}: {e}"
            if isinstance(got, bool) or not isinstance(got, numbers.Number):
                return False, f"with {args} it returned {got!r}, not a number."
            tol = max(self.abs_tol, self.rel_tol * abs(want))
            if abs(float(got) - float(want)) > tol:
                extra = f" ({self.tolerance_why})" if self.tolerance_why else ""
                return False, (f"with {args} it returns {_fmt(got)}, but this run measured "
                               f"{_fmt(want)}{extra}. Hint: {self.hint_text}")
        why = f" ({self.tolerance_why})" if self.tolerance_why else ""
        return True, f"it matches all {len(expected)} measured cases{why}."
