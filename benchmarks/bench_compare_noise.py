"""How often does ``bench compare`` cry wolf, and how small a slowdown does it catch?

    nice -n 10 .venv/bin/python benchmarks/bench_compare_noise.py [--rounds 30] [--pairs 200]

One engine (tiny-llama, in process) runs a small workload (16 requests, 32 output tokens, at most
8 at a time) many times. Four arms, each a BASE and a NEW side: NEW is the build as is (a
false-positive arm: the same build twice) or the build with 5 %, 10 % or 20 % planted into every
engine step (:class:`minserve.engine.observers.PlantedSlowdown`: each step sleeps that share of its
own measured time). Every round runs each arm's two sides back to back, the order of the two
flipped every round, the arms in turn.

Why back to back. This 2-core machine is a VM whose speed changes in spells: for a few seconds
every step takes up to twice as long, then it is back (the plain build's per-run p50 TPOT jumps
between ~7 and ~12 ms with nothing else running). Two runs half a second apart almost always
share a spell; two runs a minute apart often do not. So the trials are:

- *unpaired, same rounds*: ``DEFAULT_RUNS`` (5) consecutive rounds, BASE's runs against NEW's
  with the default (unpaired) compare, as a CI job that alternates the two would measure them;
- *paired* (``compare(paired=True)``, ``--paired``): the same windows, run i of each side paired,
  the signed-rank test of the per-pair ratios, for 6, 8 and 10 pairs (6 is the fewest at which
  a paired test can reach p < 0.05);
- *scattered*: ``--pairs`` draws of 5 runs a side from anywhere in the session: BASE measured at
  another time than NEW, as when a candidate is compared with a baseline measured last week.

Every window of consecutive rounds is a trial, and the scattered draws resample one pool, so the
trials overlap: the figures carry the uncertainty of ``--rounds`` rounds, not of that many
independent experiments (both counts are printed).
"""


from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

import numpy as np

from minserve.bench import compare as cmp
from minserve.bench.compare_runs import ALL, run_from, run_metrics
from minserve.bench.datasets import SampleRequest
from minserve.bench.inprocess import run_inprocess
from minserve.engine.observers import PlantedSlowdown

# Each arm is a pair of sides measured back to back in every round: the plain build (BASE) and
# NEW, which is the plain build again (a false-positive trial) or one with a planted slowdown.
ARMS = (("same build", 0.0), ("5%", 0.05), ("10%", 0.10), ("20%", 0.20))
PLANTED = tuple(name for name, share in ARMS if share > 0)
PAIRED_RUNS = (6, 8, 10)     # a paired test needs at least 6 pairs at alpha 0.05 (see stats.py)
SHOWN = ("p50_tpot_ms", "p90_ttft_ms", "p50_e2el_ms", "output_throughput")


def workload(n: int = 16) -> list[SampleRequest]:
    words = "the quick brown fox jumps over a lazy dog while it rains on the hills".split()
    return [SampleRequest(prompt=" ".join(words[(i + k) % len(words)] for k in range(24)), prompt_len=24,
                          expected_output_len=32, request_id=str(i)) for i in range(n)]


def run_pool(rounds: int) -> dict[str, dict[str, list]]:
    """``rounds`` rounds; in each, every arm's BASE and NEW run back to back (BASE first in even
    rounds, NEW first in odd ones, so neither side always has the warmer cache), the arms in turn.
    Returns {arm: {"base": [runs], "new": [runs]}}, run i of both sides from round i."""
    from minserve import LLM
    llm = LLM("tiny-llama", max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256)
    engine, reqs = llm.llm_engine, workload()
    pool = {name: {"base": [], "new": []} for name, _ in ARMS}

    def one(share: float, seed: int):
        obs = PlantedSlowdown(share)
        engine.add_step_observer(obs)
        try:
            return run_from(run_inprocess(engine, reqs, max_concurrency=8, ignore_eos=True, seed=seed,
                                          manifest=False))
        finally:
            engine.remove_step_observer(obs)

    run_inprocess(engine, reqs, max_concurrency=8, ignore_eos=True, manifest=False)   # warm-up
    for k in range(rounds):
        for name, share in ARMS:
            sides = (("base", 0.0), ("new", share))
            for side, s in (sides if k % 2 == 0 else sides[::-1]):
                pool[name][side].append(one(s, k))
        print(f"  round {k + 1}/{rounds} done", file=sys.stderr, flush=True)
    return pool


def _verdict(base, new, paired: bool = False) -> str:
    # Same build, same process, same machine: the manifests were not built (manifest=False).
    return cmp.compare(base, new, allow_different=True, classes=False, paired=paired).verdict


def _shares(verdicts: list[str]) -> dict[str, float]:
    return {v: verdicts.count(v) / len(verdicts) for v in (cmp.REGRESSED, cmp.NO_CHANGE, cmp.INCONCLUSIVE,
                                                          cmp.IMPROVED)}


def window_trials(pool: dict, k: int = cmp.DEFAULT_RUNS, paired: bool = False) -> dict[str, dict[str, float]]:
    """Both sides from the same ``k`` consecutive rounds, as a CI job that alternates BASE and NEW
    measures them: every window of rounds is one trial (windows overlap, so they are not independent)."""
    out = {}
    for name, sides in pool.items():
        n = len(sides["base"])
        out[name] = _shares([_verdict(sides["base"][i:i + k], sides["new"][i:i + k], paired)
                             for i in range(n - k + 1)])
    return out


def scattered_trials(pool: dict, pairs: int, k: int = cmp.DEFAULT_RUNS, seed: int = 0) -> dict[str, dict[str, float]]:
    """Each side ``k`` runs drawn at random from the whole session: BASE and NEW measured at different
    times, so a drift of the machine's speed during the session lands inside the comparison."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, sides in pool.items():
        n = len(sides["base"])
        out[name] = _shares([_verdict([sides["base"][i] for i in rng.permutation(n)[:k]],
                                      [sides["new"][i] for i in rng.permutation(n)[:k]]) for _ in range(pairs)])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30, help="runs per arm, one of each arm per round")
    ap.add_argument("--pairs", type=int, default=200, help="trials of the scattered design")
    ap.add_argument("--pool", default=None, help="pickle of the runs: written after measuring, read if it exists")
    a = ap.parse_args(argv)
    t0, load_before = time.time(), os.getloadavg()[0]
    if a.pool and os.path.exists(a.pool):   # re-analyse a pool measured before
        with open(a.pool, "rb") as f:
            pool = pickle.load(f)
    else:
        pool = run_pool(a.rounds)
        if a.pool:
            with open(a.pool, "wb") as f:
                pickle.dump(pool, f)
    rounds, k = len(pool[ARMS[0][0]]["base"]), cmp.DEFAULT_RUNS
    print(f"bench compare noise: tiny-llama in process, {rounds} rounds of {len(ARMS)} arms; alpha {cmp.ALPHA}, "
          f"minimum effect {cmp.MIN_EFFECT:.0%}, {k} runs a side (the default)")
    quiet = load_before < 0.5
    print(f"machine: load average {load_before:.1f} before the runs, {os.getloadavg()[0]:.1f} after (this process "
          f"is 1-2 of it), {os.cpu_count()} cores: " + ("quiet" if quiet else "SHARED with other work: noisier"))
    print_planted(pool)
    print_table(window_trials(pool, k), f"unpaired, {k} runs a side from the same rounds (BASE and NEW "
                                        f"alternated in one job): {rounds - k + 1} overlapping windows")
    for n in PAIRED_RUNS:
        print_table(window_trials(pool, n, paired=True), f"paired (--paired), {n} pairs from the same rounds: "
                                                         f"{rounds - n + 1} overlapping windows")
    print_table(scattered_trials(pool, a.pairs, k), f"scattered (each side {k} runs drawn from anywhere in the "
                                                    f"session): {a.pairs} draws")
    print(f"({time.time() - t0:.0f} s; command: nice -n 10 .venv/bin/python benchmarks/bench_compare_noise.py "
          f"--rounds {rounds})")
    return 0


def _values(runs, metric: str) -> np.ndarray:
    return np.array([run_metrics(r)[(ALL, metric)] for r in runs])


def print_planted(pool: dict) -> None:
    """What each arm's slowdown did (the median of NEW_i / BASE_i over the rounds: the effect to be
    detected), and how much the plain build's runs differ from one another."""
    for name in PLANTED:
        got = {m: np.median(_values(pool[name]["new"], m) / _values(pool[name]["base"], m)) - 1 for m in SHOWN}
        print(f"planted {name} per step -> median NEW/BASE over rounds: "
              + ", ".join(f"{m} {v:+.1%}" for m, v in got.items()))
    plain = [r for sides in pool.values() for r in sides["base"]]
    spread = {m: np.std(_values(plain, m)) / np.median(_values(plain, m)) for m in SHOWN}
    print("run-to-run spread of the plain build over the session (std / median): "
          + ", ".join(f"{m} {v:.1%}" for m, v in spread.items()))
    same = pool[ARMS[0][0]]
    adj = {m: np.std(np.log(_values(same["new"], m) / _values(same["base"], m))) for m in SHOWN}
    print("spread of the same build's back-to-back ratio (std of log NEW/BASE): "
          + ", ".join(f"{m} {v:.1%}" for m, v in adj.items()))


def print_table(res: dict, title: str) -> None:
    print(f"--- {title}")
    print(f"{'planted slowdown':>18} {'regressed':>10} {'no change':>10} {'inconclusive':>13} {'improved':>9}")
    for name, r in res.items():
        label = "none (same build)" if name == ARMS[0][0] else f"{name} per step"
        print(f"{label:>18} {r['regressed']:>10.1%} {r['no change']:>10.1%} {r['inconclusive']:>13.1%} "
              f"{r['improved']:>9.1%}")
    print(f"false-positive rate (same build, exit 1): {res[ARMS[0][0]]['regressed']:.1%}")
    caught = [name for name in PLANTED if res[name]["regressed"] >= 0.9]
    print("smallest planted slowdown detected with >= 90 % power: " + (caught[0] if caught else "none of 5/10/20 %"))


if __name__ == "__main__":
    sys.exit(main())
