"""minserve.eval: metrics, shipped data, the gate and its CLI, and the lm-eval adapter (tiny-llama)."""

import math

import pytest
import torch
import yaml

from minserve import LLM
from minserve.eval import data, gate, metrics
from minserve.eval.cli import main as eval_main
from minserve.models.loader import _smollm2_tokenizer_dir
from minserve.models.tiny import write_tiny_model
from reference import hf_model

FAST = ["--model", "tiny-llama", "--max-texts", "2", "--max-questions", "3",
        "--agreement-lengths", "8", "--agreement-tokens", "4", "--kv-cache-memory", "16MiB"]


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-llama", max_num_batched_tokens=64, num_kv_blocks=256)


@pytest.fixture(scope="module")
def texts():
    return data.load_texts()[:3]


def hf_token_logprobs(llm, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(str(llm.llm_engine.config_path))(torch.tensor([seq])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_shipped_data_and_lm_eval_task_files_agree():
    texts, questions = data.load_texts(), data.load_questions()
    assert len(texts) >= 20 and len(questions) >= 50
    assert len({q.question for q in questions}) == len(questions)
    assert all(q.answers and all(data.normalize_answer(a) for a in q.answers) for q in questions)
    cfg = yaml.safe_load((data.default_data_dir() / "tasks" / "minserve_questions.yaml").read_text())
    assert tuple(cfg["metric_list"][0]["regexes_to_ignore"]) == data.ANSWER_IGNORE
    assert cfg["generation_kwargs"]["until"] == [data.ANSWER_STOP]
    assert cfg["generation_kwargs"]["max_gen_toks"] == data.ANSWER_MAX_TOKENS


def test_exact_match_parsing():
    ok = data.is_correct
    assert ok(" Paris", ("Paris",)) and ok("paris.", ("Paris",)) and ok("PARIS!", ("Paris",))
    assert ok(" the Pacific Ocean", ("Pacific", "Pacific Ocean")) and ok(" 4", ("4", "four"))
    assert ok(" Four", ("4", "four")) and ok(" H2O\nQuestion: next", ("H2O",))
    assert not ok(" Lyon", ("Paris",)) and not ok(" 44", ("4",)) and not ok("", ("4",))
    assert not ok(" Paris is the capital", ("Paris",))  # exact, not "contains"


def test_perplexity_is_exp_mean_nll_of_the_reference(tiny, texts):
    ppl = metrics.perplexity(tiny, texts)
    seqs = metrics.scored_sequences(tiny.get_tokenizer(), texts)
    assert ppl.num_tokens == sum(len(s) - 1 for s in seqs) and math.isfinite(ppl.value)
    nll = -sum(hf_token_logprobs(tiny, s)[torch.arange(len(s) - 1), torch.tensor(s[1:])].sum().item() for s in seqs)
    assert ppl.nll_sum / ppl.num_tokens == pytest.approx(nll / ppl.num_tokens, abs=1e-4)
    assert ppl.value == pytest.approx(math.exp(nll / ppl.num_tokens), rel=1e-3)


def test_kl_of_a_model_with_itself_is_zero_and_with_another_matches_transformers(tiny, texts, tmp_path):
    assert metrics.mean_kl(tiny, tiny, texts) == 0.0
    other = LLM(str(write_tiny_model(tmp_path / "other", seed=12345, tokenizer_dir=_smollm2_tokenizer_dir())),
                num_kv_blocks=64)
    kl = metrics.mean_kl(tiny, other, texts[:1])
    assert kl == pytest.approx(metrics.mean_kl(tiny, other, texts[:1], chunk_rows=7), rel=1e-5)
    seq = metrics.scored_sequences(tiny.get_tokenizer(), texts[:1])[0]
    p, q = hf_token_logprobs(tiny, seq), hf_token_logprobs(other, seq)
    assert kl > 0 and kl == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4)


def test_kl_sees_the_rows_kv_cache_format(tiny, texts):
    """The distributions the KL compares are the engine's own: with an int8 KV cache, each next
    token's log-probability is the one its prompt_logprobs report (the real paged cache, the real
    rounding), and the KL against the float32 cache is above 0 (a scratch cache in the model's
    dtype measured exactly 0 for every kv_cache_dtype row)."""
    kv8 = LLM("tiny-llama", max_num_batched_tokens=64, num_kv_blocks=256, kv_cache_dtype="int8")
    seq = metrics.scored_sequences(kv8.get_tokenizer(), texts[:1])[0]
    full = torch.cat(list(metrics.next_token_logprobs(kv8, seq)))
    picked = full[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    (served,) = metrics.token_logprobs(kv8, [seq])
    torch.testing.assert_close(picked, torch.tensor(served), rtol=0, atol=1e-4)
    assert metrics.mean_kl(tiny, kv8, texts[:1]) > 1e-7


def test_greedy_agreement(tiny, texts):
    agree = metrics.greedy_agreement([[1, 2, 3, 4], [1, 2, 3, 4]], [[1, 2, 9, 4], [1, 2, 3, 4]])
    assert agree.first_difference == [2, 4] and agree.num_identical == 1 and agree.mean_fraction == 0.75
    prompts = metrics.agreement_prompts(tiny.get_tokenizer(), texts, (8, 16))
    assert len(prompts) == 2 * len(texts)
    out = metrics.greedy_tokens(tiny, prompts, 6)
    self_agree = metrics.greedy_agreement(out, metrics.greedy_tokens(tiny, prompts, 6))
    assert self_agree.first_difference == [6] * len(prompts) and self_agree.mean_fraction == 1.0


def test_formats_and_thresholds():
    spec = gate.parse_format("int4:group_size=128:note=x")
    # a format's own settings go into quantization_config (the engine's argument), the rest stay
    assert (spec.quantization, spec.engine_args) == ("int4", {"note": "x", "quantization_config": {"group_size": 128}})
    assert gate.parse_format("fp32").is_reference and gate.parse_format("none").is_reference
    # true / false are booleans wherever they go: an engine argument or quantization_config
    spec = gate.parse_format("int4:fallback=TRUE:fused_decode=false")
    assert spec.engine_args == {"fused_decode": False, "quantization_config": {"fallback": True}}
    assert not gate.parse_format("fp32:kv_cache_dtype=int8").is_reference
    with pytest.raises(ValueError, match="key=value"):
        gate.parse_format("int4:128")
    assert gate.thresholds_for(gate.parse_format("int8")).max_ppl_increase == 0.01
    assert gate.thresholds_for(gate.parse_format("int4-new")) == gate.INT4  # unknown: the loosest line
    ref = gate.thresholds_for(gate.parse_format("fp32"), gate.Thresholds(max_ppl_increase=0, min_exact_match=0.5))
    assert ref == gate.Thresholds(min_exact_match=0.5)  # relative limits do not apply to the reference


def test_gate_checks_rows_against_the_reference():
    """A stand-in for a quantized row (its numbers made up): each documented limit bites."""
    def row(label, ppl, kl, right):
        return gate.FormatResult(gate.parse_format(label), 1, ppl, kl, metrics.Agreement([4, 2], 4),
                                 metrics.ExactMatch([""] * 100, [True] * right + [False] * (100 - right)))
    ref = row("fp32", 20.0, 0.0, 70)
    ok = row("int8", 20.19, 0.009, 67)
    assert gate.check(ok, ref, gate.thresholds_for(ok.spec)) == []
    bad = row("int8", 20.3, 0.02, 66)
    missed = gate.check(bad, ref, gate.thresholds_for(bad.spec))
    assert [w.split()[0] for w in missed] == ["perplexity", "mean", "exact"]
    assert gate.check(row("int4", 20.9, 0.04, 65), ref, gate.thresholds_for(gate.parse_format("int4"))) == []
    strict = gate.thresholds_for(ok.spec, gate.Thresholds(min_greedy_agreement=0.9))
    assert gate.check(ok, ref, strict) == ["greedy agreement 75.0% < 90.0%"]


def test_cli_table_and_exit_codes(capsys):
    assert eval_main(FAST + ["--quantization", "fp32"]) == 0
    table = capsys.readouterr().out
    assert "fp32 (ref)" in table and "pass" in table and "perplexity" in table
    # A random model answers nothing right: an absolute floor must fail the gate.
    assert eval_main(FAST + ["--quantization", "fp32", "--min-exact-match", "0.5"]) == 1
    assert "exact match 0.0% < 50.0%" in capsys.readouterr().out
    assert eval_main(FAST + ["--quantization", "fp32,int8:bogus_engine_arg=1"]) == 1
    assert "not evaluated" in capsys.readouterr().out
    assert eval_main(["--data-dir", "/nonexistent"]) == 2


def test_quantized_row_when_the_engine_has_it():
    try:
        LLM("tiny-llama", num_kv_blocks=16, quantization="int8")
    except ValueError as e:
        pytest.skip(f"quantization= is not available in this engine yet: {e}")
    rows = gate.run_gate("tiny-llama", [gate.parse_format("fp32"), gate.parse_format("int8")],
                         gate.EvalData(data.load_texts()[:1], data.load_questions()[:2], (8,), 4),
                         {"num_kv_blocks": 64})
    assert rows[1].error is None and rows[1].weight_bytes < rows[0].weight_bytes
    assert rows[1].mean_kl > 0 and math.isfinite(rows[1].perplexity)


def test_a_rows_engine_arguments_override_the_shared_ones():
    """`fp32:max_num_seqs=8` beside the CLI's own max_num_seqs: the row's value, not a TypeError."""
    rows = gate.run_gate("tiny-llama", [gate.parse_format("fp32"), gate.parse_format("fp32:num_kv_blocks=32")],
                         gate.EvalData(data.load_texts()[:1], data.load_questions()[:2], (8,), 4),
                         {"num_kv_blocks": 64})
    assert rows[1].error is None and math.isfinite(rows[1].perplexity)


def test_lm_eval_adapter(tiny, texts):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from minserve.eval.lm_eval_adapter import MinserveLM
    lm = MinserveLM(llm=tiny)
    tok = tiny.get_tokenizer()
    pairs = [("The capital of France is", " Paris"), ("Water boils at", " one hundred degrees")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    for (ctx, cont), (lp, greedy) in zip(pairs, got):
        ids, n_ctx = tok(ctx + cont).input_ids, len(tok(ctx).input_ids)
        ref = hf_token_logprobs(tiny, ids)[torch.arange(n_ctx - 1, len(ids) - 1)]
        targets = torch.tensor(ids[n_ctx:])
        assert lp == pytest.approx(ref.gather(1, targets[:, None]).sum().item(), abs=1e-3)
        assert greedy == bool((ref.argmax(-1) == targets).all())
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    assert -sum(rolling) == pytest.approx(metrics.perplexity(tiny, texts).nll_sum, rel=1e-5)
    lm.max_length = 32  # several windows per text now: still every token scored once
    assert all(math.isfinite(x) for x in lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (texts[0],), 0)]))


def test_lm_eval_runs_the_shipped_tasks_offline_as_our_metrics_do(tiny):
    lm_eval = pytest.importorskip("lm_eval")
    from minserve.eval.lm_eval_adapter import MinserveLM, shipped_tasks, task_manager
    tasks = shipped_tasks()
    out = lm_eval.simple_evaluate(model=MinserveLM(llm=tiny), tasks=tasks, limit=3, task_manager=task_manager(),
                                  bootstrap_iters=0, log_samples=True)
    questions = data.load_questions()[:3]
    samples = out["samples"]["minserve_questions"]
    assert [s["arguments"][0][0] for s in samples] == [q.prompt for q in questions]  # the same prompt
    ours = metrics.exact_match(tiny, questions)
    assert [s["filtered_resps"][0] for s in samples] == ours.predictions
    assert out["results"]["minserve_questions"]["exact_match,none"] == ours.accuracy
    assert math.isfinite(out["results"]["minserve_prose"]["word_perplexity,none"])


def test_our_answer_normalization_is_lm_evals_exact_match():
    pytest.importorskip("lm_eval")
    from lm_eval.api.metrics import exact_match_hf_evaluate
    cfg = yaml.safe_load((data.default_data_dir() / "tasks" / "minserve_questions.yaml").read_text())
    options = ("regexes_to_ignore", "ignore_case", "ignore_punctuation")
    kw = {k: v for k, v in cfg["metric_list"][0].items() if k in options}
    cases = [(" Paris", "Paris"), ("paris.", "Paris"), (" the Pacific Ocean", "Pacific Ocean"), (" Four", "four"),
             (" 44", "4"), (" Paris is the capital", "Paris"), (" H-2-O", "H2O"), (" An apple", "apple")]
    for pred, gold in cases:
        theirs = exact_match_hf_evaluate(predictions=[pred], references=[gold], **kw)["exact_match"]
        assert bool(theirs) == data.is_correct(pred, (gold,)), (pred, gold)
