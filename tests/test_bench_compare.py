"""bench compare: the statistics against exact math, verdicts on planted differences and none,
manifests refused, exit codes through the CLI."""

import json
import math

import numpy as np
import pytest

from minserve.bench import compare as cmp
from minserve.bench import stats
from minserve.cli import main as cli_main

MANIFEST = {"manifest_version": 1, "workload": {"name": "w", "version": 1, "resolved_sha256": "ab"},
            "model": {"sha256": "m1"}, "hardware": {"cpu_model": "cpu", "usable_cpus": 2, "gpu": None}}


def fake_run(scale: float, seed: int, manifest=MANIFEST, n: int = 40) -> dict:
    """A result dict as bench serve writes it: per-request records with lognormal latencies
    times ``scale`` and run-to-run noise of about 2 %, two request classes."""
    rng = np.random.default_rng(seed)
    run_factor = scale * (1 + 0.02 * rng.standard_normal())
    reqs = []
    for i in range(n):
        ttft = 0.05 * run_factor * rng.lognormal(0, 0.3)
        tpot = 0.01 * run_factor * rng.lognormal(0, 0.1)
        reqs.append({"scenario": "chat" if i % 2 else "batch", "success": True, "ttft_s": ttft,
                     "tpot_s": tpot, "itl_s": [tpot] * 4, "e2el_s": ttft + 4 * tpot})
    out = {"completed": n, "output_throughput": 100 / run_factor, "request_throughput": 5 / run_factor,
           "request_goodput": None, "requests": reqs,
           "classes": {c: {"request_throughput": 2.5 / run_factor} for c in ("chat", "batch")}}
    if manifest is not None:
        out["manifest"] = manifest
    return out


def write_side(tmp_path, name, scale, seed0, k=5, manifest=MANIFEST):
    d = tmp_path / name
    d.mkdir()
    for i in range(k):
        (d / f"run={i}.json").write_text(json.dumps(fake_run(scale, seed0 + i, manifest)))
    (d / "manifest.json").write_text("{}")   # a sweep's own manifest: not a result, skipped
    return d


def test_exact_p_values_count_the_orderings():
    # 3 vs 3, every a above every b: U = 9, one ordering of C(6,3) = 20 -> p = 2/20 two-sided
    u, p, method = stats.mann_whitney_p([4, 5, 6], [1, 2, 3])
    assert (u, method) == (9.0, "exact") and p == pytest.approx(0.1)
    assert stats.mann_whitney_p([4, 5, 6], [1, 2, 3], "greater")[1] == pytest.approx(1 / 20)
    # 5 vs 5 fully separated: 2 / C(10,5) = 2/252
    assert stats.mann_whitney_p(range(5, 10), range(5))[1] == pytest.approx(2 / 252)
    assert sum(stats._u_counts(4, 6)) == math.comb(10, 4)


def test_p_values_match_scipy_exact_and_asymptotic():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for n1, n2 in [(4, 6), (5, 5), (7, 3)]:
        a, b = rng.normal(0.5, 1, n1), rng.normal(0, 1, n2)
        for alt in ("two-sided", "less", "greater"):
            ref = scipy_stats.mannwhitneyu(a, b, alternative=alt, method="exact")
            u, p, _ = stats.mann_whitney_p(a, b, alt)
            assert u == ref.statistic and p == pytest.approx(ref.pvalue, rel=1e-9)
    a, b = np.round(rng.normal(0, 1, 30), 1), np.round(rng.normal(0.3, 1, 25), 1)  # ties
    ref = scipy_stats.mannwhitneyu(a, b, method="asymptotic")
    assert stats.mann_whitney_p(a, b)[1] == pytest.approx(ref.pvalue, rel=1e-9)
    with pytest.raises(ValueError, match="without ties"):
        stats.mann_whitney_p([1, 2], [2, 3], method="exact")


def test_bootstrap_interval_of_the_ratio_covers_the_planted_ratio():
    rng = np.random.default_rng(0)
    base = rng.normal(100, 2, 8)
    lo, hi = stats.bootstrap_ratio_ci(base, base * 1.2)
    assert lo < 1.2 < hi and lo > 1.1
    lo, hi = stats.bootstrap_ratio_ci([5.0] * 4, [5.0] * 4)
    assert lo == hi == 1.0
    with pytest.raises(ValueError, match="level"):
        stats.bootstrap_ratio_ci([1, 2], [1, 2], level=1.5)


def test_judge_rules():
    base = [100, 101, 99, 100.5, 99.5]
    assert cmp.judge(base, [x * 1.2 for x in base], "p90_ttft_ms")[0] == cmp.REGRESSED
    assert cmp.judge(base, [x * 1.2 for x in base], "output_throughput")[0] == cmp.IMPROVED
    assert cmp.judge(base, [x * 1.01 for x in base], "p90_ttft_ms")[0] == cmp.NO_CHANGE
    noisy_new = [80, 150, 95, 170, 60]          # median +5 %, spread far wider: cannot tell
    assert cmp.judge(base, noisy_new, "p90_ttft_ms")[0] == cmp.INCONCLUSIVE
    assert cmp.judge(base[:2], base[:2], "p90_ttft_ms")[0] == cmp.INCONCLUSIVE   # too few runs


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    t = tmp_path_factory.mktemp("cmp")
    return {"base": write_side(t, "base", 1.0, 0), "same": write_side(t, "same", 1.0, 100),
            "slow": write_side(t, "slow", 1.25, 200), "fast": write_side(t, "fast", 0.75, 300),
            "other_cpu": write_side(t, "other", 1.0, 400, manifest={**MANIFEST, "hardware": {"cpu_model": "x"}}),
            "bare": write_side(t, "bare", 1.0, 500, manifest=None)}


def test_planted_slowdown_is_a_regression_per_class(sides):
    c = cmp.compare(sides["base"], sides["slow"])
    assert c.verdict == cmp.REGRESSED and c.exit_code == 1 and c.n_base == c.n_new == 5
    rows = {(r.cls, r.metric): r for r in c.rows}
    assert rows[("all", "p90_ttft_ms")].verdict == cmp.REGRESSED
    assert rows[("chat", "p50_tpot_ms")].verdict == cmp.REGRESSED
    assert rows[("all", "output_throughput")].verdict == cmp.REGRESSED   # lower throughput is worse
    assert 0.15 < rows[("all", "p50_tpot_ms")].change < 0.35
    assert not rows[("all", "p99_ttft_ms")].gated
    assert set(c.frame().columns) >= {"cls", "metric", "change", "p_value", "verdict"}


def test_faster_and_same_builds(sides):
    assert cmp.compare(sides["base"], sides["fast"]).verdict == cmp.IMPROVED
    same = cmp.compare(sides["base"], sides["same"])
    assert same.exit_code in (0, 2) and not same.regressions()


def test_manifests_must_match_unless_allowed(sides):
    c = cmp.compare(sides["base"], sides["other_cpu"])
    assert c.refused and c.exit_code == 2 and not c.rows
    assert any("CPU model differs" in d for d in c.differences)
    assert not cmp.compare(sides["base"], sides["other_cpu"], allow_different=True).refused
    bare = cmp.compare(sides["base"], sides["bare"])
    assert bare.refused and "without a manifest" in bare.differences[0]


def test_cli_exit_codes_table_and_json(sides, tmp_path, capsys):
    assert cli_main(["bench", "compare", str(sides["base"]), str(sides["slow"])]) == 1
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "verdict: regressed (exit 1)" in out
    assert cli_main(["bench", "compare", str(sides["base"]), str(sides["other_cpu"])]) == 2
    assert "NOT COMPARABLE" in capsys.readouterr().out
    files = sorted(str(p) for p in sides["base"].glob("run=*.json"))
    dest = tmp_path / "c.json"
    assert cli_main(["bench", "compare", *files, "--new", str(sides["fast"]), "--json", str(dest)]) == 0
    data = json.loads(dest.read_text())
    assert data["verdict"] == "improved" and data["n_base"] == 5 and data["rows"]
    assert cli_main(["bench", "compare", "a", "b", "c"]) == 2   # two paths, or --new


def test_false_positive_rate_on_synthetic_same_build():
    """12 disjoint pairs of 5-run sets of one build: the gated verdict regresses in few."""
    runs = [fake_run(1.0, s, n=30) for s in range(120)]
    sets = [runs[i:i + 5] for i in range(0, 120, 5)]
    regressed = sum(cmp.compare(a, b, classes=False).verdict == cmp.REGRESSED for a, b in zip(sets[::2], sets[1::2]))
    assert regressed <= 2


def test_signed_rank_p_values_are_exact():
    """Exact counts by hand, scipy where it is exact (no ties, no zeros), and ties counted exactly."""
    assert stats.wilcoxon_signed_rank_p([1, 2, 3, 4, 5])[1] == pytest.approx(2 / 32)   # 5 pairs: p >= 0.0625
    assert stats.wilcoxon_signed_rank_p([1, 2, 3, 4, 5, 6])[1] == pytest.approx(2 / 64)
    assert stats.wilcoxon_signed_rank_p([1, 2, 3, 4, 5, 6], "greater")[1] == pytest.approx(1 / 64)
    # Zeros dropped: d = 1, -2, 3 has W+ = 1 + 3; W+ >= 4 in 3 of the 8 sign assignments.
    assert stats.wilcoxon_signed_rank_p([0, 0, 1, -2, 3])[:2] == (4.0, pytest.approx(2 * 3 / 8))
    # With ties: |d| = 1, 1, 2 has ranks 1.5, 1.5, 3, and d = 1, -1, 2 has W+ = 4.5; of the 8 sign
    # assignments (sums 0, 1.5, 1.5, 3, 3, 4.5, 4.5, 6) W+ >= 4.5 in 3.
    assert stats.wilcoxon_signed_rank_p([1, -1, 2], "greater")[1] == pytest.approx(3 / 8)
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for n in (6, 9, 14):
        d = rng.normal(0.4, 1, n)
        for alt in ("two-sided", "greater", "less"):
            ref = scipy_stats.wilcoxon(d, alternative=alt, method="exact")
            assert stats.wilcoxon_signed_rank_p(d, alt)[1] == pytest.approx(ref.pvalue, rel=1e-9)
    d = rng.normal(0.2, 1, 30)
    ref = scipy_stats.wilcoxon(d, method="approx", correction=False)
    assert stats.wilcoxon_signed_rank_p(d)[1] == pytest.approx(ref.pvalue, rel=1e-9)


def test_paired_ratio_interval_resamples_pairs():
    base = np.array([10.0, 20, 10, 20, 10, 20, 10, 20])        # the machine's speed swings 2x
    lo, hi = stats.bootstrap_paired_ratio_ci(base, base * 1.1)
    assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    with pytest.raises(ValueError, match="equal lengths"):
        stats.bootstrap_paired_ratio_ci(base, base[:3])


def drifting_sides(share: float, k: int = 8, seed: int = 0):
    """k rounds on a machine that is 2x slower in some of them: BASE and NEW of a round share its
    speed, NEW slower by ``share``, with 2 % noise per run."""
    rng = np.random.default_rng(seed)
    speed = np.where(rng.random(k) < 0.4, 2.0, 1.0)
    base = [fake_run(s, 10 * i) for i, s in enumerate(speed)]
    new = [fake_run(s * (1 + share), 10 * i + 5) for i, s in enumerate(speed)]
    return base, new


def test_paired_compare_sees_through_a_drifting_machine():
    """A 10 % slowdown on a machine whose speed swings 2x between rounds: the unpaired compare
    cannot separate it from the swings; pairing each round's two runs can. The same build twice
    under the same swings is not called a regression either way."""
    base, new = drifting_sides(0.10)
    assert cmp.compare(base, new, classes=False).verdict == cmp.INCONCLUSIVE
    paired = cmp.compare(base, new, classes=False, paired=True)
    assert paired.verdict == cmp.REGRESSED and paired.paired and paired.to_json()["paired"] is True
    row = next(r for r in paired.rows if r.metric == "p50_tpot_ms")
    assert 0.05 < row.change < 0.15 and row.p_value < 0.05
    same_base, same_new = drifting_sides(0.0, seed=1)
    assert cmp.compare(same_base, same_new, classes=False, paired=True).verdict != cmp.REGRESSED
    five = drifting_sides(0.10, k=5)       # five pairs: the test's smallest p is 0.0625
    assert cmp.compare(*five, classes=False, paired=True).verdict == cmp.INCONCLUSIVE
    with pytest.raises(ValueError, match="as many NEW runs as BASE runs"):
        cmp.compare(base, new[:5], paired=True)


def test_cli_paired_flag(tmp_path, capsys):
    base, new = drifting_sides(0.25)
    for name, side in (("b", base), ("n", new)):
        (tmp_path / name).mkdir()
        for i, r in enumerate(side):
            (tmp_path / name / f"run={i}.json").write_text(json.dumps(r))
    assert cli_main(["bench", "compare", str(tmp_path / "b"), str(tmp_path / "n"), "--paired"]) == 1
    assert "paired" in capsys.readouterr().out
    assert cli_main(["bench", "compare", str(tmp_path / "b"), str(tmp_path / "b" / "run=0.json"), "--paired"]) == 2
    assert "as many NEW runs" in capsys.readouterr().err


def test_a_folders_runs_are_ordered_by_number(tmp_path):
    """run=10 after run=9: a paired compare matches runs by this order."""
    from minserve.bench.compare_runs import result_files
    for k in (0, 2, 10, 1):
        (tmp_path / f"run={k}.json").write_text("{}")
    assert [p.name for p in result_files(tmp_path)] == ["run=0.json", "run=1.json", "run=2.json", "run=10.json"]
