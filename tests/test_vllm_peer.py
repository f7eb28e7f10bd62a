"""minserve's tools against a real vLLM (its CPU build), and minserve's tokens against vLLM's.

Our promise is that the bench client, the metrics and the labs keep working when a user moves to
vLLM; a fake server with vLLM's names proves only that we agree with ourselves. Here vLLM itself
serves the converted default model (the same folder minserve loads), started once for the module
by :func:`vllm_peer.vllm_server`.

The module is skipped, with the reason, when vLLM's venv is not set up (``make vllm-venv``): vLLM
is a 3 GiB peer in a venv of its own, never a dependency of minserve's.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import pytest

from minserve import SamplingParams
from lab_runs import SERVER_LABS, check_server_run, run_lab
from prompts import mixed_prompts
from vllm_peer import vllm_server, vllm_venv, vllm_venv_dir

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
# Where the two greedy sequences part, vLLM's own top-2 log-probabilities say whether the choice
# was a coin toss: two fp32 implementations sum in different orders (~1e-5 nats apart), so a
# margin under NEAR_TIE is rounding; anything wider is a real difference and fails.
NEAR_TIE = 1e-3
# vLLM's names for what the live figures draw (see minserve/bench/server_metrics.py).
VLLM_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
               "vllm:num_preemptions_total")


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    if vllm_venv() is None:
        pytest.skip(f"vLLM's CPU build is not set up: run `make vllm-venv` (looked in {vllm_venv_dir()})")
    # Prefix caching is vLLM's default; said explicitly because test (c) counts its hits. 16 seats
    # (vLLM's default is hundreds): lab 01 measures batches up to 16, and lab 02's load sweep (32
    # requests) finds its knee only where requests have to wait for a seat.
    with vllm_server(max_model_len=MAX_MODEL_LEN,
                     extra_args=("--enable-prefix-caching", "--max-num-seqs", "16"),
                     log_dir=tmp_path_factory.mktemp("vllm")) as p:
        yield p


def _metrics(peer) -> dict[str, float]:
    """vLLM's /metrics, one number per sample name (label sets summed)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    text = httpx.get(peer.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# ---- (a) greedy tokens, minserve against vLLM ------------------------------------------------

def _vllm_greedy(peer, prompts, max_tokens):
    """vLLM's greedy token ids and, per position, its top-2 {token id: logprob}."""
    r = httpx.post(peer.base_url + "/v1/completions", timeout=600, json={
        "model": peer.model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])

    def tid(s: str) -> int:  # "token_id:1234", as return_tokens_as_token_ids writes them
        return int(s.split(":", 1)[1])
    return [([tid(t) for t in c["logprobs"]["tokens"]],
             [{tid(k): v for k, v in top.items()} for top in c["logprobs"]["top_logprobs"]])
            for c in choices]


def compare_greedy(ours: list[int], theirs: list[int], top2: list[dict[int, float]]) -> dict:
    """Where ``ours`` leaves ``theirs`` (None if never) and vLLM's margin there, in nats."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            margin = top2[i][b] - top2[i][a] if a in top2[i] else math.inf
            return {"position": i, "ours": a, "vllm": b, "margin": margin}
    assert len(ours) == len(theirs), f"{len(ours)} tokens against vLLM's {len(theirs)}"
    return {"position": None}


def test_greedy_tokens_match_vllm(peer, smol_llm):
    prompts = mixed_prompts(smol_llm.get_tokenizer(), 6, 5, 700, seed=21)
    max_tokens = 32
    theirs = _vllm_greedy(peer, prompts, max_tokens)
    outs = smol_llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             use_tqdm=False)
    report, failures = [], []
    for p, o, (ids, top2) in zip(prompts, outs, theirs):
        d = compare_greedy(list(o.outputs[0].token_ids), ids, top2)
        if d["position"] is None:
            report.append(f"{len(p)}-token prompt: identical ({max_tokens} tokens)")
        elif d["margin"] < NEAR_TIE:
            report.append(f"{len(p)}-token prompt: near-tie at token {d['position']} "
                          f"(ours {d['ours']}, vLLM {d['vllm']}, margin {d['margin']:.2e} nats)")
        else:
            failures.append(f"{len(p)}-token prompt: token {d['position']} is {d['ours']}, vLLM's "
                            f"{d['vllm']}, vLLM rates them {d['margin']:.4f} nats apart "
                            f"(a near-tie is < {NEAR_TIE})")
    print("\n".join(["greedy vs vLLM:", *report, *failures]))
    assert not failures, "\n".join(failures)


def test_compare_greedy_names_the_departure_and_its_margin():
    top2 = [{5: -0.1, 6: -3.0}, {7: -0.6930, 8: -0.6935}]
    assert compare_greedy([5, 7], [5, 7], top2) == {"position": None}
    d = compare_greedy([5, 8], [5, 7], top2)
    assert (d["position"], d["ours"], d["vllm"]) == (1, 8, 7) and d["margin"] == pytest.approx(5e-4)
    assert compare_greedy([9, 7], [5, 7], top2)["margin"] == math.inf  # not even vLLM's second choice


# ---- (b) `minserve bench serve` against vLLM --------------------------------------------------

def _bench(peer, tmp_path, name: str, *args: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "minserve.cli", "bench", "serve", "--base-url", peer.base_url,
           "--model", peer.model, "--dataset-name", "random", "--request-rate", "inf",
           "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
           "--result-filename", f"{name}.json", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads((tmp_path / f"{name}.json").read_text()), run.stdout


def test_bench_serve_reports_vllm_keys_and_scrapes_its_metrics(peer, tmp_path):
    n = 8
    result, out = _bench(peer, tmp_path, "ok", "--num-prompts", str(n), "--random-input-len", "96",
                         "--random-output-len", "16", "--metrics-interval", "0.25")
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
                "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "input_lens",
                "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        assert key in result, key
    assert (result["completed"], result["failed"]) == (n, 0)
    assert result["output_lens"] == [16] * n  # ignore_eos went through to vLLM
    assert "Serving Benchmark Result" in out
    samples = result["server_metrics_timeseries"]
    assert len(samples) >= 2  # one at the start, one at the end at least
    for s in samples:  # every series found under vLLM's name: none left null (absent)
        for col in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                    "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
            assert s[col] is not None, (col, s)
        assert 0.0 <= s["kv_cache_usage_perc"] <= 1.0
    assert samples[-1]["prefix_cache_queries_total"] >= result["total_input_tokens"]
    assert samples[-1]["num_requests_running"] == 0 and samples[-1]["num_requests_waiting"] == 0


def test_bench_serve_counts_vllms_refusals_with_their_reason(peer, tmp_path):
    from minserve.bench.cli import load_bench_tokenizer
    from minserve.bench.datasets import get_samples

    # Random prompts of 11..2289 tokens; this seed makes the first one short (the initial test run
    # sends it and must succeed, as in vLLM's bench) and two of the four longer than
    # --max-model-len, which vLLM refuses with a 400 before any compute.
    flags = dict(num_prompts=4, seed=1432, random_input_len=1150, random_range_ratio=0.99,
                 random_output_len=4)
    samples = get_samples("random", load_bench_tokenizer(peer.model), flags["num_prompts"],
                          flags["seed"], random_input_len=flags["random_input_len"],
                          random_range_ratio=flags["random_range_ratio"],
                          random_output_len=flags["random_output_len"])
    too_long = sum(s.prompt_len > MAX_MODEL_LEN for s in samples)
    assert samples[0].prompt_len < MAX_MODEL_LEN and too_long >= 1, \
        f"pick another seed: prompt lengths {[s.prompt_len for s in samples]}"
    args = [a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    result, out = _bench(peer, tmp_path, "refused", *args)
    assert (result["completed"], result["failed"]) == (len(samples) - too_long, too_long)
    errors = [e for e in result["errors"] if e]
    assert len(errors) == too_long
    assert all("HTTP 400" in e and "maximum context length" in e for e in errors)
    # The summary groups them under one cause, numbers masked, with the count.
    line = next(line for line in out.splitlines() if " x HTTP 400" in line)
    assert line.strip().startswith(f"{too_long} x") and "maximum context length is # tokens" in line


# ---- (c) a lab workload against vLLM -----------------------------------------------------------

def test_lab_workload_and_its_live_figure_data_from_vllm(peer, smol_llm):
    from minserve import lab
    from minserve.bench.datasets import SampleRequest

    tok = smol_llm.get_tokenizer()
    before = _metrics(peer)
    assert all(name in before for name in VLLM_SERIES), sorted(set(VLLM_SERIES) - set(before))
    # One prompt three times, one at a time: the second and third find the first one's full
    # blocks in vLLM's prefix cache (vLLM counts hits in tokens).
    text = lab.make_requests(tok, 300, 8, num_requests=1)[0].prompt
    reqs = [SampleRequest(text, len(tok(text).input_ids), 8, str(i), "same") for i in range(3)]
    reqs += lab.make_requests(tok, [40, 120], 6, seed=3)
    run = lab.run_workload(base_url=peer.base_url, requests=reqs, max_concurrency=1, name="vllm")
    after = _metrics(peer)

    assert not run.in_process and run.steps is None
    assert run.requests.success.all() and run.summary["completed"] == len(reqs)
    assert list(run.requests.output_tokens) == [8, 8, 8, 6, 6]
    assert run.figure is not None
    # The live figure's state panel came from vLLM's gauges, under vLLM's names.
    state = run.state
    assert len(state) >= 2 and not state[["num_running", "num_waiting", "kv_cache_usage",
                                          "num_preemptions"]].isna().any().any()
    assert state.kv_cache_usage.between(0, 1).all()
    sm = run.bench.server_metrics
    assert not sm[["prefix_cache_queries_total", "prefix_cache_hits_total"]].isna().any().any()
    assert sm.prefix_cache_hits_total.iloc[-1] == after["vllm:prefix_cache_hits_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits > 0, "the repeated prompt found nothing in vLLM's prefix cache"
    assert (after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
            >= sum(r.prompt_len for r in reqs))


# ---- (d) whole labs against vLLM ---------------------------------------------------------------

@pytest.mark.parametrize("name", SERVER_LABS)
def test_lab_runs_top_to_bottom_against_vllm(name, peer, tmp_path):
    """Labs 01, 02 and 07 with ``MINSERVE_LAB_TARGET`` set to vLLM: every server-capable section
    runs on what vLLM's responses and /metrics report, each cell that needs minserve's own engine
    prints its skip line, and the lessons are judged on vLLM's numbers."""
    pytest.importorskip("nbclient")
    pytest.importorskip("jupytext")
    nb = run_lab(name, peer.base_url, tmp_path)
    lessons = check_server_run(name, nb, peer.base_url, tmp_path)
    print(f"{name} against vLLM:", *lessons, sep="\n  ")
