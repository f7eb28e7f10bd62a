"""Model implementations (the Llama family, Qwen3), the registry of aliases and architectures, the loader."""

from minserve.models.llama import LlamaForCausalLM
from minserve.models.loader import LoadedModel, load_model, resolve_model_dir
from minserve.models.registry import MODEL_ALIASES, SUPPORTED_ARCHITECTURES, ModelConfig, ModelRegistry

__all__ = ["LlamaForCausalLM", "LoadedModel", "load_model", "resolve_model_dir",
           "MODEL_ALIASES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "ModelRegistry"]
