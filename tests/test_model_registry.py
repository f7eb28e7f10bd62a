"""ModelRegistry (models/registry.py) and the Qwen2 / Qwen3 architectures, token-exact against
Hugging Face transformers on small random checkpoints built here with transformers' own classes.

Each checkpoint is a transformers model made from a tiny Qwen2Config / Qwen3Config, its weights
redrawn from a seeded generator at scales that make next-token distributions peaked (as
models/tiny.py does: at transformers' init std of 0.02 every logit is a near-tie), saved with
save_pretrained beside SmolLM2's tokenizer, and loaded by both sides from that one directory.
"""

from __future__ import annotations

import shutil
import sys
import textwrap

import pytest
import torch

from minserve import LLM, ModelRegistry, SamplingParams
from minserve.models.loader import _smollm2_tokenizer_dir
from minserve.models.tiny import write_tiny_model
from prompts import mixed_prompts
from reference import check_greedy_close, hf_greedy

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
ENGINE = dict(num_kv_blocks=96, max_num_batched_tokens=64, max_num_seqs=8, device="cpu")


@torch.no_grad()
def _redraw_peaked(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # the layer norms and Qwen3's q_norm / k_norm
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)


def hf_checkpoint(path, arch: str, seed: int = 0, **overrides):
    import transformers
    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides}))
    _redraw_peaked(model, seed)
    model.save_pretrained(str(path))
    for f in _smollm2_tokenizer_dir().iterdir():
        if not f.name.startswith("."):
            shutil.copy(f, path / f.name)
    return path


def _compare(llm, path, prompts, max_tokens: int) -> None:
    """Greedy ids equal transformers' (or part at a near-tie); sampled-token logprobs close."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref, ref_lp = hf_greedy(str(path), p, max_tokens)
        got = o.outputs[0].token_ids
        matched = check_greedy_close(got, ref, ref_lp, f"prompt {i}")
        assert matched == max_tokens, f"prompt {i} parted from transformers at token {matched}"
        ours = torch.tensor([o.outputs[0].logprobs[j][t].logprob for j, t in enumerate(got)])
        theirs = ref_lp[torch.arange(len(got)), torch.tensor(got)]
        assert torch.allclose(ours, theirs, atol=2e-4), (ours - theirs).abs().max()


@pytest.mark.parametrize("fused_decode", [None, False], ids=["default", "torch-decode"])
def test_qwen2_matches_transformers_on_both_decode_paths(tmp_path, fused_decode):
    path = hf_checkpoint(tmp_path / "qwen2", "qwen2", seed=1)
    llm = LLM(str(path), fused_decode=fused_decode, **ENGINE)
    assert llm.llm_engine.model_config.attention_bias
    # q/k/v biases are in the fused C step: Qwen2 decodes there by default.
    assert (llm.llm_engine.runner.fused is not None) == (fused_decode is None)
    _compare(llm, path, mixed_prompts(llm.get_tokenizer(), 4, 3, 150, seed=4), 20)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "head_dim": 32},
                                       {"num_key_value_heads": 4, "attention_bias": True}],
                         ids=["untied", "tied-wide-heads", "mha-biases"])
def test_qwen3_matches_transformers_in_pytorch(tmp_path, overrides):
    path = hf_checkpoint(tmp_path / "qwen3", "qwen3", seed=2, **overrides)
    llm = LLM(str(path), **ENGINE)
    runner = llm.llm_engine.runner
    assert type(runner.model).__name__ == "Qwen3ForCausalLM"
    assert runner.fused is None  # no per-head q/k norm in the C step: the engine falls back
    _compare(llm, path, mixed_prompts(llm.get_tokenizer(), 4, 3, 150, seed=5), 20)


def test_qwen3_refuses_a_forced_fused_decode(tmp_path):
    path = hf_checkpoint(tmp_path / "qwen3", "qwen3", seed=3)
    with pytest.raises(ValueError, match=r"fused_decode=True .*q_norm, k_norm"):
        LLM(str(path), fused_decode=True, **ENGINE)


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A model class outside the package: Llama's computation under a name of its own."""
    (tmp_path / "my_arch_mod.py").write_text(textwrap.dedent("""
        from minserve.models.llama import LlamaForCausalLM
        BUILT = []
        class MyLlama(LlamaForCausalLM):
            def __init__(self, *args, **kw):
                BUILT.append(self)
                super().__init__(*args, **kw)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_arch_mod"
    ModelRegistry._archs.pop("MyLlamaForCausalLM", None)
    sys.modules.pop("my_arch_mod", None)


def test_register_model_lazily_by_name(tmp_path, plugin_module):
    builtins = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    assert ModelRegistry.get_supported_archs()[:4] == builtins
    ModelRegistry.register_model("MyLlamaForCausalLM", f"{plugin_module}:MyLlama")
    assert plugin_module not in sys.modules  # nothing imported until a model needs it
    assert ModelRegistry.get_supported_archs()[-1] == "MyLlamaForCausalLM"
    tok = _smollm2_tokenizer_dir()
    mine = write_tiny_model(tmp_path / "mine", 7, tok, {"architectures": ["MyLlamaForCausalLM"]})
    llama = write_tiny_model(tmp_path / "llama", 7, tok)
    llm = LLM(str(mine), fused_decode=False, **ENGINE)
    assert sys.modules[plugin_module].BUILT == [llm.llm_engine.runner.model]
    ref = LLM(str(llama), fused_decode=False, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(40, 70))}
    assert (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == ref.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_registered_class_that_does_not_declare_the_fused_step_decodes_in_pytorch(tmp_path, plugin_module):
    from my_arch_mod import MyLlama
    ModelRegistry.register_model("MyLlamaForCausalLM", MyLlama)
    path = write_tiny_model(tmp_path / "mine", 0, _smollm2_tokenizer_dir(), {"architectures": ["MyLlamaForCausalLM"]})
    assert LLM(str(path), **ENGINE).llm_engine.runner.fused is None
    with pytest.raises(ValueError, match="MyLlama does not declare that the fused C step computes it"):
        LLM(str(path), fused_decode=True, **ENGINE)


def test_unknown_architecture_and_bad_registrations(tmp_path):
    path = write_tiny_model(tmp_path / "x", 0, _smollm2_tokenizer_dir(), {"architectures": ["NopeForCausalLM"]})
    with pytest.raises(ValueError, match=r"unsupported architecture 'NopeForCausalLM'; supported: LlamaForCausalLM.*"
                                         r"Qwen3ForCausalLM.*register_model"):
        LLM(str(path))
    with pytest.raises(ValueError, match="model_cls must be a class or 'package.module:Class'"):
        ModelRegistry.register_model("X", "not a name")
