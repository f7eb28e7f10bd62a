"""The fused C step as a step executor (CPU, a few tokens per sequence; engine/step_executor.py).

It runs the whole forward pass in C (kernels/decode.c) in place of the PyTorch model, so it is not
an attention backend. It builds the metadata that kernel reads: one position and one block-table
row per token. The rows of one sequence share its table and sit at consecutive positions; the kernel writes every row's K/V before any row attends, so a
verify step's k + 1 rows see each other causally, exactly as the PyTorch path computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minserve.attention.backend import StepSequences
from minserve.engine.step_executor import StepExecutor
from minserve.kernels.decode import rows_block_tables


@dataclass
class FusedStepMetadata:
    block_tables: torch.Tensor   # [num_tokens, max_blocks] int64: each token's sequence's table


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
