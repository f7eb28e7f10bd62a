"""The fused C step as a step executor (CPU, a few tokens per sequence; engine/step_executor.py).

It runs the whole forward pass in C (kernels/decode.c) in place of the PyTorch model, so it is not
an attention backend. It builds the metadata that kernel reads: one position and one block-table
row per token. The rows of one sequence share its table and sit at consecutive positions; the kernel writes every row's K/V before any row attends, so a
verify step's k + 1 rows see each other causally, exactly as the PyTorch path computes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minserve.attention.backend import StepSequences
from minserve.engine.step_executor import StepExecutor
from minserve.kernels.build import KernelUnavailable
from minserve.kernels.decode import FusedDecoder, rows_block_tables, unsupported_reason
from minserve.kernels.decode_flash import FlashSequences

log = logging.getLogger("minserve")


@dataclass
class FusedStepMetadata:
    block_tables: torch.Tensor   # [num_tokens, max_blocks] int64: each token's sequence's table
    sequences: FlashSequences | None = None   # the batch-invariant executor's: for its attention


class FusedCpuExecutor(StepExecutor):
    name = "fused-cpu"

    def __init__(self, decoder, max_query_len: int):
        self.decoder = decoder                # kernels.decode.FusedDecoder, bound to model and cache
        self.max_query_len = max_query_len    # rows per sequence it takes (1 + proposals)
        # The last step's (query lens, block tables), copied, and the rows' tables built from them:
        # a sequence's table changes once per block_size tokens, so most decode steps reuse the
        # tensor instead of paying two tensor builds and a repeat_interleave per token.
        self._last_tables_key: tuple[list[int], list[list[int]]] | None = None
        self._last_tables: torch.Tensor | None = None

    def unsupported_reason(self, seqs: StepSequences) -> str | None:
        if not seqs.query_lens:
            return "empty step"
        if max(seqs.query_lens) > self.max_query_len:
            return f"a sequence has {max(seqs.query_lens)} new tokens (a prefill chunk); at most " \
                   f"{self.max_query_len} run fused"
        if not self.decoder.supports(seqs.query_lens):
            return f"{seqs.num_tokens} tokens exceed the kernel's scratch of {self.decoder.max_rows} rows"
        return None

    def build_metadata(self, seqs: StepSequences) -> FusedStepMetadata:
        # Compared by value: the KV manager grows the very lists it hands out, so the key is a copy.
        if self._last_tables_key != (seqs.query_lens, seqs.block_tables):
            self._last_tables = rows_block_tables(seqs.query_lens, seqs.block_tables)
            self._last_tables_key = (list(seqs.query_lens), [list(t) for t in seqs.block_tables])
        return FusedStepMetadata(self._last_tables)

    def run(self, input_ids, positions, metadata: FusedStepMetadata, logits_indices, num_threads):
        return self.decoder(input_ids, positions, metadata.block_tables, logits_indices, num_threads)


class InvariantFusedExecutor(FusedCpuExecutor):
    """The batch-invariant mode's fused step (kernels/decode_flash.py): every step, prompt chunks
    included, in C, each row's attention through the paged flash kernel. It takes any step the
    scheduler's token budget allows, and gives the final hidden rows for prompt logprobs, so that
    no step of the mode leaves it for the PyTorch path (whose roundings differ)."""

    name = "fused-cpu-invariant"
    takes_prompt_rows = True

    def unsupported_reason(self, seqs: StepSequences) -> str | None:
        if not seqs.query_lens:
            return "empty step"
        if seqs.num_tokens > self.decoder.max_rows:   # the scheduler's budget keeps it out
            return f"{seqs.num_tokens} tokens exceed the kernel's scratch of {self.decoder.max_rows} rows"
        return None

    def build_metadata(self, seqs: StepSequences) -> FusedStepMetadata:
        return FusedStepMetadata(super().build_metadata(seqs).block_tables,
                                 FlashSequences.build(seqs.query_lens, seqs.context_lens, seqs.block_tables))

    def run(self, input_ids, positions, metadata: FusedStepMetadata, logits_indices, num_threads,
            final_hidden: bool = False):
        return self.decoder(input_ids, positions, metadata.block_tables, logits_indices, num_threads,
                            sequences=metadata.sequences, final_hidden=final_hidden)

    def lm_head(self, hidden):
        return self.decoder.lm_head(hidden)


def invariant_fused_decoder(model, kv_caches, config, max_query_len: int) -> FusedDecoder | None:
    """The batch-invariant mode's fused step (every step in C), or None where it cannot run (the
    mode then runs every step on the PyTorch path; ``fused_decode=True`` makes that an error)."""
    if config.fused_decode is False:
        return None
    reason = fused_model_reason(model) or unsupported_reason(model, kv_caches)
    if reason is None:
        try:
            rows = max(config.max_num_batched_tokens, config.max_num_seqs * max_query_len)
            fused = FusedDecoder(model, kv_caches, max_rows=rows, flash=True)
            log.info("batch_invariant: every step runs in the fused C kernel (%s), attention in the "
                     "flash kernel", fused.library_name)
            return fused
        except KernelUnavailable as e:
            reason = str(e)
    if config.fused_decode:
        raise ValueError(f"batch_invariant=True with fused_decode=True, but the fused step cannot run "
                         f"here: {reason}")
    log.info("batch_invariant: every step runs on the PyTorch path (the fused step cannot: %s)", reason)
    return None


def fused_decoder(model, kv_caches, config, max_query_len: int) -> FusedDecoder | None:
    """The fused C decode path when the config allows it and it works here (see EngineConfig),
    bound to ``model`` and its KV cache; ``max_query_len``: rows per sequence it takes."""
    if config.fused_decode is False:
        return None
    reason, broken = fused_model_reason(model) or unsupported_reason(model, kv_caches), False
    if reason is None:
        try:
            # Scratch in rows (tokens): every seat with a verify step of max_query_len rows.
            rows = min(config.max_num_batched_tokens, config.max_num_seqs * max_query_len)
            fused = FusedDecoder(model, kv_caches, max_rows=max(rows, config.max_num_seqs))
            log.info("decode steps run in the fused C kernel (%s)", fused.library_name)
            return fused
        except KernelUnavailable as e:
            reason, broken = str(e), True
    # Name the KV dtype when it is not the model's: the kernel may refuse the cache, not the model.
    kv = f" with kv_cache_dtype={config.kv_cache_dtype!r}" if config.kv_cache_dtype != "auto" else ""
    if config.fused_decode:
        raise ValueError(f"fused_decode=True but the fused decode kernel is unavailable{kv}: {reason}; "
                         "leave fused_decode unset (or False) to decode in PyTorch")
    # A model the kernel does not cover (CUDA, half precision) is expected; a CPU float32 model
    # without it decodes ~1.5x slower, which a user should hear about.
    (log.warning if broken else log.info)("decode steps run in PyTorch (fused decode kernel "
                                          "unavailable%s: %s)", kv, reason)
    return None


def fused_model_reason(model) -> str | None:
    """Why the fused C step cannot compute this model class, or None. The kernel implements
    LlamaForCausalLM's forward pass; a class runs fused only if it says so in its own namespace
    (``fused_decode_unsupported = None``), so a registered variant that changes a layer and says
    nothing decodes in PyTorch instead of silently computing a Llama."""
    cls = type(model)
    if "fused_decode_unsupported" not in vars(cls):
        return (f"{cls.__name__} does not declare that the fused C step computes it "
                "(set fused_decode_unsupported = None in the class if it does)")
    return cls.fused_decode_unsupported
