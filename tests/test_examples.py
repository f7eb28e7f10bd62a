"""The side experiments in examples/ run in their quick mode and show what they claim; the engine
seams they use (eviction policy, layer attention) hold their contracts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.eviction import LRUEviction
from minserve.engine.scheduling_policy import unregister_scheduling_policy
from conftest import assert_all_blocks_free

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_docstring_a_quick_mode_and_a_test():
    scripts = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    assert scripts == ["attention_sinks", "ban_tokens", "kv_eviction_policy", "shortest_job_first"]
    for name in scripts:
        text = (EXAMPLES / f"{name}.py").read_text()
        assert text.startswith('"""') and "--quick" in text and len(text.splitlines()) <= 120, name
        assert f"def test_{name}" in Path(__file__).read_text(), name


def test_kv_eviction_policy(capsys):
    res = example("kv_eviction_policy").main(quick=True)
    out = capsys.readouterr().out
    assert "lru   prefix-cache hit rate" in out and "slru  prefix-cache hit rate" in out
    lru, slru = res["lru"], res["slru"]
    # The bursts of documents flush the manual under LRU; SLRU keeps it for most agent turns.
    assert slru["agent_hit_rate"] > 0.5 > 0.2 > lru["agent_hit_rate"]
    assert slru["hit_rate"] > lru["hit_rate"] and lru["evictions"] > 0 and slru["evictions"] > 0


def test_ban_tokens(capsys):
    res = example("ban_tokens").main(quick=True)
    assert res["banned"] and res["avoided"] and res["other_unchanged"]
    assert res["with_ban"][0] != res["plain"][0] and not set(res["with_ban"][0]) & set(res["banned"])
    assert "prompt 0 avoided every banned token: True; prompt 1 unchanged: True" in capsys.readouterr().out


def test_ban_tokens_runs_as_a_script():
    r = subprocess.run([sys.executable, str(EXAMPLES / "ban_tokens.py"), "--quick"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "MINSERVE_LOG_LEVEL": "WARNING"})
    assert r.returncode == 0, r.stderr
    assert "prompt 1 unchanged: True" in r.stdout


def test_shortest_job_first(capsys):
    try:
        res = example("shortest_job_first").main(quick=True)
    finally:
        unregister_scheduling_policy("sjf")
    fcfs, sjf = res["fcfs"], res["sjf"]
    # Steps do not depend on the machine: SJF cuts mean TTFT and E2E, above all for short answers,
    # and the long answers pay for it in the tail.
    assert sjf["ttft_all"]["mean_steps"] < fcfs["ttft_all"]["mean_steps"]
    assert sjf["e2e_all"]["mean_steps"] < fcfs["e2e_all"]["mean_steps"]
    assert sjf["e2e_short"]["mean_steps"] < 0.5 * fcfs["e2e_short"]["mean_steps"]
    assert sjf["e2e_long"]["mean_steps"] > fcfs["e2e_long"]["mean_steps"]
    out = capsys.readouterr().out
    assert "e2e_short sjf" in out and "e2e_short fcfs" in out


def test_attention_sinks(capsys):
    res = example("attention_sinks").main(quick=True)
    full = res.pop("full attention")
    assert full["matched"] == len(full["tokens"]) == 24
    for name, r in res.items():  # the mask bites: other logprobs, another continuation
        assert abs(r["ppl"] - full["ppl"]) > 1e-3 * full["ppl"] and r["matched"] < 24, name
    assert "4 sinks + window 32" in capsys.readouterr().out


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_kv_blocks=64, max_num_batched_tokens=256)


def test_layer_attention_seam_is_exact_when_nothing_is_masked(llm):
    sinks = example("attention_sinks")
    ids = list(range(2000, 2100))
    own = sinks.measure(llm, ids, None, None, 16)
    runner, engine = llm.llm_engine.runner, llm.llm_engine
    assert runner.fused is not None
    everything = sinks.measure(llm, ids, 0, 10_000, 16)  # a window wider than the text
    assert runner.fused is None and runner.backends == [runner.layer_backend]
    assert engine.kv.model_fingerprint != engine.model_fingerprint  # no block crosses attentions
    assert everything["tokens"] == own["tokens"]
    assert everything["ppl"] == pytest.approx(own["ppl"], rel=1e-4)
    engine.add_request("busy", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="no unfinished requests"):
        engine.set_layer_attention(None)
    engine.abort_request("busy")
    engine.set_layer_attention(None)
    assert runner.fused is not None and engine.kv.model_fingerprint == engine.model_fingerprint
    assert_all_blocks_free(llm)


def test_eviction_policy_swap_keeps_the_waiting_blocks_in_order(llm):
    kv = llm.llm_engine.kv
    for start in (100, 300):  # two prompts of 3 full blocks each, cached and released
        llm.generate({"prompt_token_ids": list(range(start, start + 50))}, SamplingParams(max_tokens=1),
                     use_tqdm=False)
    waiting = list(kv.pool._free_cached)
    assert len(waiting) >= 6
    slru = example("kv_eviction_policy").SegmentedLRU()
    kv.set_eviction_policy(slru)
    assert list(slru) == waiting and slru.pool is kv.pool
    hit = llm.generate({"prompt_token_ids": list(range(100, 150))}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert hit[0].num_cached_tokens == 48 and slru.protected  # the hit blocks are protected now
    kv.set_eviction_policy(LRUEviction())
    assert_all_blocks_free(llm)
