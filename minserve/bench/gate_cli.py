"""``minserve gate`` (also ``minserve bench gate``): the release gate's command line.

    minserve gate --policy datasets/policies/default.json --baseline results/approved/ \\
        --candidate results/candidate/ --eval eval-candidate.json

Exit status: 0 approve, 1 reject, 2 inconclusive (collect more runs) or not comparable.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from minserve.bench import gate


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minserve gate", description=(
        "Apply a release policy (performance vs the approved baseline, SLOs by class, quality floors)."),
        epilog="exit status: 0 approve, 1 reject, 2 inconclusive or not comparable")
    ap.add_argument("--policy", default=None, help="policy JSON (default: datasets/policies/default.json)")
    ap.add_argument("--baseline", nargs="+", required=True, help="the approved build's result files or directories")
    ap.add_argument("--candidate", nargs="+", required=True, help="the candidate's result files or directories")
    ap.add_argument("--eval", default=None, metavar="FILE", help="the candidate's `minserve eval --json` file")
    ap.add_argument("--run-eval", default=None, metavar="ARGS",
                    help="run `minserve eval ARGS --json ...` now for the quality verdict")
    ap.add_argument("--allow-different", action="store_true", help="compare despite manifest differences")
    ap.add_argument("--paired", action="store_true", default=None,
                    help="the baseline's and the candidate's runs alternated: pair them (bench compare --paired)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the decision as JSON")
    return ap


def eval_rows(a) -> list[dict] | None:
    if a.eval:
        return json.loads(Path(a.eval).read_text(encoding="utf-8"))
    if a.run_eval is None:
        return None
    from minserve.eval.cli import main as eval_main
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "eval.json"
        eval_main([*shlex.split(a.run_eval), "--json", str(out)])
        return json.loads(out.read_text()) if out.is_file() else []


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        policy = gate.load_policy(a.policy)
        result = gate.run_gate(policy, a.baseline, a.candidate, eval_rows(a), a.allow_different, a.paired)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"minserve gate: {e}", file=sys.stderr)
        return 2
    print(f"policy {policy.get('policy', '?')} v{policy['version']}")
    print(result.report())
    if a.json:
        Path(a.json).write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
