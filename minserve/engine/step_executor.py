"""Who computes a step's logits: the PyTorch model with an attention backend, or the fused C step.

The model runner describes a step as :class:`~minserve.attention.StepSequences` and asks its
executors, in order of preference, for the first whose :meth:`StepExecutor.unsupported_reason` is
None; the PyTorch model runs any step, so it comes last. An executor builds its own per-step
metadata from the sequences and then runs the forward pass, returning the logits of the rows asked
for. Two kinds exist:

- :class:`ModelExecutor`: the PyTorch model (models/llama.py) with an attention backend
  (minserve/attention: the torch reference, or Triton's decode kernel on CUDA) whose metadata its
  layers read;
- ``FusedCpuExecutor`` (engine/fused_step.py): the whole forward pass in C (kernels/decode.c), for
  steps of a few tokens per sequence on CPU.

Attention backends only attend; whether a step runs the model in PyTorch or in C is this choice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minserve.attention import AttentionBackend, StepSequences


class StepExecutor(ABC):
    """Runs a whole forward pass for the steps it supports. ``name`` keys the thread controller's
    timings (engine/threads.py) and the logs."""
    name: str
    # Whether run() also gives every row's final hidden state (``final_hidden=True``) and the
    # executor an ``lm_head`` for them: steps with prompt logprobs can then stay on it.
    takes_prompt_rows = False

    def unsupported_reason(self, seqs: StepSequences) -> str | None:
        """Why this executor cannot run the step (None: it can)."""
        return None

    @abstractmethod
    def build_metadata(self, seqs: StepSequences):
        """What the forward pass needs per step, built once."""

    @abstractmethod
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata,
            logits_indices: torch.Tensor, num_threads: int) -> torch.Tensor:
        """The forward pass over the step's flat tokens; the logits of the ``logits_indices`` rows."""


class ModelExecutor(StepExecutor):
    """The PyTorch model of ``runner`` (read at each step: a runner replaces its model's rotary
    tables and KV tensors when it allocates the pool) attending through ``backend``'s metadata.
    ``backend`` is also the attention backend the executor stands for in ``ModelRunner.backends``."""

    def __init__(self, runner, backend: AttentionBackend):
        self.runner, self.backend = runner, backend

    @property
    def name(self) -> str:
        return self.backend.name

    def unsupported_reason(self, seqs: StepSequences) -> str | None:
        return self.backend.unsupported_reason(seqs)

    def build_metadata(self, seqs: StepSequences):
        return self.backend.build_metadata(seqs)

    def run(self, input_ids, positions, metadata, logits_indices, num_threads):
        # The thread count is already set around the whole step (the runner's ThreadController).
        return self.runner.model(input_ids, positions, self.runner.kv_caches, metadata, logits_indices)
