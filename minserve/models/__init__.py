"""Model implementations (the Llama family), the registry of aliases and the loader."""

from minserve.models.llama import LlamaForCausalLM
from minserve.models.loader import LoadedModel, load_model, resolve_model_dir
from minserve.models.registry import MODEL_ALIASES, SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["LlamaForCausalLM", "LoadedModel", "load_model", "resolve_model_dir",
           "MODEL_ALIASES", "SUPPORTED_ARCHITECTURES", "ModelConfig"]
