"""Structured outputs: constrain generation to a JSON schema, a regex, a choice or a grammar.

The backend is xgrammar (vLLM's default; see backend.py for why and the measured figures). Per
engine one :class:`GrammarBackend` compiles each distinct spec once (an LRU cache) for the
engine's own tokenizer; per request one :class:`GrammarState` tracks where the output is in the
grammar. Each step the model runner asks the backend for the packed allowed-token bitmask of the
constrained rows, the sampler masks their logits with it, and the output processor advances the
matcher on each token that becomes final (so preemption and recompute, which never un-finalize a
token, leave it consistent). xgrammar is an optional dependency (``pip install minserve[structured]``);
only a request that sets ``structured_outputs`` needs it.
"""

from minserve.structured.backend import GrammarBackend, GrammarState

__all__ = ["GrammarBackend", "GrammarState"]
