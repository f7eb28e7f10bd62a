"""``minserve prepare`` and ``minserve doctor``."""

from __future__ import annotations

import argparse
import sys

from minserve.plan.planner import format_table


def _prepare(argv: list[str]) -> int:
    from minserve.workshop.prepare import DEFAULT_MODELS, prepare
    ap = argparse.ArgumentParser(
        prog="minserve prepare",
        description="Convert the models, compile the C kernels and measure this machine into a cache "
                    "that participants' sessions then only read (MINSERVE_CACHE=DIR).")
    ap.add_argument("--cache-dir", help="the cache to fill (default: $MINSERVE_CACHE or ~/.cache/minserve)")
    ap.add_argument("--model", action="append", dest="models",
                    help=f"alias or directory; repeatable (default: {', '.join(DEFAULT_MODELS)})")
    ap.add_argument("--no-kernel", action="store_true", help="skip compiling the C kernels")
    ap.add_argument("--no-probe", action="store_true", help="skip measuring this machine for `minserve plan`")
    a = ap.parse_args(argv)
    steps = prepare(a.cache_dir, tuple(a.models or DEFAULT_MODELS), kernel=not a.no_kernel, probe=not a.no_probe)
    print(format_table(("step", "status", "detail"), [(s.step, s.status, s.detail) for s in steps]))
    if any(s.status == "fail" for s in steps):
        return 1
    from minserve.config import cache_dir
    from minserve.workshop.prepare import using_cache
    with using_cache(a.cache_dir):
        print(f"\nparticipants: export MINSERVE_CACHE={cache_dir()}  (their sessions only read it; "
              f"`chmod -R a-w` it to be sure)")
    return 0


def _doctor(argv: list[str]) -> int:
    from minserve.workshop.doctor import failed, format_checks, run_checks
    ap = argparse.ArgumentParser(prog="minserve doctor",
                                 description="Check that this environment can run the labs; exit 1 on a failure.")
    ap.add_argument("--short", action="store_true", help="fast checks only (no kernel build), compact table")
    a = ap.parse_args(argv)
    rows = run_checks(short=a.short)
    print(format_checks(rows, short=a.short))
    return 1 if failed(rows) else 0


def main(cmd: str, argv: list[str]) -> int:
    return _prepare(argv) if cmd == "prepare" else _doctor(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
