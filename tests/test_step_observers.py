"""Step observers (engine/observers.py): every scheduled batch, KV block event and kept token is
seen, the logits of opted-in requests are captured (bounded), and nothing is built without one."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.engine import observers as obs_module
from minserve.engine.observers import LogitsRecorder, StepObserver
from minserve.engine.parallel_sampling import sample_request_id
from conftest import assert_all_blocks_free


class Log(StepObserver):
    """Replays the block events into per-request tables and checks them against the engine's
    own after every step; keeps the batches and the tokens."""

    def __init__(self, engine):
        self.engine, self.batches, self.tokens, self.evictions = engine, [], {}, 0
        self.tables: dict[str, Counter] = {}
        self.kv_kinds = Counter()

    def on_schedule(self, batch):
        self.batches.append(batch)

    def on_kv_event(self, e):
        self.kv_kinds[e.kind] += 1
        if e.kind == "evict":
            self.evictions += 1
            return
        table = self.tables.setdefault(e.request_id, Counter())
        if e.kind == "allocate":
            table.update(e.block_ids + e.reused_block_ids)
        else:
            table.subtract(e.block_ids)

    def on_step_end(self, result):
        for rid, toks in result.tokens.items():
            self.tokens.setdefault(rid, []).extend(toks)
        live = {rid: Counter(t) for rid, t in self.engine.kv.block_tables.items()}
        replayed = {rid: +c for rid, c in self.tables.items() if +c}
        assert replayed == live, f"step {result.step}"


@pytest.fixture(scope="module")
def llm():
    # A small pool, so the workload below preempts and evicts cached blocks.
    return LLM("tiny-llama", max_num_seqs=6, max_num_batched_tokens=48, block_size=8, num_kv_blocks=24)


def _run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


PROMPTS = [list(range(300, 340)), list(range(300, 330)) + [9] * 5, list(range(900, 960)), [5, 6, 7]]


def test_batches_blocks_and_tokens_are_all_seen(llm):
    eng = llm.llm_engine
    log = Log(eng)
    first = eng.num_steps
    eng.add_step_observer(log)
    try:
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + [
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20, ignore_eos=True)]
        outs = _run(llm, PROMPTS, params)
    finally:
        eng.remove_step_observer(log)
    stats = [s for s in eng.step_stats if s.step >= first and s.num_prefill_tokens + s.num_decode_tokens]
    assert [b.step for b in log.batches] == [s.step for s in stats]
    assert [(b.num_prefill_tokens, b.num_decode_tokens) for b in log.batches] == [
        (s.num_prefill_tokens, s.num_decode_tokens) for s in stats]
    assert [tuple((r.request_id, r.context_len, r.num_new_tokens) for r in b.requests if r.is_prefill)
            for b in log.batches] == [s.prefill_chunks for s in stats]
    preempted = sum(len(b.preempted) for b in log.batches)
    assert preempted == sum(s.num_preemptions for s in stats) > 0
    assert log.evictions == 0 or log.kv_kinds["evict"] == log.evictions
    for o in outs:  # every kept token was reported, in order (both samples of the n=2 request)
        for c in o.outputs:
            rid = sample_request_id(o.request_id, c.index)
            assert log.tokens[rid] == c.token_ids
    assert log.kv_kinds["allocate"] and log.kv_kinds["free"]
    assert not any(+c for c in log.tables.values())  # every block given back
    assert_all_blocks_free(llm)


def test_evictions_are_reported(llm):
    eng = llm.llm_engine
    log = Log(eng)
    before = eng.kv.pool.num_evictions
    eng.add_step_observer(log)
    try:
        for i in range(4):  # distinct prompts through a small pool: cached blocks get evicted
            _run(llm, [list(range(1000 + 100 * i, 1060 + 100 * i))], SamplingParams(temperature=0, max_tokens=4))
    finally:
        eng.remove_step_observer(log)
    assert log.evictions == eng.kv.pool.num_evictions - before > 0


def test_logits_capture_is_opt_in_fp32_and_bounded(llm):
    eng = llm.llm_engine
    rec = LogitsRecorder({"want"}, max_rows=3)
    eng.add_step_observer(rec)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        for rid, p in (("want", [11, 12, 13]), ("other", [14, 15])):
            eng.add_request(rid, {"prompt_token_ids": p}, greedy)
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
    finally:
        eng.remove_step_observer(rec)
    assert set(rec.rows) == {"want"} and len(rec.rows["want"]) == 3 and rec.dropped == {"want": 2}
    rows = torch.stack(rec.rows["want"])
    assert rows.dtype == torch.float32 and rows.shape == (3, eng.model_config.vocab_size)
    assert rows.argmax(dim=-1).tolist() == done["want"].outputs[0].token_ids[:3]  # the rows it sampled from


def test_no_observer_builds_nothing(monkeypatch, llm):
    eng = llm.llm_engine
    built = Counter()
    for name in ("ScheduledBatch", "ScheduledRequestInfo", "KVEvent", "StepResult"):
        real = getattr(obs_module, name)
        monkeypatch.setattr(obs_module, name, lambda *a, _real=real, _n=name, **k: built.update([_n]) or _real(*a, **k))
    assert eng._observers is None and eng.kv.events is None and eng.runner.logits_tap is None
    _run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))
    assert not built
    watcher = StepObserver()
    eng.add_step_observer(watcher)
    _run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))
    eng.remove_step_observer(watcher)
    assert built["ScheduledBatch"] and built["KVEvent"] and built["StepResult"]
    assert eng._observers is None and eng.kv.events is None and eng.kv.pool.on_evict is None
    with pytest.raises(ValueError, match="observer must be a StepObserver"):
        eng.add_step_observer(object())
