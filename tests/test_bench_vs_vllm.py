"""benchmarks/bench_vs_vllm.py's bookkeeping (its timings are benchmarks, not tests): which rows its
ratios compare, so a summary line never credits minserve with a format that fails the gate."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_vs_vllm import ENGINES, GATE_FAILS, MATCHED, METRICS, markdown, ratios  # noqa: E402
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
