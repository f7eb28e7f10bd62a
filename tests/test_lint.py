"""The code passes the linter configured in pyproject.toml ([tool.ruff]): CI keeps it clean."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")   # the venv's, from the dev extra
    if beside.exists():
        return [str(beside)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.fail("ruff is not installed: it is in the dev extra (pip install -e '.[dev]')")


def test_ruff_finds_nothing():
    done = subprocess.run([*_ruff(), "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
