"""benchmarks/bench_vs_vllm.py's bookkeeping (its timings are benchmarks, not tests): which rows its
ratios compare, so a summary line never credits minserve with a format that fails the gate."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_vs_vllm import ENGINES, GATE_FAILS, KV8_GATE_PASSES, MATCHED, METRICS, markdown, passes_gate, ratios  # noqa: E402
from host_phase import busy_cores, phase_notes, probe_line, wait_until_quiet  # noqa: E402


def _row(x: float) -> dict:
    return dict.fromkeys(METRICS, x)


def test_best_minserve_skips_formats_that_fail_the_gate():
    engines = {"minserve-fp32": _row(2.0), "minserve-int8": _row(9.0), "minserve-int4-a8": _row(3.0),
               "vllm-fp32": _row(1.0), "vllm-bf16": _row(1.5)}
    out = ratios(engines)
    assert out["minserve-fp32 / vllm-fp32"] == _row(2.0)
    assert out["best minserve / best vLLM"] == pytest.approx(_row(2.0))   # W4A8's 3.0 over vLLM bf16's 1.5
    assert "minserve-bf16 / vllm-bf16" not in out


def test_gate_failures_name_real_engines():
    assert set(GATE_FAILS) <= set(ENGINES)
    assert {"minserve-int4-a8", "minserve-int8-a8"} <= set(ENGINES)
    assert {n.removesuffix("-kv8") for n in KV8_GATE_PASSES} <= set(ENGINES)


def test_an_int8_kv_row_counts_only_where_it_passed_the_gate_itself():
    assert passes_gate("minserve-int4-a8") and passes_gate("minserve-int4-a8-kv8")
    assert passes_gate("minserve-fp32") and not passes_gate("minserve-fp32-kv8")   # not measured: no credit
    assert not passes_gate("minserve-int8-a8") and not passes_gate("minserve-int8-a8-kv8")
    engines = {"minserve-bf16": _row(2.0), "minserve-fp32-kv8": _row(9.0), "minserve-int4-a8-kv8": _row(3.0),
               "vllm-bf16": _row(1.0)}
    assert ratios(engines)["best minserve / best vLLM"] == pytest.approx(_row(3.0))


def test_kv8_rows_build_with_an_int8_cache(monkeypatch):
    from bench_vs_vllm import make_engine
    from roofline_share import row_format, row_kv_cache_dtype
    assert row_kv_cache_dtype("minserve-int4-a8-kv8") == "int8" and row_kv_cache_dtype("minserve-int4-a8") == "auto"
    assert row_kv_cache_dtype("vllm-bf16-kv8") == "fp8" and row_kv_cache_dtype("vllm-bf16") == "auto"
    assert row_format("minserve-int4-a8-kv8") == row_format("minserve-int4-a8")

    class Args:   # the fields MinserveEngine reads
        max_num_seqs, max_num_batched_tokens, max_model_len, kv_cache_gib, seed = 2, 64, 128, 0.01, 0
        temperature, top_p = 0.0, 1.0
    import minserve
    built = {}

    class FakeLLM:
        def __init__(self, model, **kw):
            built.update(kw)
    monkeypatch.setattr(minserve, "LLM", FakeLLM)
    e = make_engine("minserve-int4-a8-kv8", Args, None, None)
    assert built["kv_cache_dtype"] == "int8" and built["quantization"] == "int4"
    assert built["quantization_config"] == {"activations": "int8"} and e.info["kv_cache_dtype"] == "int8"


def test_step_kinds_account_for_every_prompt_token_and_decode_row():
    """The mixed workload's profile by kind of step (benchmarks/step_kinds.py): with no prefix
    cache and no preemption, its prompt tokens are the prompts' and its decode rows are every
    output token but each request's first (which its last prefill chunk samples). A 32-token step
    budget chunks the prompts, so some steps carry chunks and decode rows together."""
    from minserve import LLM, SamplingParams
    from step_kinds import StepKinds
    tiny_llm = LLM("tiny-llama", max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64,
                   enable_prefix_caching=False)
    prompts = [[5 + i] * n for i, n in enumerate((40, 7, 90, 12, 3))]
    outs = [6, 1, 9, 4, 12]
    kinds = StepKinds()
    tiny_llm.llm_engine.add_step_observer(kinds)
    try:
        tiny_llm.generate([{"prompt_token_ids": p} for p in prompts],
                          [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs],
                          use_tqdm=False)
    finally:
        tiny_llm.llm_engine.remove_step_observer(kinds)
    s = kinds.summary()
    assert sum(k["prompt_tokens"] for k in s.values()) == sum(map(len, prompts))
    assert sum(k["decode_rows"] for k in s.values()) == sum(outs) - len(outs)
    assert s["prefill"]["decode_rows"] == 0 and s["decode"]["prompt_tokens"] == 0
    assert s["prefill"]["steps"] >= 1 and s["mixed"]["steps"] >= 1 and s["decode"]["steps"] >= 1
    assert sum(k["share"] for k in s.values()) == pytest.approx(1.0)
    assert all(k["seconds"] > 0 for k in s.values() if k["steps"])
    assert "| decode |" in kinds.table()


def test_the_probe_line_names_each_rate_and_leaves_out_missing_tiles():
    assert probe_line({"fma_1t": 118.4, "fma": 232.6, "tiles": 4741.2}) == (
        "host: FMA 118 one thread, 233 all, AMX tiles 4,741 GFLOP/s")
    assert probe_line({"fma_1t": 60.0, "fma": 119.0, "tiles": None}) == "host: FMA 60 one thread, 119 all GFLOP/s"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_a_busy_core_is_seen_and_waited_out_up_to_the_limit():
    """A process spinning on a core: busy_cores counts it, and wait_until_quiet waits its whole
    limit for a machine that never goes quiet (the limit keeps a benchmark from hanging)."""
    import subprocess
    import time
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 4: pass"])
    try:
        time.sleep(0.3)
        assert busy_cores(0.5) >= 0.7
        assert wait_until_quiet(max_wait_s=1.0, window_s=0.25) >= 0.95
    finally:
        spin.kill()
        spin.wait()


def _probe(fma: float, tiles: float | None) -> dict:
    return {"fma_1t": fma / 2, "fma": fma, "tiles": tiles}


def test_a_pair_whose_rounds_ran_in_different_phases_gets_a_note_naming_the_favoured_side():
    # Run G's bf16 pair: minserve's rounds with the tiles fast, vLLM's slow; fp32 in one phase.
    probes = {"minserve-bf16": [_probe(346, 4956), _probe(356, 4758)],
              "vllm-bf16": [_probe(307, 2098), _probe(266, 1728)],
              "minserve-fp32": [_probe(363, 4811), _probe(322, 1872)],
              "vllm-fp32": [_probe(362, 4803), _probe(359, 4692)]}
    notes = phase_notes(probes, MATCHED)
    assert len(notes) == 1 and notes[0].startswith("minserve-bf16 against vllm-bf16: the AMX tile loop")
    assert "4,857" in notes[0] and "1,913" in notes[0] and notes[0].endswith("lean toward minserve-bf16")
    # The same gap the other way names vLLM; no tile reading falls back to FMA; a lone side is skipped.
    swapped = {"minserve-bf16": probes["vllm-bf16"], "vllm-bf16": probes["minserve-bf16"]}
    assert phase_notes(swapped, MATCHED)[0].endswith("lean toward vllm-bf16")
    no_tiles = {"minserve-bf16": [_probe(350, None)], "vllm-bf16": [_probe(200, None)]}
    assert "fp32 FMA on every thread probed a median 350" in phase_notes(no_tiles, MATCHED)[0]
    assert phase_notes({"minserve-fp32": probes["minserve-fp32"]}, MATCHED) == []


def test_the_phase_notes_print_under_the_ratios():
    res = {"args": {"max_num_seqs": 16, "prefill_len": 1024},
           "engines": {"minserve-bf16": _row(2.0), "vllm-bf16": _row(1.0)},
           "ratios": {"minserve-bf16 / vllm-bf16": _row(2.0)}, "phase_notes": ["a note"]}
    assert markdown(res).endswith("| minserve-bf16 / vllm-bf16 | 2.00 | 2.00 | 2.00 | 2.00 |\n\nNote: a note.")


def test_a_sampled_run_says_so_above_its_table_and_a_greedy_one_does_not():
    res = {"args": {"max_num_seqs": 16, "prefill_len": 1024, "temperature": 0.8, "top_p": 0.95},
           "engines": {"minserve-bf16": _row(2.0)}}
    assert markdown(res).startswith("Sampled: temperature 0.8, top_p 0.95.\n\n| |")
    res["args"]["temperature"] = 0.0
    assert markdown(res).startswith("| | mixed")
    from bench_vs_vllm import parse_args
    a = parse_args(["--temperature", "0.8", "--top-p", "0.9", "--quick"])
    assert (a.temperature, a.top_p) == (0.8, 0.9)
    assert parse_args([]).temperature == 0.0


def _shares(engines, bf16_dot=None, seqs=16, prefill_len=128, decode_tokens=32):
    from argparse import Namespace

    from minserve.models.registry import ModelConfig
    from minserve.models.tiny import TINY_CONFIG
    from roofline_share import shares
    args = Namespace(max_num_seqs=seqs, prefill_len=prefill_len, decode_tokens=decode_tokens)
    return shares(engines, ModelConfig.from_hf(TINY_CONFIG), args, bandwidth_gbs=20.0, bf16_dot=bf16_dot)


def test_each_rows_share_is_its_roofline_time_over_its_measured_time():
    """A row measured at exactly twice each step's roofline time reads 50 %, whichever ceiling
    bounds the step; the roofline is the planner's, with the row's own probed arithmetic."""
    from minserve.engine.kv_sizing import kv_cache_bytes_per_token
    from minserve.models.registry import ModelConfig
    from minserve.models.tiny import TINY_CONFIG
    from minserve.plan import budget
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    probes = [{"fma": 100.0, "tiles": 3000.0}, {"fma": 300.0, "tiles": 1000.0}, {"fma": 200.0, "tiles": None}]
    rows = {}
    for name, dtype, precision, rate in (("minserve-fp32", "float32", "fp32", 200e9),
                                         ("vllm-bf16", "bfloat16", "bf16", 2000e9)):
        w = budget.weight_bytes(cfg, precision, dtype).per_step
        kv = kv_cache_bytes_per_token(cfg, "auto", dtype)
        pre = budget.prefill(cfg, w, kv, 128, 20e9, rate).seconds
        d16 = budget.decode_step(cfg, w, kv, 16, 32 + 16, 20e9, rate).seconds
        d1 = budget.decode_step(cfg, w, kv, 1, 32 + 16, 20e9, rate).seconds
        rows[name] = {"prefill_tok_s": 128 / (2 * pre), "decode16_tok_s": 16 / (2 * d16),
                      "decode_tok_s": 1 / (2 * d1), "host_probe_runs": probes}
    out = _shares(rows)
    for name in rows:
        for step in ("prefill", "decode_batch", "decode_1"):
            assert out[name][f"{step}_pct"] == pytest.approx(50.0), (name, step)
    # fp32 is held to the median FMA reading (200), bf16 to the median tile reading (2000)
    assert out["minserve-fp32"]["ceiling_gflops"] == 200.0
    assert out["vllm-bf16"]["ceiling_gflops"] == 2000.0


def test_the_ceiling_a_row_is_held_to_follows_its_format():
    row = {"prefill_tok_s": 100.0, "decode16_tok_s": 100.0, "decode_tok_s": 10.0,
           "host_probe_runs": [{"fma": 150.0, "tiles": None}]}
    out = _shares({"minserve-bf16": row, "minserve-int4": row, "minserve-int4-a8": row}, bf16_dot=300.0)
    assert out["minserve-bf16"]["ceiling_gflops"] == 300.0    # no tiles here: the bf16 dot rate
    assert out["minserve-int4"]["ceiling_gflops"] == 300.0    # its prefill tiles multiply in bf16
    a8 = out["minserve-int4-a8"]                               # integer dots are not probed: bytes only
    assert a8["ceiling_gflops"] is None and set(k for k in a8 if k.endswith("_pct")) == {"decode_1_pct"}
    assert _shares({"minserve-bf16": row})["minserve-bf16"]["ceiling_gflops"] == 150.0   # nothing else
    # fp32 at "high": three tile products per float32 one; without tiles its products are exact (FMA)
    tiled = {**row, "host_probe_runs": [{"fma": 150.0, "tiles": 3000.0}]}
    assert _shares({"minserve-fp32-high": tiled})["minserve-fp32-high"]["ceiling_gflops"] == 1000.0
    assert _shares({"minserve-fp32-high": row})["minserve-fp32-high"]["ceiling_gflops"] == 150.0


def test_the_shares_table_prints_under_the_ratios_with_its_bounds():
    from roofline_share import markdown as shares_table
    row = {"prefill_tok_s": 100.0, "decode16_tok_s": 100.0, "decode_tok_s": 10.0,
           "host_probe_runs": [{"fma": 150.0, "tiles": 2000.0}]}
    shares = _shares({"minserve-fp32": row, "minserve-int8-a8": row})
    res = {"args": {"max_num_seqs": 16, "prefill_len": 128},
           "engines": {"minserve-fp32": _row(2.0)}, "ceiling_shares": shares}
    text = markdown(res)
    assert text.endswith(shares_table(shares, 16))
    lines = shares_table(shares, 16).splitlines()
    fp32 = next(ln for ln in lines if ln.startswith("| minserve fp32 |"))
    assert fp32.count("(memory)") + fp32.count("(compute)") == 3 and fp32.endswith("| 150 |")
    assert next(ln for ln in lines if ln.startswith("| minserve int8 a8 |")).startswith("| minserve int8 a8 | - | - |")
    assert "20.0 GB/s" in lines[-1]


def test_a_share_over_the_roofline_is_explained_not_hidden():
    from roofline_share import markdown as shares_table
    slow = {"prefill_tok_s": 100.0, "decode16_tok_s": 100.0, "decode_tok_s": 10.0,
            "host_probe_runs": [{"fma": 150.0, "tiles": None}]}
    fast = {**slow, "decode_tok_s": 1e9}   # far beyond what the bytes allow
    assert "Over 100 %" not in shares_table(_shares({"minserve-fp32": slow}), 16)
    text = shares_table(_shares({"minserve-fp32": fast}), 16)
    assert "Over 100 %" in text and "| minserve fp32 |" in text
