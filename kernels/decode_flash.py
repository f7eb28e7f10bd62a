"""The fused step with the batch-invariant mode's attention (decode.c's FlashPlan).

The batch-invariant mode (minserve/engine/batch_invariance.py) needs every row of every step to get
the same bits whoever else is in the step. The fused step's products, norms, RoPE and SwiGLU are
already computed row by row in loops whose sums do not depend on the row count; its decode
attention kernel is too, but it computes the same formula as the flash kernel with other
roundings, and a token can be computed by either: as a decode row, and again as a prompt row when
its sequence is preempted and recomputed. So in the mode the fused step sends every row, prompt
chunk or decode row, through prefill_attention.c's paged flash kernel, called once per group of
sequences with equal query counts (the kernel's shape), and the step can then take prompt chunks
too: every step of the mode runs in C.

:class:`FlashSequences` describes one step's sequences for that (built once per step, from what
the scheduler gives the executor); :class:`FlashPlan` is decode.c's struct, owned by the
FusedDecoder, which points its scratch at it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_I64 = ctypes.c_int64
_i64p = ctypes.POINTER(ctypes.c_int64)
_f32p = ctypes.POINTER(ctypes.c_float)
MAX_GROUP = 16   # prefill_attention.c: query heads per kv head it takes


class FlashPlan(ctypes.Structure):   # decode.c's FlashPlan
    _fields_ = [("attend", ctypes.c_void_p), ("n_groups", _I64), ("groups", _i64p),
                ("first_row", _i64p), ("context_lens", _i64p), ("tables", _i64p),
                ("table_stride", _I64), ("q", _f32p), ("out", _f32p), ("final_hidden", _f32p)]


def flash_reason(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> str | None:
    """Why the flash kernel cannot attend for this model and cache (None: it can)."""
    if head_dim % 64:
        return f"the flash attention kernel takes head sizes that are multiples of 64, not {head_dim}"
    if num_heads // num_kv_heads > MAX_GROUP:
        return f"the flash attention kernel takes at most {MAX_GROUP} query heads per kv head"
    if kv_dtype not in (torch.float32, torch.int8):
        return f"the flash attention kernel reads float32 or int8 K/V, not {kv_dtype}"
    return None


@dataclass
class FlashSequences:
    """One step's sequences as the flash kernel takes them: sorted (stably) by query count into
    groups, each sequence's first row in the step, its context length and its block table."""

    groups: torch.Tensor        # [n_groups, 3] int64: first sequence, sequences, queries each
    first_row: torch.Tensor     # [sequences] int64, in group order
    context_lens: torch.Tensor  # [sequences] int64
    tables: torch.Tensor        # [sequences, width] int64
    # What check() compares, taken from the lists in build(): no tensor reductions on every step.
    rows: int = 0               # the rows the sequences span
    blocks: tuple[int, int] = (0, 0)   # the smallest and largest block id in the tables
    min_context: int = 0

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]]):
        starts, row = [], 0
        for n in query_lens:
            starts.append(row)
            row += n
        order = sorted(range(len(query_lens)), key=query_lens.__getitem__)
        groups: list[list[int]] = []
        for k, i in enumerate(order):
            if groups and groups[-1][2] == query_lens[i]:
                groups[-1][1] += 1
            else:
                groups.append([k, 1, query_lens[i]])
        width = max(1, max(len(block_tables[i]) for i in order))
        tables = [list(block_tables[i]) + [0] * (width - len(block_tables[i])) for i in order]
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        ids = [b for t in tables for b in t]
        return cls(as_tensor(groups), as_tensor([starts[i] for i in order]),
                   as_tensor([context_lens[i] for i in order]), as_tensor(tables),
                   rows=row, blocks=(min(ids), max(ids)), min_context=min(context_lens))

    def point(self, plan: FlashPlan) -> None:
        """Point ``plan`` at these tensors (which must outlive the step's call)."""
        plan.n_groups = self.groups.shape[0]
        plan.groups = ctypes.cast(self.groups.data_ptr(), _i64p)
        plan.first_row = ctypes.cast(self.first_row.data_ptr(), _i64p)
        plan.context_lens = ctypes.cast(self.context_lens.data_ptr(), _i64p)
        plan.tables = ctypes.cast(self.tables.data_ptr(), _i64p)
        plan.table_stride = self.tables.shape[1]

    def check(self, rows: int, blocks: int) -> None:
        """Refuse what C would trust: every sequence's rows inside the step, block ids in the pool."""
        if self.rows > rows:   # the sequences' rows are consecutive from row 0 (build)
            raise ValueError(f"a sequence's rows run past the step's {rows} rows")
        if self.blocks[0] < 0 or self.blocks[1] >= blocks:
            raise ValueError(f"block ids must be in [0, {blocks})")
        if self.min_context < 0:
            raise ValueError("context lengths must be >= 0")
