"""`minserve` command line: serve | bench serve | bench sweep | bench compare | gate | generate | eval | plan | prepare | doctor.

Subcommands import their modules lazily, so `minserve generate` does not pay for FastAPI and
`minserve serve` does not pay for the load generator.
"""

from __future__ import annotations

import argparse
import sys


def _generate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="minserve generate", description="Generate text for prompts.")
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    from minserve import LLM, SamplingParams
    llm = LLM(a.model)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed)
    for out in llm.generate(a.prompts, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: minserve {serve,bench serve,bench sweep,bench compare,gate,generate,eval,plan,prepare,doctor} [options]  "
             "(-h after a command for its options)")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from minserve.server.cli import main as serve_main
        return serve_main(rest)
    if cmd == "bench":  # bench serve | bench sweep ...
        from minserve.bench.cli import bench_main
        return bench_main(rest)
    if cmd == "gate":  # the release gate (minserve/bench/gate.py)
        from minserve.bench.gate_cli import main as gate_main
        return gate_main(rest)
    if cmd == "generate":
        return _generate(rest)
    if cmd == "eval":
        from minserve.eval.cli import main as eval_main
        return eval_main(rest)
    if cmd == "plan":
        from minserve.plan.cli import main as plan_main
        return plan_main(rest)
    if cmd in ("prepare", "doctor"):
        from minserve.workshop.cli import main as workshop_main
        return workshop_main(cmd, rest)
    print(f"unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
