"""The engine's methods for experiments: step observers and the layer-attention seam.

Mixed into :class:`~minserve.engine.llm_engine.LLMEngine` (they read its ``kv``, ``runner`` and
``num_steps``), kept here so that the engine's loop stays one page and the extension points one
place; docs/extending.md shows each in use.
"""

from __future__ import annotations

import hashlib

from minserve.engine.observers import StepObserver, StepObservers


class EngineExtensions:
    """LLMEngine's extension methods (step observers: engine/observers.py)."""

    def add_step_observer(self, observer: StepObserver) -> None:
        """Let ``observer`` see every scheduled batch, KV block event and sampled token from now
        on, and the logits of the requests in its ``capture_logits``."""
        if not isinstance(observer, StepObserver):
            raise ValueError(f"observer must be a StepObserver, got {type(observer).__name__}")
        if self._observers is None:
            self._observers = obs = StepObservers()
            self.kv.observe(obs)
            self.runner.logits_tap = lambda reqs, logits: obs.logits(self.num_steps, reqs, logits)
        self._observers.observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop notifying ``observer``; with the last one gone the engine builds no records."""
        if self._observers is None or observer not in self._observers.observers:
            return
        self._observers.observers.remove(observer)
        if not self._observers.observers:
            self._observers = None
            self.kv.observe(None)
            self.runner.logits_tap = None

    def set_layer_attention(self, make_op, name: str = "custom") -> None:
        """Attention experiments (sinks, windows, sparsity): every layer attends through the op
        ``make_op(num_heads, num_kv_heads, head_dim)`` builds, called as the torch op is
        (attention/torch_paged.py: write the new K/V, attend, return [tokens, heads x head_dim]);
        steps run on the PyTorch path. K/V computed this way differ from the model's own, so the
        prefix cache keys blocks by ``name`` too: no block crosses between attentions. ``None``
        restores the engine's attention. Only between requests (ValueError otherwise)."""
        if self.has_unfinished_requests():
            raise ValueError("set_layer_attention needs an engine with no unfinished requests")
        self.runner.set_layer_attention(make_op)
        own = self.model_fingerprint
        self.kv.model_fingerprint = own if make_op is None else hashlib.sha256(
            f"{own}/attention={name}".encode()).hexdigest()[:16]
