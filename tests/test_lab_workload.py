"""minserve.lab workloads, records, timelines and correlations, on tiny-llama (in process and
over HTTP), plus the engine's per-step prefill-chunk record they rely on."""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minserve import SamplingParams, lab  # noqa: E402
from minserve.engine.llm_engine import LLMEngine  # noqa: E402
from minserve.lab.timeline import timeline_segments  # noqa: E402

BUDGET = 64


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=BUDGET,
                                      num_kv_blocks=128, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_make_requests_hits_exact_lengths_and_labels(tok):
    reqs = lab.make_requests(tok, prompt_tokens=[20, 150, 7], output_tokens=5, labels=["a", "b", "c"])
    assert [r.prompt_len for r in reqs] == [20, 150, 7]
    assert [len(tok(r.prompt).input_ids) for r in reqs] == [20, 150, 7]
    assert [r.scenario for r in reqs] == ["a", "b", "c"] and {r.expected_output_len for r in reqs} == {5}
    assert len({r.prompt for r in reqs}) == 3
    q = "What is our support number?\n"
    (only,) = lab.make_requests(tok, len(tok(q).input_ids), 3, prefixes=[q])
    assert only.prompt == q
    with pytest.raises(ValueError, match="prompt_tokens"):
        lab.make_requests(tok, [10, 0], 4)
    with pytest.raises(ValueError, match="3 values for 2 requests"):
        lab.make_requests(tok, [10, 20], [1, 2, 3], num_requests=2)


def test_steps_record_prefill_chunks_that_add_up(engine, tok):
    """StepStats.prefill_chunks: (request, context, tokens) per chunk, summing to the step's
    prefill tokens and, per request, to its prompt; and a lone request takes
    ceil(P / B) + N - 1 steps (the formula of lab 00's exercise)."""
    (req,) = lab.make_requests(tok, 150, 6, seed=5)
    first = engine.num_steps
    engine.add_request("chunky", req.prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    steps = [s for s in engine.step_stats if s.step >= first]
    assert len(steps) == math.ceil(150 / BUDGET) + 6 - 1
    assert all(sum(n for _, _, n in s.prefill_chunks) == s.num_prefill_tokens for s in steps)
    chunks = [c for s in steps for c in s.prefill_chunks]
    assert [(rid, ctx, n) for rid, ctx, n in chunks] == [("chunky", 0, 64), ("chunky", 64, 64),
                                                          ("chunky", 128, 22)]
    assert all(s.prefill_chunks == () for s in steps[3:])  # decode-only steps keep it empty
    assert "prefill_chunks" in engine.steps_frame().columns


def test_inprocess_run_has_consistent_records(engine, tok):
    lens = [20, 150, 40, 200, 30, 90]
    reqs = lab.make_requests(tok, lens, output_tokens=[4, 6, 8, 5, 7, 3], seed=1)
    run = lab.run_workload(engine, reqs, name="mix", live=True)  # live: no notebook -> no display
    assert run.in_process and run.target == "engine"
    r = run.requests
    assert len(r) == 6 and r.success.all()
    assert sorted(r.prompt_tokens) == sorted(lens)
    assert dict(zip(r.request_id, r.output_tokens)) == {"0": 4, "1": 6, "2": 8, "3": 5, "4": 7, "5": 3}
    assert (r.arrival_s >= 0).all() and (r.ttft_s >= r.queue_s).all() and (r.e2e_s >= r.ttft_s).all()
    assert np.allclose(r.first_token_s - r.arrival_s, r.ttft_s)
    assert [len(t) for t in r.token_times_s] == list(r.output_tokens)
    # Every prompt token was computed in exactly one recorded chunk (no preemption here).
    for _, row in r.iterrows():
        chunks = run.timelines[row.engine_id]["chunks"]
        assert sum(n for *_, n in chunks) == row.prompt_tokens
        assert chunks[-1][0] <= row.first_token_s  # the last chunk's step samples the first token
    assert len(run.state) == len(run.steps) and run.state.num_preemptions.iloc[-1] == 0
    assert (run.steps.batch >= 1).all() and run.steps.t_s.is_monotonic_increasing
    assert run.summary["completed"] == 6 and run.settings["max_num_batched_tokens"] == BUDGET
    assert run.figure is not None and len(run.figure.axes) == 3
    ch = lab.chunk_table(run)
    assert ch.tokens.sum() == sum(lens) and (ch.tokens <= BUDGET).all()
    assert set(run.percentiles().index) == {"ttft (ms)", "tpot (ms)", "e2e (ms)"}
    k = run.key_numbers()
    assert k["requests"] == 6 and k["failed"] == 0 and k["median_ttft_ms"] > 0
    assert run.by_label("150 tok").prompt_tokens == 150
    with pytest.raises(KeyError, match="labels"):
        run.by_label("nope")


def test_timeline_shows_queue_chunks_decode_and_preemptions(tok):
    """A KV pool too small for the load forces preemptions; the timeline marks them and draws the
    recompute; it stays readable (thinned labels) with 120 requests."""
    small = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=64,
                                       num_kv_blocks=12, enable_prefix_caching=False)
    reqs = lab.make_requests(tok, [40, 60, 30, 50, 45, 35], output_tokens=40, seed=2)
    run = lab.run_workload(small, reqs, live=False)
    assert run.requests.success.all()
    assert run.requests.num_preemptions.sum() > 0
    assert run.state.num_preemptions.iloc[-1] == run.requests.num_preemptions.sum()
    seg = timeline_segments(run)
    assert len(seg["preemption"]) == run.requests.num_preemptions.sum()
    assert seg["recompute"], "a preempted request recomputes its tokens in new chunks"
    assert len(seg["first_token"]) == len(seg["decode"]) == 6
    # Queued time after a preemption: one queued bar per admission.
    assert len(seg["queued"]) == 6 + run.requests.num_preemptions.sum()
    for row, start, end in seg["queued"] + seg["prefill"] + seg["decode"]:
        assert end >= start - 1e-9
    ax = lab.request_timeline(run)
    assert [t.get_text() for t in ax.get_yticklabels()] == list(run.requests.label)

    many = lab.run_workload(small, lab.make_requests(tok, 8, 2, num_requests=120, seed=3), live=False)
    ax = lab.request_timeline(many)
    assert len(ax.get_yticks()) <= 25 and ax.get_ylim()[0] == pytest.approx(119.5)


def test_correlations_and_distributions(engine, tok):
    reqs = lab.make_requests(tok, [10, 200, 15, 180, 12, 20, 160, 25], output_tokens=6, seed=4,
                             labels=["short", "long"] * 4)
    run = lab.run_workload(engine, reqs, live=False)
    ctx = lab.add_context(run)
    assert ctx.mean_batch.between(1, 8).all()
    assert ctx.mean_kv_usage.between(0, 1).all() and (ctx.max_kv_usage >= ctx.mean_kv_usage - 1e-9).all()
    r = lab.correlation_grid(run)
    assert set(r) == {"ttft_s~queue_s", "ttft_s~prompt_tokens", "tpot_s~mean_batch", "e2e_s~mean_kv_usage"}
    assert all(-1 <= v <= 1 for v in r.values() if not math.isnan(v))
    table = lab.compare_distributions({"all": run, "short": run.requests[run.requests.label == "short"]})
    assert list(table.index) == ["all", "short"] and {"p50", "p90", "p99", "mean"} <= set(table.columns)
    assert lab.pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert math.isnan(lab.pearson([1, 1, 1], [1, 2, 3])) and math.isnan(lab.pearson([1, 2], [1, 2]))


def test_run_refuses_a_busy_engine_and_bad_targets(engine, tok):
    reqs = lab.make_requests(tok, 10, 2)
    with pytest.raises(ValueError, match="either"):
        lab.run_workload(engine, reqs, base_url="http://x")
    with pytest.raises(ValueError, match="LLM or an LLMEngine"):
        lab.run_workload(object(), reqs)
    engine.add_request("busy", "hello", SamplingParams(max_tokens=2))
    try:
        with pytest.raises(RuntimeError, match="unfinished"):
            lab.run_workload(engine, reqs)
    finally:
        engine.abort_request("busy")


def test_sweep_runs_each_value(engine, tok):
    out = lab.run_sweep([1, 3], lambda n: lab.run_workload(
        engine, lab.make_requests(tok, 12, 3, num_requests=n), live=False), title="t")
    assert list(out) == [1, 3] and [len(r.requests) for r in out.values()] == [1, 3]


# ---- over HTTP --------------------------------------------------------------------------------

def test_http_run_gives_the_same_frames_from_the_client_side(tok):
    pytest.importorskip("fastapi")
    from minserve.server import create_app

    from live_server import live_server
    served = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=64,
                                        num_kv_blocks=128)
    reqs = lab.make_requests(tok, [30, 90, 20, 60], output_tokens=[5, 4, 6, 3], seed=6)
    with live_server(create_app(served)) as url:
        run = lab.run_workload(base_url=url, requests=reqs, request_rate=20, name="http")
    assert not run.in_process and run.target == url and run.steps is None
    r = run.requests
    assert r.success.all() and list(r.output_tokens) == [5, 4, 6, 3]
    assert r.queue_s.isna().all() and (r.ttft_s > 0).all() and (r.e2e_s >= r.ttft_s).all()
    assert [len(t) for t in r.token_times_s] == [len(x) + 1 for x in run.bench.requests.itl_s]
    assert len(run.state) >= 1 and run.state.kv_cache_usage.between(0, 1).all()
    assert run.summary["completed"] == 4 and run.figure is not None
    # Client view of the timeline; engine-only helpers say what they need.
    seg = timeline_segments(run)
    assert len(seg["waiting"]) == 4 and not seg["prefill"]
    ax = lab.request_timeline(run)
    assert "client view" in ax.get_title()
    with pytest.raises(lab.EngineRecordsRequired, match="in-process"):
        lab.chunk_table(run)
    grid = lab.correlation_grid(run)
    assert math.isnan(grid["ttft_s~queue_s"])
