"""Every C kernel compiles without a warning for each kind of x86 CPU it may meet.

A build happens on the user's machine (kernels/build.py, ``-march=native``), so a fault that only
shows for another instruction set shows only there. One did: decode.c called ``malloc`` without
``<stdlib.h>``. The AVX builds got the declaration through ``immintrin.h``; a portable build (no
AVX2) got an implicit declaration, which GCC 12 only warns of and GCC 14 refuses, and a refused
build sends every decode step back to PyTorch. The front end's checks (``-fsyntax-only``: no code
is generated) take about a second for all the files, so the suite runs them for native, AVX2,
SSE4.2 and baseline x86-64 targets. Warnings from the optimizer (e.g. loop bounds) are not seen
here: those need a full build.
"""

from __future__ import annotations

import platform
import subprocess

import pytest

from minserve.kernels import build as kernel_build

MARCHES = ("native", "x86-64-v3", "x86-64-v2", "x86-64")
SOURCES = sorted(kernel_build.SOURCE_DIR.glob("*.c"))
# -Wpsabi: GCC's note that a vector-returning helper has another calling convention when built
# without AVX; the helpers are static, so no call crosses a build.
WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-psabi", "-Werror"]


def _compiler() -> str:
    try:
        return kernel_build._compiler()
    except kernel_build.KernelUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march", MARCHES)
def test_every_kernel_compiles_cleanly_for(march):
    cc = _compiler()
    assert SOURCES, f"no kernel sources in {kernel_build.SOURCE_DIR}"
    flags = [f for f in kernel_build.FLAGS if f not in ("-shared", "-fPIC") and not f.startswith("-march")]
    failures = []
    for src in SOURCES:
        done = subprocess.run([cc, "-fsyntax-only", f"-march={march}", *flags, *WARNINGS, str(src)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            failures.append(f"{src.name} (-march={march}):\n{done.stderr.strip()}")
    assert not failures, "\n\n".join(failures)
