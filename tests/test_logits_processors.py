"""Custom logits processors (engine/logits_processor.py): vLLM v1's batch-level interface, loaded
as a class, a qualified name or an entry point, fed per-request extra_args, applied on every path
that samples (PyTorch, mixed steps, the fused C step, speculative verification), free when unused.

The reference for "the processor was applied exactly" is the engine's own allowed_token_ids: a
processor banning a set of tokens must give the very tokens that allowing all the others gives.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from minserve import LLM, EngineConfig, SamplingParams
from minserve.engine import model_runner
from minserve.engine.logits_batch import ProcessorRow, RowSlots
from minserve.engine.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from conftest import assert_all_blocks_free

VOCAB = 49152
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256)


def rows_by_index(state: dict, update: BatchUpdate | None, value) -> None:
    """Apply a BatchUpdate to ``state`` (index -> value(params, output ids)) in vLLM's order."""
    if update is None:
        return
    for i in update.removed:
        state.pop(i, None)
    for i, params, _prompt, out in update.added:
        state[i] = value(params, out)
    for a, b, how in update.moved:
        if how is MoveDirectionality.SWAP:
            state[a], state[b] = state.get(b), state.get(a)
        else:
            state[b] = state.pop(a)


class BanTokens(LogitsProcessor):
    """Per request: extra_args["banned_token_ids"] are never sampled."""

    def __init__(self, config, device, is_pin_memory):
        self.banned: dict[int, list[int]] = {}

    @classmethod
    def validate_params(cls, sampling_params):
        ids = (sampling_params.extra_args or {}).get("banned_token_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < VOCAB for t in ids)):
            raise ValueError(f"extra_args['banned_token_ids'] must be a list of token ids, got {ids!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        rows_by_index(self.banned, batch_update, lambda p, _: (p.extra_args or {}).get("banned_token_ids"))

    def apply(self, logits):
        for i, ids in self.banned.items():
            if ids:
                logits[i, ids] = float("-inf")
        return logits


class ForceCycle(LogitsProcessor):
    """extra_args["cycle"] = [a, b, ...]: output position i is forced to cycle[i % len(cycle)].
    Reads each row's output length, so a verify row must see the proposals before it: one that
    saw the bare output would force row 0's token again and put it after the accepted ones."""

    def __init__(self, config, device, is_pin_memory):
        self.rows: dict[int, tuple[list[int] | None, list[int]]] = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        rows_by_index(self.rows, batch_update, lambda p, out: ((p.extra_args or {}).get("cycle"), out))

    def apply(self, logits):
        for i, (cycle, out) in self.rows.items():
            if cycle:
                logits[i] = float("-inf")
                logits[i, cycle[len(out) % len(cycle)]] = 0.0
        return logits


class Recorder(LogitsProcessor):
    """Argmax-invariant: counts its calls and keeps every BatchUpdate."""
    updates: list = []
    applies: list = []

    def __init__(self, config, device, is_pin_memory):
        self.config = config
        Recorder.updates, Recorder.applies = [], []

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        Recorder.updates.append(batch_update)

    def apply(self, logits):
        Recorder.applies.append(logits.shape[0])
        return logits


class BanAll(LogitsProcessor):
    def __init__(self, config, device, is_pin_memory):
        self.rows: dict[int, bool] = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        rows_by_index(self.rows, batch_update, lambda p, _: bool((p.extra_args or {}).get("ban_all")))

    def apply(self, logits):
        for i, on in self.rows.items():
            if on:
                logits[i] = float("-inf")
        return logits


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", logits_processors=[BanTokens, Recorder, BanAll], **ENGINE)


def _allowing_all_but(banned: list[int], **kw) -> SamplingParams:
    keep = sorted(set(range(VOCAB)) - set(banned))
    return SamplingParams(temperature=0, ignore_eos=True, allowed_token_ids=keep, **kw)


def _ids(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [list(range(100, 105)), list(range(2000, 2090)), list(range(700, 712))]  # 90: chunked


def test_ban_via_extra_args_equals_allowed_ids_on_fused_and_mixed_steps(llm):
    runner = llm.llm_engine.runner
    assert runner.fused is not None, "the default engine decodes in the fused C kernel"
    calls, decoder = [], runner.fused

    class Counted:  # the fused backend asks supports() and calls it
        supports = decoder.supports

        def __call__(self, *args):
            calls.append(1)
            return decoder(*args)

    runner.fused = Counted()
    try:
        greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12)
        base = _ids(llm, PROMPTS, greedy)
        banned = sorted(set(base[0][:6]))  # request 0's own favourite tokens
        params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=12,
                                 extra_args={"banned_token_ids": banned}), greedy, greedy]
        got = _ids(llm, PROMPTS, params)
        ref = _ids(llm, PROMPTS[:1], _allowing_all_but(banned, max_tokens=12))[0]
    finally:
        runner.fused = decoder
    assert calls, "decode steps ran in the fused C kernel"
    assert got[0] == ref and got[0] != base[0] and not set(got[0]) & set(banned)
    assert got[1:] == base[1:]  # the others in the same steps are untouched
    assert_all_blocks_free(llm)


def test_ban_on_the_pytorch_path_and_with_sampling():
    llm = LLM("tiny-llama", logits_processors=["test_logits_processors:BanTokens"], fused_decode=False, **ENGINE)
    assert llm.llm_engine.runner.fused is None
    seeded = dict(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    base = _ids(llm, PROMPTS[:1], SamplingParams(**seeded))[0]
    banned = sorted(set(base))
    got = _ids(llm, PROMPTS[:1], SamplingParams(**seeded, extra_args={"banned_token_ids": banned}))[0]
    keep = sorted(set(range(VOCAB)) - set(banned))
    ref = _ids(llm, PROMPTS[:1], SamplingParams(**seeded, allowed_token_ids=keep))[0]
    assert got == ref and not set(got) & set(banned)


def test_validate_params_refuses_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"^extra_args\['banned_token_ids'\] must be a list"):
        llm.generate("Hello", SamplingParams(extra_args={"banned_token_ids": "all"}), use_tqdm=False)
    with pytest.raises(ValueError, match="extra_args must be a dict with string keys"):
        SamplingParams(extra_args={1: 2})
    assert_all_blocks_free(llm)


def test_argmax_invariant_processor_is_skipped_when_every_row_is_greedy(llm):
    Recorder.updates.clear(), Recorder.applies.clear()
    _ids(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    sampling_steps = len(Recorder.updates)
    assert sampling_steps >= 4 and Recorder.applies == []
    _ids(llm, PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                            SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)])
    assert Recorder.applies and len(Recorder.updates) > sampling_steps
    first = next(u for u in Recorder.updates[sampling_steps:] if u is not None)
    assert {i for i, *_ in first.added} == set(range(first.batch_size))
    assert isinstance(llm.llm_engine.runner.logits_processors.processors[1].config, EngineConfig)


def test_a_row_left_with_nothing_fails_its_request_alone(llm):
    outs = llm.generate(["One", "Two"], [SamplingParams(max_tokens=3, extra_args={"ban_all": True}),
                                         SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "logits processors leave no token" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 3
    assert_all_blocks_free(llm)


def test_speculative_verification_applies_processors_at_each_position():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    kw = dict(logits_processors=[ForceCycle], **ENGINE)
    plain, fast = LLM("tiny-llama", **kw), LLM("tiny-llama", speculative_config=spec, **kw)
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, extra_args={"cycle": [7, 5, 6]})
    want = _ids(plain, prompt, params)[0]
    assert want == [7, 5, 6] * 8
    assert _ids(fast, prompt, params)[0] == want
    assert fast.llm_engine.snapshot()["vllm:spec_decode_num_accepted_tokens"] > 0


def test_no_processor_no_rows_and_no_copies(monkeypatch, tiny_llm):
    built = []
    real = model_runner.processor_rows
    monkeypatch.setattr(model_runner, "processor_rows", lambda *a: built.append(1) or real(*a))
    assert tiny_llm.llm_engine.runner.logits_processors is None
    tiny_llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert built == []


def test_row_slots_keep_indices_and_condense():
    slots, seen = RowSlots(), {}

    def step(keys):
        rows = [ProcessorRow(k, PARAMS[k[0]], [], OUT[k[0]]) for k in keys]
        update, order = slots.update(rows)
        rows_by_index(seen, update, lambda p, out: out)
        assert [seen[i] for i in range(len(keys))] == [rows[j].output_token_ids for j in order]
        return update, order

    PARAMS = {r: SamplingParams() for r in "abcd"}
    OUT = {r: [ord(r)] for r in "abcd"}
    u, order = step([("a", 0), ("b", 0), ("c", 0)])
    assert [i for i, *_ in u.added] == [0, 1, 2] and order == [0, 1, 2]
    assert step([("a", 0), ("b", 0), ("c", 0)]) == (None, [0, 1, 2])
    u, order = step([("b", 0), ("c", 0)])  # a finished: c moves into its slot
    assert u.removed == [0] and u.moved == [(2, 0, MoveDirectionality.UNIDIRECTIONAL)] and order == [1, 0]
    u, order = step([("c", 0), ("d", 0), ("b", 0)])
    assert [i for i, *_ in u.added] == [2] and not u.removed and order == [0, 2, 1]


def test_engine_config_resolves_names_and_the_cli_flag(tmp_path, monkeypatch):
    (tmp_path / "lp_plugin.py").write_text(textwrap.dedent("""
        from test_logits_processors import BanTokens
        class Plugged(BanTokens):
            pass
        class NotOne:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    EngineConfig(logits_processors=["lp_plugin:Plugged", "lp_plugin.Plugged", BanTokens])
    with pytest.raises(ValueError, match=r"logits_processors\[0\]: cannot import module 'no_such_mod'"):
        EngineConfig(logits_processors=["no_such_mod:X"])
    with pytest.raises(ValueError, match=r"logits_processors\[0\]: 'lp_plugin:NotOne' is not a subclass"):
        EngineConfig(logits_processors=["lp_plugin:NotOne"])
    from minserve.server.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["--logits-processors", "lp_plugin:Plugged", "a.b:C"])
    assert engine_kwargs(args)["logits_processors"] == ["lp_plugin:Plugged", "a.b:C"]


def test_entry_point_processors_load_in_every_engine(tmp_path, monkeypatch):
    (tmp_path / "lp_entry.py").write_text("from test_logits_processors import BanTokens as Entry\n")
    info = tmp_path / "lp_entry-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lp-entry\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[minserve.logits_processors]\nban = lp_entry:Entry\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    llm = LLM("tiny-llama", **ENGINE)
    assert [type(p).__name__ for p in llm.llm_engine.runner.logits_processors.processors] == ["BanTokens"]
    out = _ids(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, extra_args={"banned_token_ids": [1]}))
    assert 1 not in out[0]


def test_server_passes_vllm_xargs_as_extra_args():
    from inprocess_api import recorded_server
    with recorded_server("tiny-llama", logits_processors=[BanTokens], **ENGINE) as srv:
        body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
        r = srv.client.post("/v1/completions", json={**body, "vllm_xargs": {"banned_token_ids": [42]}})
        assert r.status_code == 200, r.text
        assert srv.seen[-1].params.extra_args == {"banned_token_ids": [42]}
        r = srv.client.post("/v1/completions", json={**body, "vllm_xargs": {"banned_token_ids": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_args", r.text


def test_processors_see_logits_as_float32_rows(llm):
    x = torch.zeros(2, VOCAB)
    procs = llm.llm_engine.runner.logits_processors
    procs.update([ProcessorRow(("x", 0), SamplingParams(extra_args={"banned_token_ids": [3]}), [], []),
                  ProcessorRow(("y", 0), SamplingParams(), [], [])])
    out = procs(x, [SamplingParams(temperature=0)] * 2)
    assert out[0, 3] == float("-inf") and out[1].isfinite().all() and x.isfinite().all()
    procs.update([])  # leave the engine's slots empty for the next test


def test_forked_samples_and_draft_verification_keep_the_ban():
    """n > 1: the samples forked off a request are rows of their own (their first token comes
    from the parent's last row); a sampled draft-model verification checks against the processed
    target distribution, so no banned token is ever accepted."""
    draft = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}
    for kw in ({}, {"speculative_config": draft}):
        llm = LLM("tiny-llama", logits_processors=[BanTokens], **ENGINE, **kw)
        free = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=12, ignore_eos=True)
        seen = sorted({t for c in llm.generate({"prompt_token_ids": PROMPTS[0]}, free, use_tqdm=False)[0].outputs
                       for t in c.token_ids})
        banned = seen[::2]
        ban = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=12, ignore_eos=True,
                             extra_args={"banned_token_ids": banned})
        outs = llm.generate({"prompt_token_ids": PROMPTS[0]}, ban, use_tqdm=False)[0].outputs
        assert len(outs) == 3 and all(len(c.token_ids) == 12 and not set(c.token_ids) & set(banned) for c in outs)
        assert_all_blocks_free(llm)
    assert llm.llm_engine.snapshot()["vllm:spec_decode_num_draft_tokens"] > 0
