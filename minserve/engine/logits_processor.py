"""Custom logits processors, in vLLM v1's shape: batch-level objects that see every row to be sampled.

A logits processor changes next-token logits before sampling (ban tokens, force a minimum length,
steer a format). vLLM v1 made them *batch-level*: one object per engine, told how the batch changes
(:meth:`LogitsProcessor.update_state` with a :class:`BatchUpdate`), then asked to transform the
logits of the whole batch at once (:meth:`LogitsProcessor.apply`). Per-request settings travel in
``SamplingParams.extra_args`` (vLLM's field; ``vllm_xargs`` over HTTP), which the processor reads
when a request is added. Code written for ``vllm.v1.sample.logits_processor.LogitsProcessor``
ports by changing the import; the constructor takes minserve's :class:`~minserve.config.EngineConfig`
where vLLM passes its ``VllmConfig``.

Loaded three ways, all when the engine starts (LLMEngine builds them; engine/logits_batch.py runs
them):

- ``LLM(model, logits_processors=[MyProcessor])``: the class itself;
- ``LLM(model, logits_processors=["mypkg.rules:MyProcessor"])`` or ``minserve serve
  --logits-processors mypkg.rules:MyProcessor``: its qualified name (``pkg.mod.Class`` works too);
- an installed package's entry point in the group ``minserve.logits_processors`` (vLLM's is
  ``vllm.logits_processors``): loaded by every engine, as vLLM loads its plugins.

What a row is. Only the rows the engine samples this step have logits (a prefill chunk that does
not end its prompt has none), so the batch is *this step's sampling rows*; a request keeps its
row index from step to step while it keeps sampling (removed, added and moved as vLLM's persistent
batch is: apply ``removed``, then ``added``, then ``moved``). Under speculative decoding a request
verifying k proposals owns k + 1 rows in that step (vLLM's newer model runner does the same): row
j's output list is the request's output followed by the first j proposals, so a processor that
reads the output (a min-length rule, a repetition ban) judges each verified position exactly as it
would have judged it without speculation, and verification stays exact (greedy or sampled).
Such a row's list is a fresh one each step, so rows j >= 1 are re-added at every verify step; row
0 holds a reference to the request's own output list, which grows in place (vLLM's assumption).

Where it runs: in the sampler, on a copy of the model's fp32 logits, after the logprobs are taken
(logprobs describe the model, as in vLLM), before minserve's built-in controls (allowed ids, bad
words, logit bias, penalties, the grammar mask, min_tokens) and before temperature, min-p, top-k
and top-p; on every path that samples: PyTorch steps, mixed prefill + decode steps, the fused C
decode step (it hands fp32 logits back to Python) and speculative verification. A row a processor
leaves with no finite logit fails its request alone ("the logits processors leave no token").

``is_argmax_invariant()``: a processor that returns True promises never to change a row's argmax
(min-p, temperature-like rules). In a step whose rows are all greedy its ``apply`` is skipped
(``update_state`` still runs, so its bookkeeping stays right); in any other step it runs on every
row. With no processor configured nothing of this runs: no copy, no row bookkeeping.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from minserve.engine.plugins import entry_point_classes, load_class
from minserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.config import EngineConfig

LOGITS_PROCESSORS_GROUP = "minserve.logits_processors"


class MoveDirectionality(enum.Enum):
    """How a row moved: one way (the source slot is left empty) or swapped with the destination."""
    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


# (row index, the request's SamplingParams, its prompt token ids, its output token ids so far)
AddedRequest = tuple[int, SamplingParams, "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]  # (from index, to index, directionality)
RemovedRequest = int                                # the row index that is gone


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch of rows changed since the last step; process ``removed``, then ``added``,
    then ``moved``. An added row may take the index of a removed one; a moved row may overwrite
    its destination. ``batch_size``: rows in this step's logits."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Subclass it and pass the class (or its qualified name) to ``LLM(logits_processors=[...])``.

    ``__init__(config, device, is_pin_memory)``: built once per engine. ``config`` is the engine's
    :class:`~minserve.config.EngineConfig` (vLLM passes its VllmConfig); ``device`` is where the
    logits live; ``is_pin_memory`` is False on CPU (for staging host tensors on CUDA).
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a request's parameters (usually its ``extra_args``) with a ValueError whose
        message starts with the field, e.g. ``"extra_args['banned_ids'] must be ..."``: it is
        raised by ``add_request`` / ``prepare_params`` (an HTTP 400 naming it on the server)."""
        return None

    @abstractmethod
    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [batch_size, vocab] float32, one row per index of the batch; return the
        processed logits (changing ``logits`` in place and returning it is fine)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` can never change which token of a row has the largest logit."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every ``apply`` (every sampling step): ``None`` when the rows are the same
        requests as last step (their output lists may have grown)."""


def resolve_logits_processors(entries) -> list[type[LogitsProcessor]]:
    """``EngineConfig.logits_processors`` (classes or qualified names) as classes, or ValueError."""
    if entries is None:
        return []
    if isinstance(entries, (str, type)) or not isinstance(entries, (list, tuple)):
        raise ValueError(f"logits_processors must be a list of classes or 'package.module:Class' names, "
                         f"got {entries!r}")
    return [load_class(e, LogitsProcessor, f"logits_processors[{i}]") for i, e in enumerate(entries)]


def engine_logits_processor_classes(entries) -> list[type[LogitsProcessor]]:
    """What an engine runs: the installed entry points (group ``minserve.logits_processors``),
    then the configured ones, each class once."""
    out: list[type[LogitsProcessor]] = []
    for cls in entry_point_classes(LOGITS_PROCESSORS_GROUP, LogitsProcessor) + resolve_logits_processors(entries):
        if cls not in out:
            out.append(cls)
    return out
