"""Lab 04 (prefix caching): every check passes on the right answer, fails on a wrong one and names
the typical mistake; under CI the reference solution agrees with the measurement. Plus the toolkit
pieces the lab adds: the two-sample tests, probes and the timing attack (sidechannel.py) and
shared-prefix workloads (prefix.py). Fast: synthetic frames and tiny-llama."""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from course import lab04
from lab_check_helpers import not_ci, verified_under_ci  # noqa: F401 (not_ci: autouse)
from minserve.lab import prefix as px
from minserve.lab import sidechannel as sc


# ---- two-sample tests ------------------------------------------------------------------------

def test_u_statistic_counts_pairs_with_ties_as_halves():
    assert sc.u_statistic([1, 2, 3], [4, 5, 6]) == 0
    assert sc.u_statistic([4, 5, 6], [1, 2, 3]) == 9
    # x > y: 1 > 0.5, 2 > 0.5 (twice), 3 > 2, 3 > 0.5 -> 5 pairs; 2 == 2 twice -> 2 halves
    assert sc.u_statistic([1, 2, 2, 3], [2, 4, 0.5]) == 5 + 0.5 * 2
    a, b = [3.0, 1.0, 2.0], [2.5, 0.5]
    assert sc.u_statistic(a, b) + sc.u_statistic(b, a) == len(a) * len(b)


def test_mann_whitney_matches_the_normal_approximation_by_hand():
    a, b = list(range(1, 9)), list(range(9, 17))          # every a below every b: U = 0
    r = sc.mann_whitney(a, b)
    mu, var = 32.0, 8 * 8 * 17 / 12
    z = (mu - 0.5) / math.sqrt(var)
    assert r.statistic == 0
    assert r.p_value == pytest.approx(math.erfc(z / math.sqrt(2)), rel=1e-12)
    assert r.p_value == pytest.approx(9.4e-4, rel=0.02)
    assert sc.mann_whitney(a, b, alternative="less").p_value < 1e-3
    assert sc.mann_whitney(a, b, alternative="greater").p_value > 0.99
    assert sc.mann_whitney([1, 1, 1], [1, 1, 1]).p_value == 1.0  # all tied: no evidence


@pytest.mark.parametrize("method", ["permutation", "mann-whitney"])
def test_two_sample_test_detects_a_clear_shift(method):
    rng = np.random.default_rng(1)
    hit, miss = rng.normal(100, 10, 10), rng.normal(300, 30, 10)
    r = sc.two_sample_test(hit, miss, alpha=0.01, method=method)
    assert r.significant and r.p_value < 0.01
    assert r.effect < -150 and "significant at alpha = 0.01" in str(r)


@pytest.mark.parametrize("method", ["permutation", "mann-whitney"])
def test_two_sample_test_keeps_its_level_on_identical_distributions(method):
    """Same distribution for both samples: a significant result is a false alarm, which must
    happen in about alpha of the runs (here 200 seeded runs at alpha = 0.05: 10 expected; the
    bound 20 is ~3 standard deviations of a binomial(200, 0.05) above)."""
    alarms = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        x, y = rng.normal(0, 1, 10), rng.normal(0, 1, 10)
        kw = {"n_resamples": 999, "seed": seed} if method == "permutation" else {}
        alarms += sc.two_sample_test(x, y, alpha=0.05, method=method, **kw).significant
    assert alarms <= 20, alarms
    rng = np.random.default_rng(7)
    quiet = sc.two_sample_test(rng.normal(0, 1, 8), rng.normal(0, 1, 8), alpha=0.01, method=method)
    assert not quiet.significant and "not significant" in str(quiet)


def test_permutation_test_is_seeded_and_never_zero():
    a, b = [1.0, 2, 3, 4, 5], [10.0, 11, 12, 13, 14]
    r1, r2 = sc.permutation_test(a, b, seed=3), sc.permutation_test(a, b, seed=3)
    assert r1.p_value == r2.p_value >= 1 / 10_000
    assert sc.permutation_test(a, b, statistic="median").statistic == -9
    assert sc.permutation_test(a, b, alternative="greater").p_value > 0.9


def test_two_sample_test_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        sc.mann_whitney([1.0], [2.0, 3.0])
    with pytest.raises(ValueError, match="alternative"):
        sc.permutation_test([1, 2], [3, 4], alternative="bigger")
    with pytest.raises(ValueError, match="alpha"):
        sc.two_sample_test([1, 2], [3, 4], alpha=1.5)
    with pytest.raises(ValueError, match="method"):
        sc.two_sample_test([1, 2], [3, 4], method="t-test")


# ---- probes and the timing attack on a tiny engine ---------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from minserve import LLM
    return LLM("tiny-llama", max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256)


def memo(i: int) -> str:
    return f"Memo {i:03d}: " + " ".join(f"item{i}-{k}" for k in range(40))


def test_timing_attack_hits_only_without_salts(tiny):
    sent, unsent = [memo(i) for i in range(3)], [memo(i) for i in range(10, 13)]
    _, probes = sc.timing_attack(tiny, sent, unsent, seed=0, live=False)
    assert sorted(probes.group.unique()) == sorted([sc.SENT, sc.UNSENT])
    assert (probes[probes.group == sc.SENT].cached_tokens > 0).all()
    assert (probes[probes.group == sc.UNSENT].cached_tokens == 0).all()
    assert (probes.ttft_s > 0).all() and list(probes.order) == list(range(6))
    # Same memos, a salt per tenant: the attacker finds nothing of the victim's.
    _, salted = sc.timing_attack(tiny, sent, unsent, victim_salt="v", attacker_salt="a", seed=0,
                                 live=False)
    assert salted.cached_tokens.sum() == 0
    assert not tiny.llm_engine.has_unfinished_requests()


def test_probe_refuses_a_busy_engine(tiny):
    from minserve import SamplingParams
    eng = tiny.llm_engine
    eng.add_request("busy", "hello there", SamplingParams(max_tokens=2))
    try:
        with pytest.raises(RuntimeError, match="alone"):
            sc.probe(tiny, [sc.Probe("x")], live=False)
    finally:
        eng.abort_request(["busy"])


# ---- shared-prefix workloads --------------------------------------------------------------------

def test_shared_prefix_requests_share_the_same_tokens_up_to_the_seam(tiny):
    tok = tiny.get_tokenizer()
    reqs, shared = px.shared_prefix_requests(tok, 5, 96, 4, 64, "Policy:\n", seed=3)
    ids = [tok(r.prompt).input_ids for r in reqs]
    n_shared = len(tok(shared).input_ids)
    assert all(len(i) == 96 for i in ids)
    assert min(px.common_prefix_tokens(i, ids[0]) for i in ids[1:]) >= n_shared
    unique, none = px.shared_prefix_requests(tok, 3, 64, 4, 0, seed=3)
    assert none == "" and len({r.prompt for r in unique}) == 3
    with pytest.raises(ValueError, match="shared_tokens"):
        px.shared_prefix_requests(tok, 2, 64, 4, 64)


def test_cold_warm_pairs_are_cold_then_warm_and_calibrated(tiny):
    tok = tiny.get_tokenizer()
    pairs, cal = px.cold_warm_pairs(tiny, tok, 96, 64, "Policy:\n", output_tokens=2, seed=7,
                                    repeats=2, max_runs=3, echo=False)
    assert len(pairs) == 3 == len(cal.samples)   # repeats + the dropped warm-up pair
    # The first pair is the calibration's warm-up: dropped; the median is over the kept ones.
    assert list(pairs.kept) == [False] + [True] * (len(pairs) - 1)
    assert cal.median == pytest.approx(float((pairs.cold_ttft_s - pairs.warm_ttft_s)[pairs.kept].median()))
    # Engine counts, the same on any machine: each pair's first line makes its cold request cold,
    # and its warm request finds the shared blocks.
    assert (pairs.cold_prefilled == pairs.cold_prompt_tokens).all()
    assert (pairs.warm_cached >= 48).all() and (pairs.warm_cached % 16 == 0).all()
    assert (pairs.warm_prefilled == pairs.warm_prompt_tokens - pairs.warm_cached).all()
    assert cal.load is not None


def test_prefix_experiment_reports_what_the_counters_say():
    from minserve.lab.presets import Preset
    from minserve.lab.session import engine_for, release_engine
    preset = Preset("quick", model="tiny-llama", device="cpu",
                    engine_args=dict(max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=128))
    try:
        llm = engine_for(preset, enable_prefix_caching=True, warm_up=False)
        before = px.cache_counters(llm)
        run = px.prefix_experiment(preset, num_requests=4, prompt_tokens=96, output_tokens=4,
                                   shared_fraction=0.75, live=False, seed=5)
        after = px.cache_counters(llm)
        rep = px.cache_report(run)
        assert rep["queries"] == after["queries"] - before["queries"] == 4 * 96
        assert rep["hits"] == after["hits"] - before["hits"] == run.requests.cached_tokens.sum() > 0
        assert rep["computed"] == rep["queries"] - rep["hits"]
        assert rep["hit_rate"] == pytest.approx(rep["hits"] / rep["queries"])
        # Admitted in the same step as the first (budget 128 > 96): the second one misses too.
        assert rep["requests_with_hits"] == 2
    finally:
        release_engine()


# ---- lab 04 checks ------------------------------------------------------------------------------

def test_q1_cached_tokens(monkeypatch):
    q = lab04.q1_cached_tokens(common_tokens=261, block_size=16, prompt_tokens=288, measured=256)
    assert q.evaluate(256).ok
    assert "whole blocks" in q.evaluate(261).message
    assert "rounds up" in q.evaluate(272).message
    assert "whole prompt" in q.evaluate(288).message
    assert "finds them" in q.evaluate(0).message
    assert "too high" in q.evaluate(300).message
    assert q.indistinct_mistakes() == []
    assert verified_under_ci(q, monkeypatch)


def fake_shared_run(cached=(0, 0, 224, 224, 224, 224), prompt=256):
    reqs = pd.DataFrame({"request_id": [str(i) for i in range(len(cached))],
                         "cached_tokens": list(cached), "prompt_tokens": prompt})
    steps = pd.DataFrame({"prefix_cache_queries": [2 * prompt, (len(cached) - 2) * prompt],
                          "prefix_cache_hits": [0, sum(cached)],
                          "num_prefill_tokens": [2 * prompt, (len(cached) - 2) * prompt - sum(cached)]})
    return SimpleNamespace(requests=reqs, steps=steps)


def test_q2_tokens_saved(monkeypatch):
    run = fake_shared_run()
    q = lab04.q2_tokens_saved(run, per_request_hit=224)
    assert q.evaluate(896).ok
    assert "number of requests" in q.evaluate(4).message            # entries, not tokens
    assert "queries counter" in q.evaluate(1536).message
    v = q.evaluate(5 * 224)                                          # "only the first missed"
    assert not v.ok and "same step as the first" in v.message
    assert "very first one" in q.evaluate(6 * 224).message
    assert q.indistinct_mistakes() == []
    assert verified_under_ci(q, monkeypatch)


def test_q3_hit_rate(monkeypatch):
    q = lab04.q3_hit_rate(fake_shared_run())
    assert q.evaluate(896 / 1536).ok and q.evaluate(0.58).ok
    assert "share of *requests*" in q.evaluate(4 / 6).message
    assert "percentage" in q.evaluate(58.33).message
    assert "inverse" in q.evaluate(1536 / 896).message
    assert q.indistinct_mistakes() == []
    assert verified_under_ci(q, monkeypatch)


def test_q4_which_memo(monkeypatch):
    probes = pd.DataFrame({"ttft_s": [0.32, 0.36, 0.097, 0.33], "cached_tokens": [0, 0, 96, 0]})
    guess = lab04.guess_table(probes, ["Heron", "Kestrel", "Osprey", "Plover"])
    q = lab04.q4_which_memo(guess, "Osprey")
    v = q.evaluate("osprey")
    assert v.ok and "96 of its prompt tokens" in v.message
    wrong = q.evaluate("Heron")
    assert not wrong.ok and "nothing of it was cached" in wrong.message
    assert "answer with one of" in q.evaluate("Falcon").message
    assert verified_under_ci(q, monkeypatch)


def test_q4_never_calls_a_slower_probe_faster():
    """Issue 19: on a busy machine the victim's probe may not be the fastest; the old text then
    said "0.9x faster than the slowest". Every comparison word now follows from the numbers."""
    probes = pd.DataFrame({"ttft_s": [0.30, 0.36, 0.33, 0.29], "cached_tokens": [0, 0, 96, 0]})
    guess = lab04.guess_table(probes, ["Heron", "Kestrel", "Osprey", "Plover"])
    v = lab04.q4_which_memo(guess, "Osprey").evaluate("Osprey")
    assert v.ok and "faster" not in v.message
    assert "not the fastest this run" in v.message and "Plover took 290 ms" in v.message
    assert "96 of its prompt tokens" in v.message


def test_times_word_follows_the_numbers():
    # The run: cold 1652 ms, warm 1879 ms was printed as "0.9x faster".
    assert lab04.times_word(1879, 1652) == "1.1x slower"
    assert lab04.times_word(100, 400) == "4.0x faster"
    assert lab04.times_word(1000, 1020) == "about as fast"
    assert lab04.times_word(0, 10) == "not comparable"


def test_leak_causes_name_what_the_run_measured():
    hit, miss = [0.015, 0.016, 0.300], [0.160, 0.170, 0.165]
    causes = lab04.leak_causes(hit, miss, [96, 96, 0])
    assert any("1 of 3 probes of sent memos found nothing" in c for c in causes)
    assert any("1 of 3 probes of sent memos took longer than the fastest probe of an unsent memo (160 ms)"
               in c for c in causes)
    assert lab04.leak_causes([0.015, 0.016], [0.16, 0.17], [96, 96]) == []


def test_q5_u_statistic_names_the_usual_slips(monkeypatch):
    hit, miss = [74.0, 80.5, 90.0, 300.0], [300.0, 310.0, 290.0]
    q = lab04.q5_u_statistic(hit, miss)

    def right(a, b):
        return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)

    assert q.evaluate(right).ok
    v = q.evaluate(lambda a, b: sum(1.0 if x < y else 0.5 if x == y else 0.0 for x in a for y in b))
    assert not v.ok and "smaller" in v.message
    v = q.evaluate(lambda a, b: sum(1.0 for x in a for y in b if x > y))
    assert not v.ok and "ties are left out" in v.message
    v = q.evaluate(lambda a, b: sum(1.0 for x in a for y in b if x >= y))
    assert not v.ok and "one half, not one" in v.message
    assert "should be a function" in q.evaluate(3).message
    assert "raised ZeroDivisionError" in q.evaluate(lambda a, b: 1 / 0).message
    assert verified_under_ci(q, monkeypatch)


def test_q5_explanation_follows_this_runs_u():
    """The old explanation always said "almost no hit probe was slower than a miss probe"."""
    def right(a, b):
        return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)
    apart = lab04.q5_u_statistic([10.0, 11.0, 12.0], [100.0, 110.0, 120.0]).evaluate(right)
    assert apart.ok and "every hit probe was faster than every miss probe" in apart.message
    mixed = lab04.q5_u_statistic([10.0, 115.0, 130.0], [100.0, 110.0, 120.0]).evaluate(right)
    assert mixed.ok and "almost no" not in mixed.message and "barely separate" in mixed.message


def test_q6_salted_decides_by_the_mechanism(monkeypatch):
    salted = pd.DataFrame({"cached_tokens": [0] * 6, "group": [sc.SENT] * 3 + [sc.UNSENT] * 3})
    quiet = sc.TestResult("permutation test (means)", 0.0, 0.6, 3, 3, 0.0, alpha=0.01)
    q = lab04.q6_salted(salted, quiet)
    assert q.evaluate("no leak").ok and "The test agrees" in q.evaluate("no leak").message
    assert not q.evaluate("leak").ok
    # A false alarm of the test does not turn the answer into "leak": no block was shared.
    alarm = sc.TestResult("permutation test (means)", 0.0, 0.004, 3, 3, 0.0, alpha=0.01)
    v = lab04.q6_salted(salted, alarm).evaluate("no leak")
    assert v.ok and "1% of runs" in v.message
    leaky = salted.assign(cached_tokens=[96, 96, 96, 0, 0, 0])
    assert lab04.q6_salted(leaky, quiet).evaluate("leak").ok
    assert verified_under_ci(q, monkeypatch)
