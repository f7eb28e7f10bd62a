"""The release gate end to end: a policy file, a baseline and candidates, the decision and exit."""

import copy
import json

import pytest
from test_bench_compare import fake_run

from minserve.bench import gate
from minserve.cli import main as cli_main

EVAL_OK = [{"format": "fp32", "quantization": None, "perplexity": 10.0, "mean_kl": 0.0, "exact_match": 0.8},
           {"format": "int8", "quantization": "int8", "perplexity": 10.05, "mean_kl": 0.004, "exact_match": 0.8}]


def with_classes(run: dict, attainment: float) -> dict:
    run["classes"] = {"chat": {"priority_class": "interactive", "slo_attainment": attainment,
                               "request_throughput": run["request_throughput"] / 2},
                      "batch": {"priority_class": "batch", "slo_attainment": 0.95,
                                "request_throughput": run["request_throughput"] / 2}}
    return run


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    t = tmp_path_factory.mktemp("gate")
    out = {}
    for name, scale, att, seed in (("base", 1.0, 0.97, 0), ("slow", 1.3, 0.97, 50),
                                   ("same", 1.0, 0.97, 100), ("missed_slo", 1.0, 0.5, 150)):
        d = t / name
        d.mkdir()
        for i in range(5):
            (d / f"run={i}.json").write_text(json.dumps(with_classes(fake_run(scale, seed + i), att)))
        out[name] = d
    bad = copy.deepcopy(EVAL_OK)
    bad[1].update(perplexity=11.0, exact_match=0.6)
    for name, rows in (("eval_ok", EVAL_OK), ("eval_bad", bad)):
        (t / f"{name}.json").write_text(json.dumps(rows))
        out[name] = t / f"{name}.json"
    return out


def test_default_policy_loads_and_checks_its_version(tmp_path):
    policy = gate.load_policy()
    assert policy["version"] == 1 and "p90_ttft_ms" in policy["performance"]["gated_metrics"]
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({**policy, "version": 99}))
    with pytest.raises(ValueError, match="version must be 1"):
        gate.load_policy(bad)


def gate_cli(dirs, cand, *extra):
    return cli_main(["gate", "--baseline", str(dirs["base"]), "--candidate", str(dirs[cand]), *extra])


def test_planted_regression_is_rejected_by_the_performance_verdict(dirs, capsys, tmp_path):
    out = tmp_path / "d.json"
    assert gate_cli(dirs, "slow", "--eval", str(dirs["eval_ok"]), "--json", str(out)) == 1
    d = json.loads(out.read_text())
    assert d["decision"] == "reject" and d["performance"]["status"] == "fail"
    assert d["quality"]["status"] == "pass"
    assert "decision: reject (exit 1)" in capsys.readouterr().out


def test_quality_floor_rejects_a_candidate_performance_would_pass(dirs, tmp_path):
    policy = gate.load_policy()
    r = gate.run_gate(policy, dirs["base"], dirs["same"], json.loads(dirs["eval_bad"].read_text()))
    assert r.quality.status == "fail" and r.decision == "reject" and r.exit_code == 1
    assert any("perplexity" in why for why in r.quality.reasons)
    assert r.performance.status != "fail"


def test_slo_floor_by_priority_class(dirs):
    r = gate.run_gate(gate.load_policy(), dirs["base"], dirs["missed_slo"], EVAL_OK)
    assert r.performance.status == "fail"
    assert any("class interactive: SLO attainment 50.0% < floor 90%" in x for x in r.performance.reasons)


def test_allowance_accepts_a_small_regression_and_skipped_quality(dirs):
    policy = gate.load_policy()
    policy["performance"]["allowed_regressions"] = {m: 0.5 for m in policy["performance"]["gated_metrics"]}
    r = gate.run_gate(policy, dirs["base"], dirs["slow"])
    assert r.performance.status == "pass" and r.quality.status == "skipped" and r.decision == "approve"
    assert any("within its allowance" in x for x in r.performance.reasons)


def test_unmanifested_results_are_inconclusive(dirs, tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    for i in range(5):
        (d / f"run={i}.json").write_text(json.dumps(fake_run(1.0, 900 + i, manifest=None)))
    assert cli_main(["bench", "gate", "--baseline", str(dirs["base"]), "--candidate", str(d)]) == 2


def test_a_paired_policy_sees_a_regression_through_the_machines_swings(tmp_path):
    """Baseline and candidate alternated on a machine whose speed swings 2x: unpaired, the gate
    cannot tell (inconclusive); with the policy's ``paired`` (or --paired) it rejects."""
    from test_bench_compare import drifting_sides
    base, cand = drifting_sides(0.15)
    for name, side in (("b", base), ("c", cand)):
        (tmp_path / name).mkdir()
        for i, r in enumerate(side):
            (tmp_path / name / f"run={i}.json").write_text(json.dumps(with_classes(r, 0.97)))
    policy = gate.load_policy()
    assert gate.run_gate(policy, tmp_path / "b", tmp_path / "c").decision == "inconclusive"
    policy["performance"]["paired"] = True
    r = gate.run_gate(policy, tmp_path / "b", tmp_path / "c")
    assert r.comparison.paired and r.decision == "reject"
    args = ["bench", "gate", "--baseline", str(tmp_path / "b"), "--candidate", str(tmp_path / "c")]
    assert cli_main(args) == 2 and cli_main([*args, "--paired"]) == 1
