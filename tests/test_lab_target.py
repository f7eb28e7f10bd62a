"""One target for a whole lab (issue 21, item 1): the engine in the notebook, or a server.

Fast tests: how the target is resolved (``MINSERVE_LAB_TARGET``, ``lab.setup(target=...)``), that
the API key (``MINSERVE_LAB_API_KEY``) goes with every HTTP call to the target's server (a server
with keys refuses the calls without it), and how a cell that needs the engine is skipped.

The slow test starts a real ``minserve serve`` (the labs' default model, smollm2-135m; 4 seats,
prefix caching on, an API key) and runs labs 03, 04 and 08 (and 01, 02, 07 without vLLM's venv)
top to bottom against it with ``MINSERVE_LAB_CI=1``, as ``make test`` runs notebooks: every cell
marked ``# needs the engine:`` prints its one skip line and nothing else, every other cell runs.
"""

from __future__ import annotations

import math
import subprocess
import sys

import httpx
import pytest

import minserve.lab as lab
from minserve.lab import target as tg
from lab_runs import ROOT, SERVER_LABS, check_server_run, run_lab
from vllm_peer import free_port, vllm_venv, wait_healthy


@pytest.fixture(autouse=True)
def _fresh_target(monkeypatch):
    monkeypatch.delenv(tg.TARGET_ENV, raising=False)
    monkeypatch.delenv(tg.API_KEY_ENV, raising=False)
    tg._state["target"] = None
    yield
    tg._state["target"] = None


# ---- resolution -------------------------------------------------------------------------------

def test_default_is_the_engine_in_this_process():
    t = lab.current_target()
    assert t.in_process and t.base_url is None and t.headers() == {}
    for name in ("", "inprocess", " InProcess "):
        assert tg.resolve(name).in_process


def test_environment_names_the_server_and_its_key(monkeypatch):
    monkeypatch.setenv("MINSERVE_LAB_TARGET", "http://box:8000/v1/")
    monkeypatch.setenv("MINSERVE_LAB_API_KEY", "sk-room")
    t = lab.current_target()
    assert t == lab.Target("http://box:8000", "sk-room")   # trailing /v1 and / dropped
    assert t.headers() == {"Authorization": "Bearer sk-room"}
    assert t.is_for("http://box:8000/") and not t.is_for("http://other:8000")
    assert tg.headers_for("http://box:8000") == {"Authorization": "Bearer sk-room"}
    assert tg.headers_for("http://127.0.0.1:9") is None     # another server: not our key


def test_setup_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("MINSERVE_LAB_TARGET", "http://box:8000")
    lab.setup(target="inprocess")
    assert lab.current_target().in_process
    lab.setup(target="http://other:9000", api_key="k2")
    assert lab.current_target() == lab.Target("http://other:9000", "k2")


def test_a_target_that_is_no_url_is_refused_naming_it(monkeypatch):
    with pytest.raises(ValueError, match="box:8000.*setup"):
        tg.resolve("box:8000")
    monkeypatch.setenv("MINSERVE_LAB_TARGET", "ftp://box")
    with pytest.raises(ValueError, match="MINSERVE_LAB_TARGET"):
        tg.resolve()


# ---- skipping what needs the engine --------------------------------------------------------------

def test_needs_engine_is_silent_in_process_and_one_line_against_a_server(capsys):
    assert lab.needs_engine("the engine's block tables") is True
    assert capsys.readouterr().out == ""
    tg.set_target("http://box:8000")
    assert lab.needs_engine("the engine's block tables") is False
    assert capsys.readouterr().out == ("skipped against http://box:8000 (in process only): this "
                                       "exercise needs the engine's block tables\n")


def test_a_marked_cell_becomes_its_skip_line_only_against_a_server(capsys):
    cell = ["\n", "# needs the engine: the engine's step records\n", "st = run.steps\n",
            "1 / 0\n"]
    plain = ["x = 1\n", "# needs the engine: not the first line\n"]
    assert tg.transform_cell(cell) == cell and tg.transform_cell(plain) == plain
    tg.set_target("http://box:8000")
    assert tg.transform_cell(plain) == plain
    code = "".join(tg.transform_cell(cell))
    exec(compile(code, "<cell>", "exec"), {})           # the body (1 / 0) never runs
    assert capsys.readouterr().out == ("skipped against http://box:8000 (in process only): this "
                                       "exercise needs the engine's step records\n")


def test_engine_for_a_server_builds_no_engine_and_says_which_arguments_are_the_servers(capsys):
    tg.set_target("http://box:8000", "k")
    llm = lab.engine_for(lab.get_preset("quick"), enable_prefix_caching=False, warm_up=False)
    assert isinstance(llm, lab.RemoteLLM) and llm.base_url == "http://box:8000"
    assert "enable_prefix_caching=False cannot be set over HTTP" in capsys.readouterr().out
    with pytest.raises(lab.EngineRecordsRequired):
        llm.llm_engine
    srv = lab.local_server.serve(llm, admission=object())
    assert srv.base_url == "http://box:8000" and srv.admission is None
    assert "keeps its own" in capsys.readouterr().out
    lab.release_engine()


# ---- the key goes with every call to the target -------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(tiny_llm):
    """tiny-llama behind an app that wants a key (an admin key: /metrics too)."""
    from live_server import live_server
    from minserve.server import create_app
    from minserve.server.auth import Auth, Principal
    app = create_app(tiny_llm.llm_engine, auth=Auth({"sk-lab": Principal("lab", admin=True),
                                                     "sk-user": Principal("user")}))
    with live_server(app) as base:
        yield base, tiny_llm


def test_run_workload_and_offer_send_the_targets_key(keyed_server, monkeypatch):
    base, llm = keyed_server
    monkeypatch.setenv("MINSERVE_LAB_TARGET", base)
    monkeypatch.setenv("MINSERVE_LAB_API_KEY", "sk-lab")
    reqs = lab.make_requests(llm.get_tokenizer(), 16, 4, num_requests=3)
    remote = lab.RemoteLLM(lab.current_target(), "tiny-llama")
    run = lab.run_workload(remote, reqs, live=False)
    assert run.requests.success.all() and run.target == base
    assert run.state.num_running.notna().any()              # /metrics polled with the key
    res = lab.traffic.offer(base, lab.traffic.calls(reqs), live=False)
    assert (res.requests.outcome == "ok").all()
    assert len(res.state) and res.state.num_running.notna().any()


def test_prefix_cache_counters_come_from_the_targets_metrics(keyed_server, capsys):
    from minserve.lab import prefix as px
    base, llm = keyed_server
    remote = lab.RemoteLLM(lab.Target(base, "sk-lab"), "tiny-llama")
    before = px.cache_counters(remote)
    text = lab.make_requests(llm.get_tokenizer(), 64, 2, num_requests=1)[0].prompt
    for _ in range(2):   # the second finds the first one's full blocks
        r = httpx.post(f"{base}/v1/completions", headers={"Authorization": "Bearer sk-lab"},
                       json={"model": "tiny-llama", "prompt": text, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    after = px.cache_counters(remote)
    assert after["queries"] - before["queries"] >= 2 * 60
    assert after["hits"] - before["hits"] >= 48          # at least three 16-token blocks
    # A participant's key does not see /metrics: NaN and one line, not an exception.
    nan = px.cache_counters(lab.RemoteLLM(lab.Target(base, "sk-user"), "tiny-llama"))
    assert math.isnan(nan["queries"]) and math.isnan(nan["hits"])
    assert "answered 403: no prefix-cache counters" in capsys.readouterr().out


def test_without_the_key_the_keyed_server_refuses(keyed_server, monkeypatch):
    base, llm = keyed_server
    monkeypatch.setenv("MINSERVE_LAB_TARGET", base)
    monkeypatch.setenv("MINSERVE_LAB_API_KEY", "sk-wrong")
    reqs = lab.make_requests(llm.get_tokenizer(), 16, 4, num_requests=1)
    with pytest.raises(ValueError, match="API key"):
        lab.run_workload(base_url=base, requests=reqs, live=False)


def test_run_experiment_goes_to_the_target_and_names_the_engine_arguments(keyed_server, monkeypatch,
                                                                        capsys):
    base, _ = keyed_server
    monkeypatch.setenv("MINSERVE_LAB_TARGET", base)
    monkeypatch.setenv("MINSERVE_LAB_API_KEY", "sk-lab")
    preset = lab.Preset(**{**lab.get_preset("quick").__dict__, "model": "tiny-llama"})
    run = lab.run_experiment(preset, num_requests=2, prompt_tokens=16, output_tokens=4, live=False,
                             max_num_seqs=2)
    assert run.target == base and run.requests.success.all()
    assert "max_num_seqs: set by the server" in capsys.readouterr().out
    with pytest.raises(ValueError, match="cannot be set over HTTP"):   # an explicit base_url: refused
        lab.run_experiment(preset, base_url=base, max_num_seqs=2, live=False)


def _tour_http_cell() -> str:
    """Lab 00's section-8 cell, as the notebook runs it (its source, from labs/00_tour.py)."""
    import jupytext
    nb = jupytext.read(ROOT / "labs" / "00_tour.py")
    cells = [c.source for c in nb.cells
             if c.cell_type == "code" and c.source.startswith("target = lab.current_target()")]
    assert len(cells) == 1, "lab 00 has no (or more than one) section-8 cell"
    return cells[0]


@pytest.mark.parametrize("against", ["the target", "a server in the notebook"])
def test_the_tours_eight_requests_go_over_http(against, keyed_server, monkeypatch, capsys):
    """Lab 00 builds its own engine whatever the target; its section-8 cell sends its requests to
    the lab's target when one is set (with its key), else to a server it starts around that engine
    and stops after, handing the engine back. (The whole lab runs in-process under nbval.)"""
    pytest.importorskip("jupytext")
    from minserve import LLM, SamplingParams
    base, _ = keyed_server
    if against == "the target":
        monkeypatch.setenv("MINSERVE_LAB_TARGET", base)
        monkeypatch.setenv("MINSERVE_LAB_API_KEY", "sk-lab")
    else:
        monkeypatch.delenv("MINSERVE_LAB_TARGET", raising=False)
    llm = LLM("tiny-llama", max_num_seqs=8, num_kv_blocks=64, enable_prefix_caching=True)
    tour_reqs = lab.make_requests(llm.get_tokenizer(), [40, 8, 24], 4, seed=1)
    ns = {"lab": lab, "llm": llm, "tour_reqs": tour_reqs,
          "tour_run": lab.run_workload(llm, tour_reqs, live=False)}
    exec(_tour_http_cell(), ns)
    served = ns["served"]
    assert served.requests.success.all() and len(served.requests) == 3
    assert list(served.requests.output_tokens) == [4, 4, 4]
    out = capsys.readouterr().out
    if against == "the target":
        assert served.target == base and ns["local"] is None
        assert "On the server: median TTFT" in out
    else:
        assert ns["local"] is not None and not ns["local"].running
        assert served.target == ns["local"].base_url != base
        assert "On the server in this notebook: median TTFT" in out
        # The 40-token prompt's two full blocks were cached by the run before, yet the server's
        # requests miss them (the tenant salts their cache keys): both runs computed the same.
        # Afterwards the engine is the notebook's again.
        frame = llm.llm_engine.requests_frame()
        assert frame.cached_tokens.tail(3).sum() == 0, frame.tail(3)
        again = llm.generate([r.prompt for r in tour_reqs], SamplingParams(max_tokens=2), use_tqdm=False)
        assert all(o.finished for o in again)


# ---- whole labs against a real `minserve serve` ------------------------------------------------

@pytest.fixture(scope="module")
def minserve_serve(tmp_path_factory):
    pytest.importorskip("nbclient")
    pytest.importorskip("jupytext")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "minserve.cli", "serve", "smollm2-135m", "--port", str(port),
           "--max-num-seqs", "4", "--api-key", "sk-lab-target"]   # prefix caching on: lab 04
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log, 180, name="minserve serve")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# Labs 01, 02 and 07 run against a real vLLM in tests/test_vllm_peer.py when its venv is set up (CI
# sets it up); here they run only without it, so that every server-capable lab runs against some
# server in every test run, and CI does not pay for them twice (lab 07 took 83 s here on a slow
# host, on top of its in-process and its vLLM runs).
# Lab 08 (the capstone) runs its baseline, load steps, burst and long-request drills against the
# server; its one change, restart, replica and KV-cut drills build engines or stop servers, and skip.
MINSERVE_LABS = ("03_kv_cache_detective", "04_prefix_caching", "08_optimization_lab",
                 *(() if vllm_venv() else SERVER_LABS))


@pytest.mark.parametrize("name", MINSERVE_LABS)
def test_lab_runs_top_to_bottom_against_a_server(name, minserve_serve, tmp_path):
    nb = run_lab(name, minserve_serve, tmp_path, api_key="sk-lab-target")
    engine_only = {"03": dict(baseline=False, lessons=False), "04": dict(baseline=False)}
    lessons = check_server_run(name, nb, minserve_serve, tmp_path, **engine_only.get(name[:2], {}))
    if name.startswith("04"):   # section 2 read the server's prefix-cache counters
        assert any("04-shared-workload" in ln or "preamble" in ln for ln in lessons), lessons
        report = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("rows = {}"))
        html = "".join(str(o.get("data", {}).get("text/plain", "")) for o in report.outputs)
        assert "vllm:prefix_cache_hits" in html and "shared preamble" in html, html
