"""Weight formats: layers are built from shapes and loaded by name; a quantization scheme replaces
dense layers by construction (minserve.quant.quantize_), with an explicit LM head policy.

No real int8/int4 format lives here (issue 11): a tiny per-row int8 scheme, written in this file,
proves the mechanism: the model still runs, its logits stay close to dense, and weight_bytes() and
descriptor() report the new format.
"""

import pytest
import torch
from torch import nn

from minserve import LLM, SamplingParams
from minserve.attention import build_attention_metadata
from minserve.models.layers import Linear, MergedLinear
from minserve.models.llama import LlamaForCausalLM
from minserve.models.loader import _smollm2_tokenizer_dir
from minserve.models.registry import ModelConfig
from minserve.models.tiny import TINY_CONFIG, tiny_weights, write_tiny_model
from minserve.models.weights import DENSE, WeightDescriptor
from minserve.quant import QuantScheme, quantize_


class RowInt8Linear(nn.Module):
    """Test-only format: symmetric int8 codes with one fp32 scale per output row."""

    def __init__(self, dense: Linear):
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        w = dense.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.register_buffer("codes", torch.round(w / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = None if dense.bias is None else dense.bias.detach().clone()

    def forward(self, x):
        y = (x.float() @ self.codes.T.float()) * self.scales
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def descriptor(self):
        return WeightDescriptor("int8-row", self.in_features, self.out_features, self.codes,
                                self.bias, scales=self.scales)

    def weight_bytes(self):
        return self.descriptor().nbytes


class RowInt8(QuantScheme):
    name = "int8-row"

    def __init__(self, lm_head="keep"):
        self.lm_head = lm_head
        self.seen = []

    def convert(self, name, linear):
        self.seen.append(name)
        return RowInt8Linear(linear)


def _model(tie: bool, **overrides) -> tuple[LlamaForCausalLM, dict]:
    cfg = {**TINY_CONFIG, "tie_word_embeddings": tie, **overrides}
    weights = tiny_weights(cfg, seed=1)
    return LlamaForCausalLM(ModelConfig.from_hf(cfg), weights, 256), weights


def _logits(model, prompt_len: int = 20) -> torch.Tensor:
    """One prefill of ``prompt_len`` tokens through a fresh paged cache: logits of every row."""
    cfg, bs = model.config, 16
    blocks = prompt_len // bs + 1
    kv = [(torch.zeros(blocks, bs, cfg.num_kv_heads, cfg.head_dim),
           torch.zeros(blocks, bs, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    meta = build_attention_metadata([prompt_len], [0], [list(range(blocks))], bs)
    ids = torch.arange(300, 300 + prompt_len)
    return model(ids, torch.arange(prompt_len), kv, meta, torch.arange(prompt_len))


# ---- building from shapes, loading by name ----------------------------------------------------

def test_merged_linear_loads_each_shard_into_its_rows():
    layer = MergedLinear(4, {"q": 3, "k": 2, "v": 2}, bias=True)
    g = torch.Generator().manual_seed(81)
    parts = {s: torch.randn(n, 4, generator=g) for s, n in (("q", 3), ("k", 2), ("v", 2))}
    for s in "vqk":  # any order
        layer.load(parts[s], shard=s)
        layer.load(torch.full((parts[s].shape[0],), float(ord(s))), shard=s, param="bias")
    assert torch.equal(layer.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    assert layer.bias.tolist() == [ord("q")] * 3 + [ord("k")] * 2 + [ord("v")] * 2
    assert (layer.in_features, layer.out_features) == (4, 7)
    with pytest.raises(ValueError, match="shard must be one of q, k, v"):
        layer.load(parts["q"], shard="o")
    with pytest.raises(ValueError, match="expected 2 rows for shard 'k'"):
        layer.load(parts["q"], shard="k")
    with pytest.raises(ValueError, match="has no shards"):
        Linear(4, 3).load(parts["q"], shard="q")


def test_meta_built_model_adopts_checkpoint_tensors():
    """Loading into a meta-built model copies only what it must (the merged layers): the model
    never holds a second copy of the embedding or of the unmerged projections."""
    model, weights = _model(tie=False)
    assert not any(p.is_meta for p in model.parameters())
    assert model.embed_tokens.weight.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    assert model.layers[1].mlp.down_proj.weight.data_ptr() == weights["model.layers.1.mlp.down_proj.weight"].data_ptr()
    # Built on a device first, then loaded: the same values (copied in).
    copied = LlamaForCausalLM(model.config, max_positions=256)
    copied.load_weights(weights)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), copied.state_dict().values()))
    assert copied.embed_tokens.weight.data_ptr() != weights["model.embed_tokens.weight"].data_ptr()


def test_dense_tied_head_is_the_embedding_parameter():
    model, weights = _model(tie=True)
    assert model.tied and model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in model.checkpoint_layout()
    d = model.lm_head.descriptor()
    assert (d.format, d.in_features, d.out_features) == (DENSE, 64, 49152)
    linear = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, Linear))
    norms = 64 * 4 * (2 * 2 + 1)
    assert model.weight_bytes() == linear + norms


def test_checkpoint_mismatch_names_the_tensors():
    model, weights = _model(tie=False)
    bad = dict(weights)
    del bad["model.layers.1.self_attn.k_proj.weight"]
    bad["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model.layers.1.self_attn.k_proj.weight;"
                                         r" unexpected 1 .*model.layers.0.self_attn.o_proj.bias"):
        model.load_weights(bad)
    bad = dict(weights, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight has shape \(3, 64\).*\(128, 64\)"):
        model.load_weights(bad)
    # A tied checkpoint that stores the head anyway, and old rotary buffers, load fine.
    tied, tied_weights = _model(tie=True)
    tied.load_weights(dict(tied_weights, **{"lm_head.weight": tied_weights["model.embed_tokens.weight"],
                                            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))


def test_qkv_bias_checkpoint_loads_into_the_merged_layer():
    model, weights = _model(tie=False, architectures=["Qwen2ForCausalLM"], attention_bias=True)
    bias = model.layers[0].self_attn.qkv_proj.bias
    expected = torch.cat([weights[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(bias, expected)


# ---- quantization by construction ---------------------------------------------------------------

def test_quantize_swaps_layers_keeps_tied_head():
    model, _ = _model(tie=True)
    dense_logits, dense_bytes = _logits(model), model.weight_bytes()
    scheme = RowInt8(lm_head="keep")
    assert quantize_(model, scheme) is model
    assert len(scheme.seen) == 2 * 4 and "lm_head" not in scheme.seen
    assert model.tied and model.lm_head.weight is model.embed_tokens.weight
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, RowInt8Linear) and qkv.descriptor().format == "int8-row"
    assert qkv.descriptor().describe() == "int8-row [128 x 64]"
    layers = sum(m.out_features * (m.in_features + 4) for m in model.modules() if isinstance(m, RowInt8Linear))
    assert model.weight_bytes() == layers + 49152 * 64 * 4 + 64 * 4 * 5
    assert model.weight_bytes() < dense_bytes
    logits = _logits(model)
    assert torch.allclose(logits, dense_logits, atol=0.1 * dense_logits.abs().max().item())
    assert (logits.argmax(-1) == dense_logits.argmax(-1)).float().mean() >= 0.9


def test_quantizing_a_tied_head_unties_it_and_keeps_the_embedding_dense():
    model, weights = _model(tie=True)
    table = model.embed_tokens.weight
    dense_logits = _logits(model)
    quantize_(model, RowInt8(lm_head="quantize"))
    assert not model.tied and isinstance(model.lm_head, RowInt8Linear)
    assert model.embed_tokens.weight is table and table.dtype == torch.float32
    assert torch.equal(table, weights["model.embed_tokens.weight"])
    assert model.lm_head.descriptor().format == "int8-row"
    assert model.weight_bytes() == sum(m.out_features * (m.in_features + 4) for m in model.modules()
                                       if isinstance(m, RowInt8Linear)) + 64 * 4 * 5
    logits = _logits(model)
    assert (logits.argmax(-1) == dense_logits.argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ValueError, match="load weights before quantize_"):
        model.load_weights(weights)


def test_scheme_contract_is_checked():
    class Wrong(QuantScheme):
        def convert(self, name, linear):
            return Linear(linear.in_features, linear.out_features + 1)

    model, _ = _model(tie=False)
    with pytest.raises(ValueError, match=r"Wrong.convert\('layers.0.self_attn.qkv_proj'\) changed the layer's shape"):
        quantize_(model, Wrong())
    with pytest.raises(ValueError, match="lm_head must be one of keep, quantize"):
        quantize_(model, RowInt8(lm_head="drop"))

    class Skip(QuantScheme):
        def convert(self, name, linear):
            return None if "mlp" in name else RowInt8Linear(linear)

    quantize_(model, Skip())
    assert isinstance(model.layers[1].mlp.down_proj, Linear)
    assert isinstance(model.layers[1].self_attn.o_proj, RowInt8Linear)
    assert isinstance(model.lm_head, Linear)


def test_quantized_model_runs_in_the_engine(tmp_path):
    """End to end through LLM.generate on the PyTorch path (the fused kernel binds dense weights)."""
    path = write_tiny_model(tmp_path / "m", 0, _smollm2_tokenizer_dir(), {"tie_word_embeddings": True})
    llm = LLM(str(path), num_kv_blocks=32, fused_decode=False, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(500, 540))}
    dense = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.llm_engine.runner
    before = runner.weight_bytes()
    quantize_(runner.model, RowInt8(lm_head="quantize"))
    assert runner.weight_bytes() < before / 3
    quant = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(quant) == 8 and quant[0] == dense[0]
