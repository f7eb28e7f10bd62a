"""The fused C step with quantized weights (int8, int4 of every group size, mixed per matrix) and
with the int8 KV cache, against the PyTorch path of the same model.

The reference is the model's own forward with test layers that dequantize (minserve/quant/formats.py)
and run ``F.linear``: the kernel computes the same products with the dequantization in the weight
stream, in another order of additions, so logits agree to fp32 accumulation error. The int8 KV
cache is written by the kernel exactly as the reference quantizer (kernels/triton/reference.py)
writes it, bit for bit, and read with the scales folded into scores and values.
"""

import ctypes
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minserve import LLM, SamplingParams
from minserve.attention import build_attention_metadata
from minserve.engine.fused_step import FusedCpuExecutor
from minserve.kernels import build as kernel_build
from minserve.kernels.build import KernelUnavailable
from minserve.kernels.decode import FusedDecoder, rows_block_tables, unsupported_reason
from minserve.kernels.triton.reference import quantize_kv_int8
from minserve.models.loader import _smollm2_tokenizer_dir
from minserve.models.tiny import write_tiny_model
from minserve.models.weights import WeightDescriptor
from minserve.quant import QuantScheme, quantize_
from minserve.quant.formats import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from test_fused_verify import _step  # the same shuffled block tables as the verify tests

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the fused decode kernel cannot be built"),
              pytest.mark.usefixtures("sdpa_reference")]   # conftest.py says why


# Every input width a multiple of 128, so each group size fits every matrix: hidden 128, four
# heads of 32 (o_proj reads 128), intermediate 256 (down_proj reads 256).
SIZES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
MODELS = {"llama": SIZES, "qwen2-qkv-bias": SIZES | {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True,
    "use_sliding_window": False}}
# Steps: one decode; ten sequences (more rows than one 8-row pass over a weight tile); verification
# rows of several sequences mixed with decodes, crossing block boundaries (block size 16).
STEPS = {"batch-1": ([300], [1]), "decode-10": ([5, 70, 300, 16, 0, 33, 128, 9, 50, 17], [1] * 10),
         "verify": ([13, 14, 0, 70, 40, 200], [1, 5, 3, 2, 4, 5])}


class QuantLinear(nn.Module):
    """A test stand-in for a quantized layer: ``descriptor()`` reports the formats.py layout the
    kernel binds; ``forward`` dequantizes and runs ``F.linear``, the torch reference."""

    def __init__(self, linear, fmt: str, group_size: int | None = None):
        super().__init__()
        d = linear.descriptor()
        self.in_features, self.out_features, self.bias = d.in_features, d.out_features, d.bias
        if fmt == "int8":
            codes, scales = quantize_int8(d.data)
            self.desc = WeightDescriptor("int8", d.in_features, d.out_features, codes, d.bias, scales)
            self.weight = dequantize_int8(codes, scales)
        else:
            packed, scales, mins = quantize_int4(d.data, group_size)
            self.desc = WeightDescriptor("int4", d.in_features, d.out_features, packed, d.bias, scales,
                                         mins, group_size)
            self.weight = dequantize_int4(packed, scales, mins, group_size)

    def descriptor(self) -> WeightDescriptor:
        return self.desc

    def weight_bytes(self) -> int:
        return self.desc.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PlanScheme(QuantScheme):
    """Converts each layer to the (format, group size) ``plan(name)`` gives, or leaves it dense."""
    name = "test-plan"

    def __init__(self, plan, lm_head: str = "keep"):
        self.plan, self.lm_head = plan, lm_head

    def convert(self, name, linear):
        spec = self.plan(name)
        return None if spec is None else QuantLinear(linear, *spec)


# A mix across layers and matrices (None: dense), the LM head included.
MIXED = {"layers.0.self_attn.qkv_proj": ("int8",), "layers.0.self_attn.o_proj": ("int4", 64),
         "layers.0.mlp.down_proj": ("int4", 128), "layers.1.self_attn.qkv_proj": ("int4", 32),
         "layers.1.self_attn.o_proj": ("int8",), "layers.1.mlp.gate_up_proj": ("int4", 128),
         "layers.1.mlp.down_proj": ("int8",), "lm_head": ("int4", 64)}
PLANS = {  # name: (plan, lm_head policy)
    "int8": (lambda n: ("int8",), "quantize"), "int8-dense-head": (lambda n: ("int8",), "keep"),
    "int4-g32": (lambda n: ("int4", 32), "quantize"), "int4-g64": (lambda n: ("int4", 64), "quantize"),
    "int4-g128": (lambda n: ("int4", 128), "quantize"),
    "int4-g32-dense-head": (lambda n: ("int4", 32), "keep"),
    "mixed": (MIXED.get, "quantize"),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-quant")
    return {name: write_tiny_model(root / name, seed=5, tokenizer_dir=_smollm2_tokenizer_dir(),
                                   overrides=over) for name, over in MODELS.items()}


def _runner(path, plan=None, kv_cache_dtype="auto", blocks=128):
    llm = LLM(str(path), num_kv_blocks=blocks, fused_decode=False, max_model_len=min(1024, 16 * blocks),
              block_size=16, device="cpu", kv_cache_dtype=kv_cache_dtype)
    runner = llm.llm_engine.runner
    if plan is not None:
        quantize_(runner.model, PlanScheme(*PLANS[plan]))
    return runner


def _fill_cache(kv, seed: int) -> None:
    """Random contents, as earlier steps left them: float K/V, or int8 codes and positive scales."""
    g = torch.Generator().manual_seed(seed)
    for layer in kv:
        for t in layer[:2]:
            if t.dtype == torch.int8:
                t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
            else:
                t.copy_(torch.randn(t.shape, generator=g))
        for s in layer[2:]:
            s.copy_(torch.rand(s.shape, generator=g) * 2 / 127)


def _run_both(runner, contexts, query_lens, seed):
    """(fused logits, torch logits) of every row of one step over the same starting cache, plus
    the cache contents after each path wrote its rows."""
    kv, bs = runner.kv_caches, runner.block_size
    ids, pos, tables = _step(contexts, query_lens, kv[0][0].shape[0], bs, seed)
    meta = build_attention_metadata(query_lens, contexts, tables, bs)
    before = [tuple(t.clone() for t in layer) for layer in kv]
    rows = torch.arange(len(ids))
    ref = runner.model(ids, pos, kv, meta, rows)
    ref_cache = [tuple(t.clone() for t in layer) for layer in kv]
    for layer, old in zip(kv, before):  # the kernel writes its own rows into the old cache
        for t, t0 in zip(layer, old):
            t.copy_(t0)
    fused = FusedDecoder(runner.model, kv, max_rows=len(ids))
    out = fused(ids, pos, rows_block_tables(query_lens, tables), rows)
    return out, ref, ref_cache, meta.slot_mapping


def _assert_logits_close(out, ref, tol=1e-4):
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_quantized_weights_match_the_torch_path(plan, model_dirs):
    runner = _runner(model_dirs["llama"], plan)
    head = runner.model.lm_head.descriptor().format
    assert head == ("dense" if PLANS[plan][1] == "keep" else PLANS[plan][0]("lm_head")[0])
    assert unsupported_reason(runner.model, runner.kv_caches) is None
    _fill_cache(runner.kv_caches, seed=0)
    for i, (name, (contexts, query_lens)) in enumerate(STEPS.items()):
        out, ref, ref_cache, slots = _run_both(runner, contexts, query_lens, seed=i)
        _assert_logits_close(out, ref)
        for layer, ref_layer in zip(runner.kv_caches, ref_cache):  # K/V written from quantized q/k/v
            for t, r in zip(layer, ref_layer):
                flat = lambda x: x.view(-1, *x.shape[2:])[slots]  # noqa: E731
                torch.testing.assert_close(flat(t), flat(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("plan", ["int8", "int4-g32", "mixed"])
def test_quantized_qkv_with_bias(plan, model_dirs):
    """Qwen2's q/k/v bias is added after a quantized product too."""
    runner = _runner(model_dirs["qwen2-qkv-bias"], plan)
    assert runner.model.layers[0].self_attn.qkv_proj.descriptor().bias is not None
    _fill_cache(runner.kv_caches, seed=1)
    out, ref, _, _ = _run_both(runner, *STEPS["verify"], seed=4)
    _assert_logits_close(out, ref)


def test_int8_kv_quantizer_is_the_reference_bit_for_bit():
    """decode.c's quantize-on-write against quantize_kv_int8: random vectors of every scale, exact
    ties (x / scale = k + 0.5 must round to even as torch.round does), zeros, huge and tiny ones."""
    lib = kernel_build.load("decode")
    g = torch.Generator().manual_seed(0)
    D = 24   # not a multiple of 16: the kernel's loops are scalar here anyway, but say so
    rand = torch.randn(500, D, generator=g) * torch.logspace(-30, 30, 500)[:, None]
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 4.5, -4.5]
                        + [0.0] * (D - 12))
    special = torch.stack([torch.zeros(D), ties, ties * 2 ** -20, torch.full((D,), 1e-38),
                           torch.full((D,), -3.4e38), torch.linspace(-1, 1, D)])
    x = torch.cat([rand, special]).float().contiguous()
    codes, scales = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0])
    lib.ms_quantize_kv_int8(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]),
                            ctypes.c_int64(D), ctypes.c_void_p(codes.data_ptr()),
                            ctypes.c_void_p(scales.data_ptr()))
    ref_codes, ref_scales = quantize_kv_int8(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert codes[500 + 1, :10].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 4]  # half to even


@pytest.mark.parametrize("plan", [None, "int4-g32"])
def test_int8_kv_cache_matches_the_torch_path(plan, model_dirs):
    """Written: layer 0's new K/V are the reference quantization of the float K/V the same kernel
    computes over a float cache, bit for bit (later layers read the int8 cache, so their inputs
    differ from any float run's). Read: logits match the torch path over the same int8 cache."""
    runner = _runner(model_dirs["llama"], plan, kv_cache_dtype="int8")
    kv, bs = runner.kv_caches, runner.block_size
    assert len(kv[0]) == 4 and kv[0][0].dtype == torch.int8
    assert unsupported_reason(runner.model, kv) is None
    _fill_cache(kv, seed=2)
    for i, (contexts, query_lens) in enumerate(STEPS.values()):
        out, ref, ref_cache, slots = _run_both(runner, contexts, query_lens, seed=10 + i)
        # Each path rounds its own K/V (equal up to fp32 summation order) to codes: a value on a
        # rounding boundary may land one code apart, one step of max|x| / 127. Rare (none with
        # these seeds here: logits then agree to ~4e-5), so the bound allows a few such steps.
        _assert_logits_close(out, ref, tol=1e-3)
        flips = total = 0
        for layer, ref_layer in zip(kv, ref_cache):
            for t, r in zip(layer, ref_layer):
                new, want = t.view(-1, *t.shape[2:])[slots].float(), r.view(-1, *r.shape[2:])[slots].float()
                tol = 1.0 if t.dtype == torch.int8 else 1e-5   # codes within one step, scales close
                torch.testing.assert_close(new, want, rtol=1e-5, atol=tol)
                if t.dtype == torch.int8:
                    flips, total = flips + int((new != want).sum()), total + new.numel()
        assert flips <= total // 1000, f"{flips} of {total} codes differ from the torch path's"
    # Bit for bit: the same step over a float32 cache gives layer 0's float K/V (same kernel, same
    # inputs), and the int8 run must hold exactly their reference quantization.
    contexts, query_lens = STEPS["verify"]
    ids, pos, tables = _step(contexts, query_lens, kv[0][0].shape[0], bs, seed=20)
    tables_rows, slots = rows_block_tables(query_lens, tables), build_attention_metadata(
        query_lens, contexts, tables, bs).slot_mapping
    float_kv = [tuple(torch.zeros(k.shape) for _ in range(2)) for k, *_ in kv]
    FusedDecoder(runner.model, float_kv, max_rows=len(ids))(ids, pos, tables_rows, torch.tensor([0]))
    FusedDecoder(runner.model, kv, max_rows=len(ids))(ids, pos, tables_rows, torch.tensor([0]))
    for which in (0, 1):   # key, value
        want_codes, want_scales = quantize_kv_int8(float_kv[0][which].view(-1, *kv[0][0].shape[2:])[slots])
        assert torch.equal(kv[0][which].view(-1, *kv[0][0].shape[2:])[slots], want_codes)
        assert torch.equal(kv[0][2 + which].view(-1, kv[0][2].shape[2])[slots], want_scales)


def _swap(model, path, desc):
    parent, _, name = path.rpartition(".")
    stand_in = nn.Module()
    stand_in.descriptor = lambda: desc
    setattr(model.get_submodule(parent), name, stand_in)


def _int4(d, g=32, **changes):
    fields = dict(format="int4", in_features=d.in_features, out_features=d.out_features,
                  data=torch.zeros(d.out_features, d.in_features // 2, dtype=torch.uint8),
                  scales=torch.ones(d.out_features, d.in_features // g),
                  zero_points=torch.zeros(d.out_features, d.in_features // g), group_size=g)
    return WeightDescriptor(**(fields | changes))


REFUSED = [   # (module, descriptor from the dense one, the reason's pattern)
    ("layers.0.mlp.down_proj", lambda d: _int4(d, g=16, scales=torch.ones(d.out_features, d.in_features // 16),
                                                 zero_points=torch.zeros(d.out_features, d.in_features // 16)),
     r"layers\.0\.mlp\.down_proj: int4 g16 .*group size 16 is not one of \(32, 64, 128\)"),
    ("layers.1.self_attn.o_proj", lambda d: _int4(d, data=torch.zeros(
        d.in_features // 2, d.out_features, dtype=torch.uint8).t()),
     r"layers\.1\.self_attn\.o_proj\.codes is not contiguous"),
    ("layers.0.mlp.gate_up_proj", lambda d: _int4(d, zero_points=None),
     r"layers\.0\.mlp\.gate_up_proj\.mins is missing"),
    ("lm_head", lambda d: _int4(d, scales=torch.ones(d.out_features, d.in_features // 32).half()),
     r"lm_head\.scales: float16 .*reads it as float32"),
    ("layers.1.mlp.down_proj", lambda d: WeightDescriptor(
        "int8", d.in_features, d.out_features, torch.zeros(d.out_features, d.in_features, dtype=torch.int8),
        torch.zeros(d.out_features), torch.ones(d.out_features)),
     r"layers\.1\.mlp\.down_proj has a bias, which the fused decode kernel does not apply"),
    ("layers.0.self_attn.qkv_proj", lambda d: WeightDescriptor(   # int4 codes declared as int8
        "int8", d.in_features, d.out_features, torch.zeros(d.out_features, d.in_features // 2,
                                                           dtype=torch.uint8), scales=torch.ones(d.out_features)),
     r"layers\.0\.self_attn\.qkv_proj\.codes: uint8 .*reads it as int8"),
    ("layers.0.self_attn.o_proj", lambda d: WeightDescriptor(
        "int8", d.in_features, d.out_features, torch.zeros(d.out_features, d.in_features, dtype=torch.int8),
        scales=torch.ones(d.out_features, 4), group_size=32),
     r"layers\.0\.self_attn\.o_proj: int8 g32 .*zero points or a group size"),
]


@pytest.mark.parametrize("path,make,expected", REFUSED)
def test_weights_the_kernel_does_not_implement_are_refused_by_name(path, make, expected, model_dirs):
    runner = _runner(model_dirs["llama"], blocks=8)
    _swap(runner.model, path, make(runner.model.get_submodule(path).descriptor()))
    reason = unsupported_reason(runner.model, runner.kv_caches)
    assert reason is not None and re.search(expected, reason), reason
    with pytest.raises(KernelUnavailable, match=expected):
        FusedDecoder(runner.model, runner.kv_caches, max_rows=2)


def test_kv_layouts_the_kernel_does_not_implement_are_refused(model_dirs):
    runner = _runner(model_dirs["llama"], blocks=8, kv_cache_dtype="int8")
    model, kv = runner.model, runner.kv_caches
    assert unsupported_reason(model, kv) is None
    k, v, ks, vs = kv[1]
    bad = {
        r"kv_caches\[1\]\.key: float32 .*reads it as int8": (k.float(), v, ks, vs),
        r"kv_caches\[1\]\.value_scales: float16 .*reads it as float32": (k, v, ks, vs.half()),
        r"kv_caches\[1\]\.key_scales has shape .* implies": (k, v, ks[..., :1].contiguous(), vs),
        r"kv_caches\[1\] holds 2 tensors, kv_caches\[0\] 4": (k, v),
        r"kv_caches\[1\]\.value is not contiguous": (k, v.transpose(0, 1).contiguous().transpose(0, 1), ks, vs),
    }
    for expected, layer in bad.items():
        reason = unsupported_reason(model, [kv[0], layer])
        assert reason is not None and re.search(expected, reason), (expected, reason)
    assert re.search(r"kv_caches\[0\] holds 3 tensors", unsupported_reason(model, [kv[0][:3], kv[1]]))
    ints_as_floats = [(k, v) for k, v, *_ in kv]   # int8 codes without scales: never read as float32
    assert re.search(r"kv_caches\[0\]\.key: int8 .*reads it as float32", unsupported_reason(model, ints_as_floats))


def test_engine_decodes_through_the_kernel_with_quantized_weights_and_int8_kv(model_dirs, monkeypatch):
    """End to end: the engine's decode steps run in the kernel bound to a quantized model and its
    int8 cache, and greedy tokens equal the torch path's (same weights, same cache format)."""
    calls = []
    inner = FusedDecoder.__call__
    monkeypatch.setattr(FusedDecoder, "__call__",
                        lambda self, ids, *args: calls.append(len(ids)) or inner(self, ids, *args))
    tokens = []
    for fused in (True, False):
        llm = LLM(str(model_dirs["llama"]), num_kv_blocks=32, fused_decode=False, device="cpu",
                  kv_cache_dtype="int8", max_model_len=256)
        runner = llm.llm_engine.runner
        quantize_(runner.model, PlanScheme(*PLANS["mixed"]))
        if fused:   # what allocate_kv does when the model is quantized at load (engine `quantization=`)
            decoder = FusedDecoder(runner.model, runner.kv_caches, max_rows=8)
            runner.executors.insert(0, FusedCpuExecutor(decoder, max_query_len=1))
        outs = llm.generate([{"prompt_token_ids": list(range(100, 100 + n))} for n in (40, 7)],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert calls and tokens[0] == tokens[1], (calls, tokens)


def test_kernel_cache_key_covers_the_files_a_source_includes(tmp_path, monkeypatch):
    """decode.c and quant.c share quant_dot.h (through quant_a8.h): editing it must rebuild both."""
    decode_files = {p.name for p in kernel_build.source_files("decode")}
    assert decode_files == {"decode.c", "decode_attention.h", "quant_dot.h", "quant_a8.h", "quant_a8_packed.h",
                            "quant_a8_tiles.h", "vmath.h", "amx_bf16.h"}
    assert {p.name for p in kernel_build.source_files("prefill_attention")} == {
        "prefill_attention.c", "prefill_attention_amx.h", "prefill_attention_paged.h", "amx_bf16.h", "quant_dot.h",
        "vmath.h"}
    assert {p.name for p in kernel_build.source_files("bf16_gemm")} == {
        "bf16_gemm.c", "amx_bf16.h", "quant_dot.h", "vmath.h"}
    assert {p.name for p in kernel_build.source_files("quant")} == {"quant.c", "quant_dot.h", "quant_a8.h",
                                                                    "quant_a8_packed.h", "quant_a8_tiles.h"}
    before = {name: kernel_build.library_path(name) for name in ("decode", "quant")}
    for name in decode_files | {"quant.c"}:
        shutil.copy(kernel_build.SOURCE_DIR / name, tmp_path / name)
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", tmp_path)
    assert {name: kernel_build.library_path(name) for name in before} == before  # same sources, same key
    with open(tmp_path / "quant_dot.h", "a") as f:
        f.write("\n/* edited */\n")
    assert all(kernel_build.library_path(name) != before[name] for name in before)
    (tmp_path / "decode_attention.h").unlink()
    with pytest.raises(KernelUnavailable, match="decode_attention.h"):
        kernel_build.library_path("decode")


def test_step_profile_splits_a_step_into_parts(model_dirs):
    """The per-part clock benchmarks/bench_quant.py reads (decode.c's ms_step_profile): off by
    default, every part counted, the parts within the whole step, both clocks, a clear error."""
    runner = _runner(model_dirs["llama"], "int4-g32")
    kv, bs = runner.kv_caches, runner.block_size
    ids, pos, tables = _step([40, 70], [1, 1], kv[0][0].shape[0], bs, seed=3)
    dec = FusedDecoder(runner.model, kv, max_rows=2)
    args = ids, pos, rows_block_tables([1, 1], tables), torch.arange(2)
    dec.step_profile(None)
    dec(*args)
    assert all(v == 0 for v in dec.step_profile(None).values()), "profiling was on without being asked"
    for clock in ("wall", "cpu"):
        dec.step_profile(clock)
        for _ in range(3):
            dec(*args, num_threads=1)
        parts = dec.step_profile(None)
        assert set(parts) == {"weights", "lm_head", "attention", "step"}
        assert all(v > 0 for v in parts.values()), (clock, parts)
        assert parts["weights"] + parts["lm_head"] + parts["attention"] <= parts["step"] * 1.0001, parts
    with pytest.raises(ValueError, match="clock must be one of"):
        dec.step_profile("gpu")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_profiled_step_reads_written_blocks(model_dirs, kv_cache_dtype):
    """benchmarks/bench_quant.py's fill_kv_blocks: the blocks a profiled step reads hold values
    (pages never written read as one cached zero page), and nothing past them is touched."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_quant import fill_kv_blocks
    runner = _runner(model_dirs["llama"], kv_cache_dtype=kv_cache_dtype, blocks=8)
    fill_kv_blocks(runner, 3)
    for layer in runner.kv_caches:
        for t in layer[:2]:
            assert t[:3].count_nonzero() > 0.9 * t[:3].numel() and not t[3:].any()
        for t in layer[2:]:
            assert (t[:3] > 0).all() and not t[3:].any()
