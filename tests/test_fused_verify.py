"""The fused C step with several query rows per sequence (speculative verification), and the
weight descriptors it binds.

Rows are tokens: each has its own position and block-table row, and a sequence's rows sit at
consecutive positions sharing its table. Each layer must write every row's K/V before any row
attends, so row j sees its own sequence's rows 0..j-1 exactly as the PyTorch path (cache write,
then a causal mask) does. The PyTorch path is the reference here; it is checked against
transformers elsewhere (test_models.py, test_correctness_vs_transformers.py).
"""

import re
import shutil

import pytest
import torch
from torch import nn

from minserve import LLM
from minserve.attention import build_attention_metadata
from minserve.kernels import decode
from minserve.kernels.build import KernelUnavailable
from minserve.kernels.decode import FusedDecoder, rows_block_tables, unsupported_reason
from minserve.models.loader import _smollm2_tokenizer_dir
from minserve.models.tiny import write_tiny_model
from minserve.models.weights import WeightDescriptor
from variants import VARIANTS

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the fused decode kernel cannot be built"),
              pytest.mark.usefixtures("sdpa_reference")]   # conftest.py says why


# Mixed in one step, in an order that is neither grouped nor sorted: decodes, verifications of
# 2..5 rows, a fresh sequence (context 0), rows crossing a block boundary (14 + 5 > 16), and a
# context past the kernel's initial softmax scratch (256).
QUERY_LENS = [1, 5, 3, 2, 4, 1, 5, 3]
FIXED_CONTEXTS = [13, 14, 0, 70]


def _runner(tmp_path, variant: str | None = None, blocks: int = 256):
    name = "tiny-llama" if variant is None else str(write_tiny_model(
        tmp_path / variant, seed=5, tokenizer_dir=_smollm2_tokenizer_dir(), overrides=VARIANTS[variant]))
    # fused_decode=False: these tests build their own decoders, independent of the runner's.
    llm = LLM(name, num_kv_blocks=blocks, fused_decode=False, max_model_len=min(1024, 16 * blocks),
              block_size=16, device="cpu")
    return llm.llm_engine.runner


def _step(contexts: list[int], query_lens: list[int], num_blocks: int, block_size: int, seed: int):
    """Token ids, positions and disjoint shuffled block tables of one step."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for c, q in zip(contexts, query_lens):
        n = (c + q - 1) // block_size + 1
        tables.append(order[i:i + n])
        i += n
    assert i <= num_blocks
    ids = torch.randint(0, 1000, (sum(query_lens),), generator=g)
    pos = torch.tensor([p for c, q in zip(contexts, query_lens) for p in range(c, c + q)])
    return ids, pos, tables


def _cache_rows(kv_caches, slots):
    return [(k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots].clone())
            for k, v in kv_caches]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_verification_rows_match_torch_forward(variant, tmp_path):
    runner = _runner(tmp_path, variant)
    bs, model, kv = runner.block_size, runner.model, runner.kv_caches
    g = torch.Generator().manual_seed(3)
    contexts = FIXED_CONTEXTS + torch.randint(1, 600, (len(QUERY_LENS) - 4,), generator=g).tolist()
    ids, pos, tables = _step(contexts, QUERY_LENS, 256, bs, seed=1)
    meta = build_attention_metadata(QUERY_LENS, contexts, tables, bs)
    slots, T = meta.slot_mapping, len(ids)
    torch.manual_seed(0)
    for k, v in kv:  # a populated cache: random keys/values as earlier steps left them
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in kv]

    ref = model(ids, pos, kv, meta, torch.arange(T))
    ref_kv = _cache_rows(kv, slots)
    for (k, v), (k0, v0) in zip(kv, before):  # back to the old cache: the kernel writes its own K/V
        k.copy_(k0)
        v.copy_(v0)
    fused = FusedDecoder(model, kv, max_rows=T)
    assert fused.supports(QUERY_LENS) and not fused.supports(QUERY_LENS + [1])
    order = torch.randperm(T, generator=g)  # every row's logits, in another order
    out = fused(ids, pos, rows_block_tables(QUERY_LENS, tables), order)

    torch.testing.assert_close(out, ref[order], rtol=1e-4, atol=1e-4)
    assert torch.equal(out.argmax(-1), ref[order].argmax(-1))
    for (k, v), (rk, rv) in zip(_cache_rows(kv, slots), ref_kv):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(kv[0][0].shape[0] * bs, dtype=torch.bool)
    untouched[slots] = False  # every other slot is as it was: no stray writes
    for (k, v), (k0, v0) in zip(kv, before):
        flat = lambda t: t.view(-1, *t.shape[2:])[untouched]  # noqa: E731
        assert torch.equal(flat(k), flat(k0)) and torch.equal(flat(v), flat(v0))


def test_a_rows_results_do_not_depend_on_the_other_rows(tmp_path):
    """Single-row decode is unchanged by the multi-row step: a decode alone, in a decode batch, or
    beside another sequence's verification rows computes bit for bit the same logits (every
    kernel loop is per row; only the weights are shared)."""
    runner = _runner(tmp_path)
    bs, model, kv = runner.block_size, runner.model, runner.kv_caches
    torch.manual_seed(0)
    for k, v in kv:
        k.normal_()
        v.normal_()
    contexts, query_lens = [40, 7, 90], [1, 4, 1]
    ids, pos, tables = _step(contexts, query_lens, 256, bs, seed=2)
    fused = FusedDecoder(model, kv, max_rows=8)
    mixed = fused(ids, pos, rows_block_tables(query_lens, tables), torch.tensor([0, 5]))
    decodes = fused(ids[[0, 5]], pos[[0, 5]], rows_block_tables([1, 1], [tables[0], tables[2]]),
                    torch.tensor([0, 1]))
    legacy = FusedDecoder(model, kv, max_batch=8)  # the decode-only binding the runner uses today
    assert legacy.supports([1, 1]) and not legacy.supports([1, 4]) and legacy.max_batch == 8
    for row, table in ((0, tables[0]), (5, tables[2])):
        alone = legacy(ids[[row]], pos[[row]], rows_block_tables([1], [table]), torch.tensor([0]))
        assert torch.equal(alone[0], mixed[0 if row == 0 else 1])
        assert torch.equal(alone[0], decodes[0 if row == 0 else 1])


def test_rows_block_tables_and_supports(tmp_path):
    tables = rows_block_tables([2, 1, 3], [[5, 9], [4], [7, 1, 3]])
    assert tables.dtype == torch.int64
    assert tables.tolist() == [[5, 9, 0], [5, 9, 0], [4, 0, 0], [7, 1, 3], [7, 1, 3], [7, 1, 3]]
    for bad in (([0, 1], [[1], [2]]), ([1], [[1], [2]]), ([], [])):
        with pytest.raises(ValueError, match="query_lens"):
            rows_block_tables(*bad)
    runner = _runner(tmp_path, blocks=8)
    fused = FusedDecoder(runner.model, runner.kv_caches, max_rows=6)
    assert fused.supports([1] * 6) and fused.supports([5, 1]) and fused.supports([6])
    assert not fused.supports([1] * 7) and not fused.supports([4, 3]) and not fused.supports([])
    assert not fused.supports([2, 0])
    with pytest.raises(TypeError, match="max_rows"):
        FusedDecoder(runner.model, runner.kv_caches)
    with pytest.raises(ValueError, match="max_rows"):
        FusedDecoder(runner.model, runner.kv_caches, max_rows=0)


def test_call_rejects_indices_that_would_leave_its_buffers(tmp_path):
    runner = _runner(tmp_path, blocks=8)
    fused = FusedDecoder(runner.model, runner.kv_caches, max_rows=3)
    ids, pos, rows = torch.tensor([1, 2, 3]), torch.tensor([3, 4, 5]), torch.tensor([2])
    tables = rows_block_tables([3], [[6]])
    assert fused(ids, pos, tables, rows).shape == (1, runner.model.config.vocab_size)
    vocab = runner.model.config.vocab_size
    bad = {
        "token ids": (torch.tensor([1, vocab, 3]), pos, tables, rows),
        "batch of rows": (ids[:2], pos, tables, rows),                   # 2 ids, 3 positions
        "logit rows": (ids, pos, tables, torch.tensor([0, 0, 1, 2])),    # more rows than scratch
    }
    for what, args in bad.items():
        with pytest.raises(ValueError, match=what):
            fused(*args)


class _QuantizedStandIn(nn.Module):
    """What a quantized layer looks like to a kernel: its descriptor (no forward needed here)."""

    def __init__(self, d: WeightDescriptor):
        super().__init__()
        self.d = d

    def descriptor(self) -> WeightDescriptor:
        return self.d


def _replaced(runner, path: str, make) -> str:
    parent_path, _, name = path.rpartition(".")
    parent = runner.model.get_submodule(parent_path)  # "" is the model itself
    setattr(parent, name, _QuantizedStandIn(make(getattr(parent, name).descriptor())))
    return unsupported_reason(runner.model, runner.kv_caches)


@pytest.mark.parametrize("path,make,expected", [
    ("layers.1.mlp.down_proj", lambda d: WeightDescriptor(  # int8 is implemented, float64 scales not
        "int8", d.in_features, d.out_features, torch.zeros(d.out_features, d.in_features, dtype=torch.int8),
        scales=torch.ones(d.out_features, dtype=torch.float64)),
     r"layers\.1\.mlp\.down_proj\.scales: float64 \[\d+\], the fused decode kernel reads it as float32"),
    ("layers.0.self_attn.qkv_proj", lambda d: WeightDescriptor(
        "dense", d.in_features, d.out_features, d.data.half()),
        r"layers\.0\.self_attn\.qkv_proj: dense float16 .*implements dense float32 or bfloat16, int8 .* only"),
    ("lm_head", lambda d: WeightDescriptor("int4", d.in_features, d.out_features,
                                           torch.zeros(1, dtype=torch.uint8), group_size=32),
     r"lm_head\.codes has shape \[1\], the model config implies"),
    ("lm_head", lambda d: WeightDescriptor("nf4", d.in_features, d.out_features, d.data),
     r"lm_head: nf4 \[\d+ x \d+\]; the fused decode kernel implements"),
    ("layers.1.self_attn.o_proj", lambda d: WeightDescriptor(  # sizes the config does not imply
        "dense", d.in_features + 16, d.out_features, torch.zeros(d.out_features, d.in_features + 16)),
     r"layers\.1\.self_attn\.o_proj: dense float32 .* config implies"),
    ("layers.0.mlp.gate_up_proj", lambda d: WeightDescriptor(
        "dense", d.in_features, d.out_features, d.data.t().contiguous().t()), "not contiguous"),
    ("layers.0.mlp.down_proj", lambda d: WeightDescriptor(
        "dense", d.in_features, d.out_features, d.data, torch.zeros(d.out_features)), "has a bias"),
])
def test_descriptors_the_kernel_does_not_implement_are_refused(path, make, expected, tmp_path):
    runner = _runner(tmp_path, blocks=8)
    reason = _replaced(runner, path, make)
    assert reason is not None and re.search(expected, reason), reason
    with pytest.raises(KernelUnavailable, match=expected):
        FusedDecoder(runner.model, runner.kv_caches, max_rows=4)


def test_kv_caches_and_modules_without_descriptors_are_refused(tmp_path):
    runner = _runner(tmp_path, blocks=8)
    model, kv = runner.model, runner.kv_caches
    assert unsupported_reason(model, kv) is None
    half = [(k.half(), v.half()) for k, v in kv]
    assert unsupported_reason(model, half).startswith("kv_caches[0].key: float16")
    with pytest.raises(KernelUnavailable, match=r"kv_caches\[0\]\.key: float16.*float32"):
        FusedDecoder(model, half, max_rows=4)
    mixed = [(k, v.bfloat16()) for k, v in kv]   # one format per cache: the key's decides
    with pytest.raises(KernelUnavailable, match=r"kv_caches\[0\]\.value: bfloat16.*float32"):
        FusedDecoder(model, mixed, max_rows=4)
    narrow = [(k[..., :-2].contiguous(), v[..., :-2].contiguous()) for k, v in kv]
    assert "kv_caches[0].key has shape" in unsupported_reason(model, narrow)
    assert "KV caches for" in unsupported_reason(model, kv[:-1])
    model.layers[0].mlp.down_proj = nn.Identity()
    assert unsupported_reason(model, kv).startswith("layers.0.mlp.down_proj: Identity has no descriptor()")


def test_pointers_are_bound_only_to_float32():
    with pytest.raises(TypeError, match="bfloat16"):
        decode._ptr(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        decode._ptr(torch.zeros(4, 4).t())
