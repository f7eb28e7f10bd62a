"""minserve.lab presets, set-up (quiet logs on stdout), engine reuse, controls and baselines."""

import json
import logging
import math

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402

from minserve import lab  # noqa: E402
from minserve.lab.presets import CI_ENV, PRESET_ENV, Preset  # noqa: E402


@pytest.fixture(autouse=True)
def restore_logger():
    logger = logging.getLogger("minserve")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


def test_presets_pick_and_validate(monkeypatch):
    monkeypatch.delenv(PRESET_ENV, raising=False)
    quick = lab.get_preset()
    assert quick.name == "quick" and quick.pick(quick=1, full=2) == 1
    assert quick.device in ("cpu", "cuda") and quick.engine_kwargs()["device"] == quick.device
    assert quick.engine_kwargs(max_num_seqs=3, num_kv_blocks=None)["max_num_seqs"] == 3
    assert quick.engine_kwargs(num_kv_blocks=None)["num_kv_blocks"] == 256  # None keeps the preset's
    assert quick.pick(quick=1, full=2, smoke=0) == 1   # a smoke size never leaks into quick
    monkeypatch.setenv(PRESET_ENV, "FULL")
    assert lab.get_preset().pick(quick=1, full=2) == 2
    assert lab.get_preset().pick(quick=1, full=2, smoke=0) == 2
    monkeypatch.setenv(PRESET_ENV, "smoke")
    smoke = lab.get_preset()
    # Its own size where a lab gives one (0 and [] count: only None means "not given"), else quick's.
    assert smoke.pick(quick=1, full=2, smoke=0) == 0 and smoke.pick(quick=1, full=2, smoke=[]) == []
    assert smoke.pick(quick=1, full=2) == 1
    assert smoke.engine_args == quick.engine_args   # the same engine: only the workloads shrink
    monkeypatch.setenv(PRESET_ENV, "huge")
    with pytest.raises(ValueError, match="MINSERVE_LAB_PRESET must be one of quick, full, smoke"):
        lab.get_preset()


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("", False)])
def test_ci_flag(monkeypatch, value, expected):
    monkeypatch.setenv(CI_ENV, value)
    assert lab.is_ci() is expected


def test_setup_sends_engine_logs_to_stdout_as_plain_text(capsys):
    lab.setup()
    log = logging.getLogger("minserve")
    log.info("engine ready")           # routine: hidden
    log.warning("something to know")   # shown, on stdout (Jupyter paints stderr red)
    out, err = capsys.readouterr()
    assert "engine ready" not in out + err
    assert "[minserve WARNING] something to know" in out and err == ""
    lab.setup(log_level="INFO")
    log.info("engine ready")
    assert "engine ready" in capsys.readouterr().out


def test_engine_for_reuses_and_replaces(capsys):
    p = Preset(name="quick", model="tiny-llama",
               engine_args=dict(max_num_batched_tokens=32, num_kv_blocks=32))
    a = lab.engine_for(p)
    assert lab.engine_for(p) is a
    b = lab.engine_for(p, max_num_seqs=2)
    assert b is not a and b.llm_engine.config.max_num_seqs == 2
    assert b.llm_engine.config.max_num_batched_tokens == 32
    assert len(b.llm_engine.step_stats) > 0, "warmed up"
    lab.release_engine()


def test_run_experiment_and_the_panel_call_the_same_function():
    p = Preset(name="quick", model="tiny-llama",
               engine_args=dict(max_num_batched_tokens=64, num_kv_blocks=64))
    res = lab.run_experiment(p, num_requests=3, prompt_tokens=24, output_tokens=4, live=False,
                             max_num_seqs=2)
    assert len(res.requests) == 3 and res.requests.success.all()
    assert res.settings["max_num_seqs"] == 2 and res.settings["max_num_batched_tokens"] == 64
    with pytest.raises(ValueError, match="cannot be set over HTTP"):
        lab.run_experiment(p, base_url="http://127.0.0.1:9", max_num_seqs=4)

    pytest.importorskip("ipywidgets")
    calls = []

    def run(preset, **kw):
        calls.append(kw)
        return lab.run_experiment(preset, live=False, **kw)
    panel = lab.control_panel(run, preset=p, engine_args={"enable_prefix_caching": False},
                              num_requests=2, prompt_tokens=16, output_tokens=3)
    assert panel.values()["num_requests"] == 2 and math.isinf(panel.values()["request_rate"])
    button = [c for c in panel.widget.children if getattr(c, "description", "") == "Run"][0]
    button.click()
    assert len(calls) == 1 and calls[0]["prompt_tokens"] == 16
    assert calls[0]["enable_prefix_caching"] is False
    assert len(panel.results) == 1 and len(panel.results[0].requests) == 2
    remote = lab.control_panel(run, preset=p, base_url="http://127.0.0.1:9")
    assert "max_num_seqs" not in remote.values() and remote.values()["base_url"] == "http://127.0.0.1:9"
    lab.release_engine()


def test_panel_sliders_show_the_engines_real_values():
    """Lab 03's slider showed 32 KV blocks for an engine with 28, lab 07's "max_num_seqs
    (server's) 16" for a 4-seat server: the sliders must show what the engine really has."""
    import ipywidgets as w
    p = Preset(name="quick", model="tiny-llama")
    llm = lab.engine_for(p, max_num_seqs=3, kv_cache_memory=28 * 16 * 512)  # 28 blocks of 16 tokens
    blocks = llm.llm_engine.kv.pool.num_blocks
    panel = lab.control_panel(preset=p, engine=llm, num_kv_blocks=32, prompt_tokens=16)
    values = {c.description: c.value for c in panel.widget.children if isinstance(c, w.IntSlider)}
    assert values["KV budget (blocks)"] == blocks != 32 and values["max_num_seqs"] == 3
    assert values["prompt tokens"] == 16
    served = lab.control_panel(preset=p, engine=llm, base_url="http://127.0.0.1:9")
    shown = {c.description: (c.value, c.disabled) for c in served.widget.children
             if isinstance(c, w.IntSlider)}
    assert shown["max_num_seqs (server's)"] == (3, True)
    unknown = lab.control_panel(preset=p, base_url="http://127.0.0.1:9")   # nothing answers there
    notes = [c.value for c in unknown.widget.children if isinstance(c, w.HTML)]
    assert sum("set by the server" in n for n in notes) == 3
    lab.release_engine()


def test_baseline_round_trip(tmp_path, capsys):
    p = Preset(name="quick", model="tiny-llama")
    path = lab.record_baseline("01", {"ttft_ms": 12.5, "nan": float("nan"), "nested": {"a": 1}},
                               directory=tmp_path, preset=p)
    assert path == tmp_path / "01.json"
    doc = json.loads(path.read_text())
    assert doc["numbers"] == {"ttft_ms": 12.5, "nan": None, "nested": {"a": 1}}
    assert doc["preset"] == "quick" and doc["model"] == "tiny-llama"
    back = lab.load_baseline("01", directory=tmp_path)
    assert back["ttft_ms"] == 12.5 and back["_context"]["lab"] == "01"
    assert lab.load_baseline("99", directory=tmp_path) is None
    assert "run that lab first" in capsys.readouterr().out
