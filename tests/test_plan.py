"""The serving-budget planner (minserve/plan): its bytes agree exactly with what the engine allocates
and loads, its roofline follows the stated formulas, and bad arguments are named."""

import json
import math

import pytest

from minserve import LLM
from minserve.cli import main
from minserve.models.registry import ModelConfig
from minserve.models.tiny import TINY_CONFIG
from minserve.plan import DATASHEET, Hardware, get_hardware, known_hardware, plan, plans_frame, weight_bytes
from minserve.plan import probe
from minserve.plan.budget import block_matrices
from minserve.plan.planner import model_config

TINY = ModelConfig.from_hf(TINY_CONFIG)
# Round numbers so expected times are easy to state: 1 GB/s, 1 GFLOP/s.
TOY_HW = Hardware("toy", 2**30, 1e9, 1e9, 1e9, "test")


def _unique_param_bytes(model) -> int:
    return sum({p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}.values())


@pytest.mark.parametrize("dtype, precision", [("float32", "fp32"), ("bfloat16", "bf16")])
def test_kv_blocks_and_weight_bytes_match_the_engine(dtype, precision):
    llm = LLM("tiny-llama", kv_cache_memory="3MiB", dtype=dtype, device="cpu")
    eng = llm.llm_engine
    p = plan("tiny-llama", hardware="h100", precision=precision, kv_cache_memory="3MiB")
    assert p.kv_bytes_per_token == eng.kv_spec.bytes_per_token
    assert p.num_kv_blocks == eng.kv_spec.num_blocks and p.kv_tokens == eng.kv_spec.max_tokens
    assert p.weight_bytes_per_step == eng.runner.weight_bytes()
    if dtype == "float32":  # (a bf16 engine casts the embedding and the LM head separately)
        assert p.weight_bytes == _unique_param_bytes(eng.runner.model)
        assert p.params * 4 == p.weight_bytes


def test_a_model_directory_with_biases_and_a_tied_head(tmp_path):
    """A Hugging Face directory (not an alias), Qwen2-style q/k/v biases, a tied LM head."""
    from minserve.models.loader import _smollm2_tokenizer_dir
    from minserve.models.tiny import write_tiny_model
    path = write_tiny_model(tmp_path / "q", 0, _smollm2_tokenizer_dir(),
                            {"architectures": ["Qwen2ForCausalLM"], "attention_bias": True,
                             "tie_word_embeddings": True})
    eng = LLM(str(path), num_kv_blocks=8, device="cpu").llm_engine
    p = plan(str(path), hardware="l4", precision="fp32", kv_cache_memory="1MiB")
    assert p.model == str(path)
    assert p.weight_bytes_per_step == eng.runner.weight_bytes() == p.weight_bytes
    assert p.weight_bytes == _unique_param_bytes(eng.runner.model)
    # In bf16 too the tied head stays one table (it used to be cast into a second copy).
    model = LLM(str(path), num_kv_blocks=8, device="cpu", dtype="bfloat16").llm_engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert _unique_param_bytes(model) == plan(str(path), hardware="l4", precision="bf16").weight_bytes


def test_max_num_seqs_is_what_the_block_pool_admits():
    """Fill the engine's own KV manager with sequences of context_len tokens until it refuses."""
    context_len = 100  # not a multiple of block_size: the last block of each sequence is partial
    llm = LLM("tiny-llama", kv_cache_memory="1MiB", device="cpu", enable_prefix_caching=False)
    kv = llm.llm_engine.kv
    p = plan(TINY, hardware=TOY_HW, context_len=context_len, kv_cache_memory="1MiB")
    admitted = 0
    while kv.allocate_slots(f"s{admitted}", context_len):
        admitted += 1
    assert admitted == p.max_num_seqs == p.num_kv_blocks // math.ceil(context_len / 16)
    for i in range(admitted):
        kv.free(f"s{i}")


@pytest.mark.slow
def test_smollm2_bytes_match_the_engine(smol_llm):
    eng = smol_llm.llm_engine  # fp32, kv_cache_memory="512MiB" (tests/conftest.py)
    p = plan("smollm2-135m", hardware="this", precision="fp32", kv_cache_memory="512MiB")
    assert p.kv_bytes_per_token == eng.kv_spec.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert p.num_kv_blocks == eng.kv_spec.num_blocks
    assert p.weight_bytes_per_step == eng.runner.weight_bytes()
    assert p.weight_bytes == _unique_param_bytes(eng.runner.model)  # tied head: embedding counted once


def test_quantized_weight_bytes_follow_the_formats():
    """minserve's layouts (minserve/quant/sizes.py): float32 scales (and int4 mins) whatever the
    activation dtype; the LM head quantized by default (the engine's policy), its table untied."""
    mats = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)] * 2  # tiny's matrices
    dense = sum(o * i for o, i in mats)
    norms = (2 * 2 + 1) * 64               # in the activation dtype
    table = 49152 * 64                     # the LM head, and the untied embedding
    w8 = weight_bytes(TINY, "int8")        # activations default to bfloat16
    assert (w8.block_weights, w8.lm_head) == (dense, table)
    assert w8.scales == (sum(o for o, _ in mats) + 49152) * 4
    assert (w8.other, w8.embedding) == (norms * 2, table * 2)
    kept = weight_bytes(TINY, "int8", lm_head="keep")
    assert (kept.lm_head, kept.scales) == (table * 2, sum(o for o, _ in mats) * 4)
    w4 = weight_bytes(TINY, "int4", group_size=32, lm_head="quantize")
    assert (w4.block_weights, w4.lm_head) == (dense // 2, table // 2)
    assert w4.scales == (sum(o * (i // 32) for o, i in mats) + 49152 * 2) * 2 * 4  # scale + min, 4 bytes each
    w4d = weight_bytes(TINY, "int4")  # the default head: int8
    assert (w4d.lm_head, w4d.scales) == (table, w4.scales - 49152 * 2 * 2 * 4 + 49152 * 4)
    # group 128 divides only the 128-wide down_proj: the others plan with 64 (the engine's fallback)
    assert weight_bytes(TINY, "int4", group_size=128).scales == weight_bytes(TINY, "int4", group_size=64).scales - \
        2 * 64 * 1 * 2 * 4
    w4f = weight_bytes(TINY, "int4", dtype="float32", group_size=64)
    assert w4f.scales == sum(o * (i // 64) for o, i in mats) * 2 * 4 + 49152 * 4 and w4f.other == norms * 4
    sizes = [weight_bytes(TINY, p).per_step for p in ("fp32", "bf16", "int8", "int4")]
    assert sizes == sorted(sizes, reverse=True)
    tied = ModelConfig.from_hf({**TINY_CONFIG, "tie_word_embeddings": True})
    assert weight_bytes(tied, "bf16").embedding == 0 and weight_bytes(tied, "bf16").lm_head == table * 2
    assert weight_bytes(tied, "int4").embedding == table * 2  # a quantized head unties the table
    assert weight_bytes(tied, "int4", lm_head="keep").embedding == 0


def test_roofline_formulas():
    ctx = 64
    p = plan(TINY, hardware=TOY_HW, context_len=ctx, precision="fp32", memory_budget="1GiB")
    w, kv = p.weight_bytes_per_step, p.kv_bytes_per_token
    matmul_p = sum(o * i for o, i in [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64),
                                      (64, 128)] * 2)
    head = 49152 * 64
    attn_decode = 4 * ctx * 2 * 4 * 16  # 4 x L x layers x heads x head_dim
    # Decode at batch 1: bytes = W + L x KV; FLOPs = 2 x (blocks + head) + attention.
    mem_s, flop_s = (w + ctx * kv) / 1e9, (2 * (matmul_p + head) + attn_decode) / 1e9
    assert p.decode_step_s == pytest.approx(max(mem_s, flop_s))
    assert p.decode_bound == ("memory" if mem_s >= flop_s else "compute")
    # At the largest batch: weights once, every sequence's KV.
    b = p.max_num_seqs
    full_mem = (w + b * ctx * kv) / 1e9
    full_flop = b * (2 * (matmul_p + head) + attn_decode) / 1e9
    assert p.decode_step_s_full == pytest.approx(max(full_mem, full_flop))
    assert p.decode_tok_s_full == pytest.approx(b / p.decode_step_s_full)
    # Prefill: 2 x L x block params + 2 x head params (last token) + causal attention.
    flops = 2 * ctx * matmul_p + 2 * head + 2 * 2 * 4 * 16 * ctx * (ctx + 1)
    assert p.prefill_s == pytest.approx(max((w + ctx * kv) / 1e9, flops / 1e9))
    # A machine with no bandwidth to speak of is memory-bound; one with no compute is compute-bound.
    slow_mem = Hardware("m", 2**30, 1.0, 1e15, 1e15, "test")
    slow_flops = Hardware("c", 2**30, 1e15, 1.0, 1.0, "test")
    assert plan(TINY, hardware=slow_mem, context_len=ctx).decode_bound == "memory"
    assert plan(TINY, hardware=slow_flops, context_len=ctx).prefill_bound == "compute"


def test_budget_and_fit():
    p = plan(TINY, hardware=TOY_HW, context_len=256, memory_budget="64MiB", precision="bf16")
    assert p.kv_budget_bytes == 64 * 2**20 - p.weight_bytes
    assert p.num_kv_blocks == p.kv_budget_bytes // (p.kv_bytes_per_token * 16)
    assert p.max_num_seqs == p.num_kv_blocks // 16 and not p.notes
    none = plan(TINY, hardware=TOY_HW, memory_budget="1MiB")
    assert none.max_num_seqs == 0 and none.decode_step_s_full is None
    assert "weights alone exceed" in none.notes[0] and "note" in none.table()
    h100 = plan(TINY, hardware="h100", precision="bf16")
    assert h100.memory_budget_bytes == 80 * 2**30 and h100.flops_per_s == 989.5e12
    assert plan(TINY, hardware="h100", precision="fp32").flops_per_s == 67e12  # no tensor cores in fp32


@pytest.mark.parametrize("kwargs, match", [
    (dict(hardware="tpu-v9"), "hardware must be one of a100, h100, h200, l4, rtx4090, this"),
    (dict(precision="int3"), "precision must be one of fp32, bf16, fp16, int8, int4"),
    (dict(precision="int4", group_size=100), "group_size must be one of 32, 64, 128"),
    (dict(context_len=5000), r"context_len must be an integer in \[1, 4096\]"),
    (dict(context_len=0), "context_len"),
    (dict(block_size=0), r"block_size must be an integer in \[1, 256\]"),
    (dict(memory_budget="lots"), "memory_budget"),
    (dict(kv_cache_memory=-1), "kv_cache_memory"),
    (dict(precision="bf16", dtype="float32"), "dtype='float32' contradicts precision='bf16'"),
    (dict(precision="int8", dtype="int8"), "dtype must be one of"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(TINY, **{"hardware": "h100", **kwargs})


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        plan("no-such-model", hardware="h100")


def test_datasheet_entries_and_aliases():
    assert set(known_hardware()) == {"a100", "h100", "h200", "l4", "rtx4090", "this"}
    assert get_hardware("H100") is DATASHEET["h100"] and get_hardware("RTX 4090") is DATASHEET["rtx4090"]
    for hw in DATASHEET.values():  # dense figures: far below the sparse ones the datasheets headline
        assert 1e11 < hw.bandwidth_bytes_per_s < 1e13 and hw.bf16_flops_per_s <= 1e15
        assert hw.fp32_flops_per_s < hw.bf16_flops_per_s and "dense" in hw.source


def test_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "_MEMO", {})
    calls = []
    fake = {"memory_bytes": 8 * 2**30, "bandwidth_bytes_per_s": 20e9, "fp32_flops_per_s": 1e11,
            "bf16_flops_per_s": 2e11, "w8a8_ops_per_s": 4e11, "w4a8_ops_per_s": 3e11, "measured_at": "now"}
    monkeypatch.setattr(probe, "measure", lambda: calls.append(1) or {"key": probe.machine_key(), **fake})
    hw = get_hardware("this")
    assert hw.bandwidth_bytes_per_s == 20e9 and probe.probe_path().is_file() and len(calls) == 1
    assert (hw.a8_ops_per_s("int8"), hw.a8_ops_per_s("int4"), hw.a8_ops_per_s("bf16")) == (4e11, 3e11, None)
    monkeypatch.setattr(probe, "_MEMO", {})  # a new process: reads the file, does not measure
    assert get_hardware("this") == hw and len(calls) == 1
    get_hardware("this", remeasure=True)
    assert len(calls) == 2
    # A file stored before the int8-activation rates were measured is measured again.
    stored = json.loads(probe.probe_path().read_text())
    probe.probe_path().write_text(json.dumps({k: v for k, v in stored.items() if not k.startswith("w")}))
    monkeypatch.setattr(probe, "_MEMO", {})
    assert get_hardware("this") == hw and len(calls) == 3
    # An unwritable cache (here: a path under a regular file) keeps the result for this process only.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path / "file" / "cache"))
    assert get_hardware("this").bandwidth_bytes_per_s == 20e9 and len(calls) == 4
    assert get_hardware("this") and len(calls) == 4


def test_real_probe_measures_something():
    assert probe.measure_bandwidth(nbytes=16 * 2**20, repeats=1) > 1e8
    assert probe.measure_matmul(__import__("torch").float32, n=128, repeats=1) > 1e6
    from minserve.kernels import quant as kq
    rates = probe.measure_a8_products(rows=64, in_features=256, out=256, repeats=1)
    if kq.a8_isa() is None:
        assert rates == {}   # no C loops: the engine would not run them either
    else:
        assert set(rates) == {"w8a8_ops_per_s", "w4a8_ops_per_s"} and min(rates.values()) > 1e8


def test_int8_activations_products_at_their_measured_rate_and_attention_at_the_float_rate():
    """With the probe's rate of the integer loops the compute time is the weight products at that
    rate plus attention at the float rate; without it, everything at the float rate, with a note."""
    import dataclasses
    slow = Hardware("a CPU", 2**34, 1e15, 1e9, 1e9, "test", device="cpu")   # compute-bound on purpose
    fast = dataclasses.replace(slow, w4a8_ops_per_s=4e9)
    without, with_rate = (plan("tiny-llama", hardware=hw, precision="int4", dtype="float32", activations="int8",
                               context_len=64) for hw in (slow, fast))
    assert any("16-bit matmul rate" in n for n in without.notes)
    assert not any("16-bit" in n for n in with_rate.notes) and with_rate.a8_ops_per_s == 4e9
    cfg = model_config("tiny-llama")[1]
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 64 * 65
    products = without.prefill_s * 1e9 - attn   # everything at 1e9 ops/s before
    assert with_rate.prefill_s == pytest.approx(products / 4e9 + attn / 1e9, rel=1e-9)
    assert with_rate.prefill_bound == "compute" and with_rate.decode_step_s < without.decode_step_s
    assert "int8-activation products" in dict((q, h) for q, _, h in with_rate.rows())["hardware"]


def test_a_cpu_plan_of_int_weights_defaults_to_the_engines_float32_activations():
    """On a CPU the engine runs int8/int4 weights with float32 activations and K/V unless told
    otherwise; a plan without ``dtype`` must size the KV pool as that engine does (bf16 K/V would
    promise twice the sequences). On a GPU datasheet bf16 stays the default."""
    eng = LLM("tiny-llama", quantization="int4", kv_cache_memory="3MiB", device="cpu").llm_engine
    cpu = Hardware("a CPU", 2**34, 1e10, 1e11, 1e11, "test", device="cpu")
    p = plan("tiny-llama", hardware=cpu, precision="int4", kv_cache_memory="3MiB")
    assert p.dtype == "float32" and p.kv_bytes_per_token == eng.kv_spec.bytes_per_token
    assert p.num_kv_blocks == eng.kv_spec.num_blocks and p.weight_bytes_per_step == eng.runner.weight_bytes()
    assert plan("tiny-llama", hardware="h100", precision="int4").dtype == "bfloat16"


def test_a_dense_lm_head_beside_int8_activations_runs_at_the_float_rate():
    """``lm_head="keep"`` leaves the head's inputs in float: its product is timed at the float rate,
    the block products at the integer loops' rate."""
    import dataclasses
    fast = dataclasses.replace(Hardware("a CPU", 2**34, 1e15, 1e9, 1e9, "test", device="cpu"),
                               w4a8_ops_per_s=4e9)
    cfg = model_config("tiny-llama")[1]
    block = 2 * 64 * sum(o * i for o, i in block_matrices(cfg))
    head, attn = 2 * cfg.vocab_size * cfg.hidden_size, 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 64 * 65
    times = {h: plan("tiny-llama", hardware=fast, precision="int4", activations="int8", lm_head=h,
                     context_len=64).prefill_s for h in ("keep", "int8")}
    assert times["keep"] == pytest.approx(block / 4e9 + (head + attn) / 1e9, rel=1e-9)
    assert times["int8"] == pytest.approx((block + head) / 4e9 + attn / 1e9, rel=1e-9)


def test_frames():
    p = plan(TINY, hardware="h100", precision="int4")
    df = p.frame()
    assert "KV blocks" in df.index and list(df.columns) == ["value", "how"]
    both = plans_frame([p, plan(TINY, hardware="l4", precision="int4")])
    assert list(both["hardware"]) == ["H100 SXM", "L4"] and both["max_num_seqs"].iloc[0] > both["max_num_seqs"].iloc[1]


def test_int8_activations_are_planned_for_the_cpu_and_quantized_weights_only(capsys):
    cpu = Hardware("a CPU", 2**34, 1e10, 1e11, 1e11, "test", device="cpu")
    with pytest.raises(ValueError, match="CPU only; H100 SXM has device='cuda'"):
        plan("tiny-llama", hardware="h100", precision="int4", activations="int8")
    with pytest.raises(ValueError, match="need precision int8 or int4, got 'fp32'"):
        plan("tiny-llama", hardware=cpu, precision="fp32", activations="int8")
    with pytest.raises(ValueError, match="activations must be one of float, int8, got 'int4'"):
        plan("tiny-llama", hardware=cpu, precision="int4", activations="int4")
    assert get_hardware("h100").device == "cuda"
    assert main(["plan", "--model", "tiny-llama", "--hardware", "h100", "--precision", "int4",
                 "--activations", "int8"]) == 2
    assert "CPU only" in capsys.readouterr().err


def test_cli(capsys):
    assert main(["plan", "--model", "tiny-llama", "--hardware", "h100", "--context-len", "1024",
                 "--precision", "int4", "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "max seqs at 1,024 tokens" in out and "H100 SXM" in out and "int4, group 32" in out
    assert main(["plan", "--list-hardware"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in ("a100", "h200", "rtx4090", "this", "dense"))
    assert main(["plan", "--model", "tiny-llama", "--hardware", "h100,l4", "--precision", "bf16"]) == 0
    assert "L4" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny-llama", "--hardware", "tpu"]) == 2
    assert "hardware must be one of" in capsys.readouterr().err


def test_a_group_size_note_does_not_hide_that_no_sequence_fits():
    p = plan("smollm2-135m", hardware="h100", precision="int4", group_size=128, memory_budget="300MiB",
             context_len=8192)
    assert p.max_num_seqs == 0
    assert [n.split(":")[0].split(" ")[0] for n in p.notes] == ["g128", "not"]
    assert p.notes[1] == "not one sequence of 8192 tokens fits in the KV budget"
