"""Model implementations (the Llama family, Qwen3), the registry of aliases and architectures, the loader."""

from typing import TYPE_CHECKING

from minserve import lazy

# On first use: a tokenizer or a model's path (the bench client) must not load PyTorch.
__getattr__, __dir__ = lazy.exports(globals(), {
    "LlamaForCausalLM": "minserve.models.llama",
    **dict.fromkeys(("LoadedModel", "load_model", "resolve_model_dir"), "minserve.models.loader"),
    **dict.fromkeys(("MODEL_ALIASES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "ModelRegistry"),
                    "minserve.models.registry"),
})

if TYPE_CHECKING:
    from minserve.models.llama import LlamaForCausalLM
    from minserve.models.loader import LoadedModel, load_model, resolve_model_dir
    from minserve.models.registry import MODEL_ALIASES, SUPPORTED_ARCHITECTURES, ModelConfig, ModelRegistry

__all__ = ["LlamaForCausalLM", "LoadedModel", "load_model", "resolve_model_dir",
           "MODEL_ALIASES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "ModelRegistry"]
