"""Helpers for the tests of the labs' answer checks: keep CI mode off unless a test turns it on,
and see whether a check's reference solution agrees with its measurement under CI.

A test module takes both with ``from lab_check_helpers import not_ci, verified_under_ci``
(``not_ci`` is an autouse fixture: importing it applies it to every test of that module)."""

import pytest

from minserve.lab import checks
from minserve.lab.presets import CI_ENV


@pytest.fixture(autouse=True)
def not_ci(monkeypatch):
    monkeypatch.delenv(CI_ENV, raising=False)


def verified_under_ci(check, monkeypatch) -> bool:
    """Under CI an unanswered check runs its reference solution against the measurement."""
    monkeypatch.setenv(CI_ENV, "1")
    v = check.evaluate(None)
    monkeypatch.delenv(CI_ENV)
    return v.status == checks.VERIFIED
