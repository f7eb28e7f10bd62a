"""minserve bench sweep: the plan (product, links, labels), --dry-run, POST /reset_prefix_cache,
and tiny sweeps end to end against servers it starts and in process, with a failing combination
recorded, --resume skipping what exists, the results table and the plots."""

import json
import math
from pathlib import Path

import httpx
import pandas as pd
import pytest

from live_server import live_server
from minserve.bench import sweep
from minserve.bench.sweep import Combination, SweepConfig, load_params, parse_link, plan, run_sweep
from minserve.bench.sweep_cli import bench_base
from minserve.bench.sweep_plot import aggregate
from minserve.bench.sweep_cli import main as sweep_main
from minserve.bench.sweep_targets import param_flags
from minserve.server.async_engine import reset_prefix_cache

BENCH = "minserve bench serve --workload short_qa --num-prompts 4 --length-scale 0.3 --seed 5"
PNG = b"\x89PNG\r\n\x1a\n"


def config(tmp_path, serve, bench, **kw) -> SweepConfig:
    return SweepConfig(serve_params=load_params(serve), bench_params=load_params(bench),
                       bench_args=bench_base(kw.pop("bench_cmd", BENCH)), output_dir=tmp_path / "out",
                       model="tiny-llama", show_progress=False, **kw)


# ---- the plan -------------------------------------------------------------------------------

def test_the_plan_is_the_product_less_what_the_links_forbid():
    serve = load_params('[{"max_num_seqs": 2}, {"max_num_seqs": 4}]')
    bench = load_params('[{"max_concurrency": 2, "request_rate": 1}, {"max_concurrency": 4, "request_rate": 1},'
                        ' {"max_concurrency": 4, "request_rate": 2}]')
    assert len(plan(serve, bench)) == 6
    linked = plan(serve, bench, parse_link(["max_num_seqs=max_concurrency"]))
    assert [(c.serve["max_num_seqs"], c.bench["max_concurrency"], c.bench["request_rate"]) for c in linked] == [
        (2, 2, 1), (4, 4, 1), (4, 4, 2)]
    assert linked[0].name == "SERVE--max_num_seqs=2-BENCH--max_concurrency=2-request_rate=1"
    with pytest.raises(ValueError, match="no combination .* agrees"):
        plan(serve, load_params('[{"max_concurrency": 3}]'), parse_link("max_num_seqs=max_concurrency"))
    with pytest.raises(ValueError, match="SERVE_KEY=BENCH_KEY"):
        parse_link("max_num_seqs")


def test_params_come_as_json_a_file_or_named_dicts(tmp_path):
    f = tmp_path / "serve.json"
    f.write_text('{"small": {"max_num_seqs": 2}, "big": {"max_num_seqs": 16}}')
    named = load_params(str(f))
    assert named == [("small", {"max_num_seqs": 2}), ("big", {"max_num_seqs": 16})]
    assert plan(named, load_params(None))[1].name == "SERVE--big-BENCH--default"
    assert load_params(None) == [("", {})]
    with pytest.raises(ValueError, match="JSON list of dicts"):
        load_params("[1, 2")
    with pytest.raises(ValueError, match="share the name"):
        plan(load_params('[{"a": 1}, {"a": 1}]'), load_params(None))


def test_server_params_become_flags():
    assert param_flags({"max_num_seqs": 4, "enable_prefix_caching": False, "enable_chunked_prefill": True,
                        "logits_processors": ["a:B", "c:D"], "kv_cache_memory": None}) == [
        "--max-num-seqs", "4", "--no-enable-prefix-caching", "--enable-chunked-prefill",
        "--logits-processors", "a:B", "c:D"]


def test_bench_params_must_name_bench_flags(tmp_path):
    cfg = config(tmp_path, None, '[{"request_rat": 2}]', dry_run=True)
    with pytest.raises(ValueError, match="'request_rat' is not a `minserve bench serve` flag"):
        run_sweep(cfg)
    with pytest.raises(ValueError, match="one request rate per combination"):
        run_sweep(config(tmp_path, None, '[{"request_rate": "1,2"}]', dry_run=True))


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "dry"
    rc = sweep_main(["serve", "--model", "tiny-llama", "--serve-params", '[{"max_num_seqs": 2}, {"max_num_seqs": 4}]',
                     "--bench-params", '[{"request_rate": 8}]', "--bench-cmd", BENCH, "--num-runs", "2",
                     "-o", str(out), "--dry-run"])
    text = capsys.readouterr().out
    assert rc == 0 and not out.exists()
    assert "serve tiny-llama --host 127.0.0.1 --port PORT --max-num-seqs 4" in text
    assert ("minserve bench serve --workload short_qa --num-prompts 4 --length-scale 0.3 --seed 5 "
            "--request-rate 8") in text
    assert "2 combinations x 2 runs = 4 runs" in text
    assert sweep_main(["serve", "--base-url", "http://127.0.0.1:9", "--serve-params", '[{"max_num_seqs": 2}]',
                       "-o", str(out), "--dry-run"]) == 2     # a running server has no server params
    assert "--serve-params must be empty" in capsys.readouterr().err


# ---- resetting the prefix cache ----------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    from minserve.engine.llm_engine import LLMEngine
    return LLMEngine.from_engine_args("tiny-llama", max_num_seqs=2, max_num_batched_tokens=256,
                                      num_kv_blocks=64)


def cached_tokens(engine, prompt: list[int]) -> int:
    from minserve import SamplingParams
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got = out.num_cached_tokens
    return got


def test_reset_prefix_cache_forgets_every_cached_block(engine):
    prompt = list(range(10, 58))   # three full blocks of 16
    cached_tokens(engine, prompt)
    assert cached_tokens(engine, prompt) == 32 and engine.kv.pool.cached
    assert reset_prefix_cache(engine) is True and not engine.kv.pool.cached
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert cached_tokens(engine, prompt) == 0          # prefilled whole again, as on a fresh server
    from minserve import SamplingParams
    engine.add_request("busy", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    engine.step()
    assert reset_prefix_cache(engine) is False and engine.kv.pool.cached   # in flight: refused, unchanged
    engine.abort_request("busy")
    assert reset_prefix_cache(engine) is True


def test_the_endpoint_is_admin_only_when_keys_are_configured():
    from minserve.engine.llm_engine import LLMEngine
    from minserve.server import Auth, Principal, create_app
    eng = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=2, max_num_batched_tokens=256, num_kv_blocks=64)
    app = create_app(eng, auth=Auth({"sk-user": Principal("acme"), "sk-ops": Principal("ops", admin=True)}))
    with live_server(app) as base:
        def post(key):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(base + "/reset_prefix_cache", headers=headers, timeout=30)
        body = {"prompt": "word " * 40, "max_tokens": 1, "model": "tiny-llama"}
        for _ in range(2):
            done = httpx.post(base + "/v1/completions", json=body, timeout=60,
                              headers={"Authorization": "Bearer sk-ops"}).json()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert post(None).status_code == 401 and post("sk-user").status_code == 403
        resp = post("sk-ops")
        assert resp.status_code == 200 and resp.json() == {"reset": True}
        again = httpx.post(base + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer sk-ops"}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# ---- sweeps end to end -------------------------------------------------------------------------

def run_files(out: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in out.glob("SERVE--*/*")}


def test_a_sweep_over_servers_it_starts(tmp_path, capsys):
    # The failing combination comes first: the sweep must go on past it.
    serve = '[{"max_num_seqs": 0}, {"max_num_seqs": 2}, {"max_num_seqs": 4}]'
    cfg = config(tmp_path, serve, '[{"request_rate": 20, "max_concurrency": 1}]', num_runs=2,
                 ready_timeout_s=120)
    df = run_sweep(cfg)
    out = cfg.output_dir
    ok = df[df.status == "ok"]
    assert sorted(zip(ok.max_num_seqs, ok.run)) == [(2, 0), (2, 1), (4, 0), (4, 1)]
    assert (ok.completed == 4).all() and (ok.failed == 0).all() and ok.has_manifest.all()
    bad = df[df.status == "failed"]
    assert list(bad.run) == [0, 1] and (bad.stage == "server start").all()
    assert "max_num_seqs must be in [1, 4096], got 0" in bad.reason.iloc[0]
    for combo in ("SERVE--max_num_seqs=2-BENCH--request_rate=20-max_concurrency=1",
                  "SERVE--max_num_seqs=4-BENCH--request_rate=20-max_concurrency=1"):
        for k in (0, 1):
            result = json.loads((out / combo / f"run={k}.json").read_text())
            m = result["manifest"]
            assert m["server"]["kind"] == "minserve-serve" and m["server"]["prefix_cache_reset"] is True
            assert m["engine"]["max_num_seqs"] == result["serve_params"]["max_num_seqs"]
            assert m["workload"]["name"] == "short_qa" and m["load"]["seconds"] > 0
            cached = [r["cached_tokens"] for r in result["requests"]]
            # Reset before every run: its first request finds nothing, later ones share a prefix.
            assert cached[0] == 0 and max(cached) > 0, cached
        assert (out / combo / "server.log").is_file()
    table = pd.read_csv(out / "summary.csv")
    assert len(table) == 6 and set(table.status) == {"ok", "failed"}
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["rows"]) == 6 and summary["manifest"]["sweep"]["num_runs"] == 2
    assert summary["manifest"]["hardware"]["cpu_model"]
    for name in ("p99_ttft_vs_request_rate.png", "pareto_tokens_per_s_per_user.png", "pareto_request_goodput.png"):
        assert (out / "plots" / name).read_bytes()[:8] == PNG

    # --resume: every run exists, so no server starts and no result is rewritten; without it the
    # directory is refused rather than mixed with.
    before = run_files(out)
    with pytest.raises(ValueError, match="already holds sweep results"):
        run_sweep(config(tmp_path, serve, '[{"request_rate": 20, "max_concurrency": 1}]', num_runs=2))
    cfg.resume = True
    again = run_sweep(cfg)
    after = run_files(out)
    assert {p: t for p, t in after.items() if "failed" not in p} == {p: t for p, t in before.items() if "failed" not in p}
    assert "4 already done (--resume)" in capsys.readouterr().out
    assert len(again[again.status == "ok"]) == 4

    # The plot commands on the same directory: PNGs, and the front as a table.
    assert sweep_main(["plot", str(out), "--var-y", "median_ttft_ms", "--curve-by", "max_num_seqs"]) == 0
    assert sweep_main(["plot_pareto", str(out), "--var-y", "request_goodput"]) == 0
    assert (out / "plots" / "median_ttft_ms_vs_request_rate.png").read_bytes()[:8] == PNG
    front = pd.read_csv(out / "plots" / "pareto_request_goodput.csv")
    assert len(front) == 2 and front.on_frontier.any()


def test_an_inprocess_sweep_records_a_failing_bench_combination(tmp_path):
    cfg = config(tmp_path, '[{"max_num_seqs": 2}]', '[{"max_concurrency": 0}, {"request_rate": 50}]',
                 num_runs=2, in_process=True, plots=False)
    df = run_sweep(cfg)
    bad = df[df.status == "failed"]
    assert list(bad.run) == [0, 1] and (bad.stage == "bench setup").all()
    assert "max_concurrency must be >= 1, got 0" in bad.reason.iloc[0]
    ok = df[df.status == "ok"]
    assert list(ok.run) == [0, 1] and (ok.completed == 4).all()
    m = json.loads(Path(ok.file.iloc[0]).read_text())["manifest"]
    assert m["server"]["kind"] == "in-process" and m["server"]["prefix_cache_reset"] is True
    assert m["engine"]["max_num_seqs"] == 2 and m["engine"]["model"] == "tiny-llama"
    assert not (cfg.output_dir / "plots").exists()


def test_a_sweep_against_a_running_server_varies_only_bench_parameters(tmp_path):
    from minserve.engine.llm_engine import LLMEngine
    from minserve.server import create_app
    eng = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=2, max_num_batched_tokens=256, num_kv_blocks=64)
    with live_server(create_app(eng)) as base:
        cfg = config(tmp_path, None, '[{"request_rate": 30}, {"request_rate": 60}]', num_runs=1,
                     base_url=base, plots=False)
        df = run_sweep(cfg)
        assert list(df.status) == ["ok", "ok"] and sorted(df.request_rate) == [30.0, 60.0]
        m = json.loads(Path(df.file.iloc[0]).read_text())["manifest"]
        assert m["server"]["kind"] == "external" and m["server"]["base_url"] == base
        assert m["server"]["prefix_cache_reset"] is True and m["engine"] is None
        bad = run_sweep(config(tmp_path / "b", '[{"max_num_seqs": 4}]', None, num_runs=1, base_url=base, plots=False))
        assert list(bad.stage) == ["server start"] and "server parameters cannot vary" in bad.reason.iloc[0]


# ---- the results as frames ---------------------------------------------------------------------

def frame(points) -> pd.DataFrame:
    return pd.DataFrame([{"combination": f"SERVE--{i}-BENCH--b", "serve_label": str(i), "bench_label": "b",
                          "run": 0, "status": "ok", "output_throughput": x, "tokens_per_s_per_user": y}
                         for i, (x, y) in enumerate(points)])


def test_the_pareto_front_keeps_the_points_nothing_beats():
    points = [(10, 50), (20, 40), (15, 30), (30, 10), (20, 45), (5, 50)]
    front = sweep.pareto_frame(frame(points))
    kept = sorted((r.output_throughput, r.tokens_per_s_per_user) for r in front.itertuples() if r.on_frontier)
    assert kept == [(10, 50), (20, 45), (30, 10)]


def test_runs_are_aggregated_by_their_median_with_the_spread():
    df = pd.concat([frame([(10, 1)]), frame([(20, 3)]), frame([(60, 2)])]).assign(run=[0, 1, 2])
    agg = aggregate(df)
    row = agg.iloc[0]
    assert (row.output_throughput, row.output_throughput_min, row.output_throughput_max, row.n_runs) == (20, 10, 60, 3)


def test_loading_results_without_a_manifest_says_they_are_not_comparable(tmp_path, capsys):
    with_manifest = {"completed": 1, "request_rate": "inf", "median_tpot_ms": 20.0,
                     "manifest": {"manifest_version": 1, "workload": {"name": "w"}}}
    (tmp_path / "a.json").write_text(json.dumps(with_manifest))
    (tmp_path / "b.json").write_text(json.dumps({"completed": 1, "request_rate": 2.0}))
    df = sweep.load_results(tmp_path)
    assert list(df.combination) == ["a", "b"] and list(df.has_manifest) == [True, False]
    assert df.not_comparable.iloc[1].startswith("results without a manifest are not comparable")
    assert "not comparable" in capsys.readouterr().err
    assert df.request_rate.iloc[0] == math.inf and df.tokens_per_s_per_user.iloc[0] == 50.0
    fig = sweep.plot(df, x="request_rate", y="completed", path=tmp_path / "p.png")
    assert "1 points at request_rate=inf left out" in fig.axes[0].get_title()
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG


def test_a_combination_name_is_safe_as_a_directory():
    c = Combination({"quantization_config": {"group_size": 64}}, {"goodput": ["ttft:500"]})
    assert "/" not in c.name and " " not in c.name and c.name.startswith("SERVE--quantization_config=")
