"""What attention needs to know about one flattened step, built once and shared by every layer.

A step is a list of sequences, each contributing ``query_len`` new tokens (1 for a decode, k+1 when
speculative tokens are verified, n for a prefill chunk) on top of ``context_len`` tokens already in
the paged KV cache. Tokens are laid out sequence after sequence in one flat batch.

Consecutive sequences with the same query length form a *group* that attention processes as one
padded batch: all decodes of a step become a single batched call however many there are, while a
prefill chunk is its own group. The gather indices and masks are built here, once per step, not
once per layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class AttentionGroup:
    token_start: int            # first row of this group in the flat batch
    num_seqs: int
    query_len: int              # new tokens per sequence in this group
    kv_blocks: torch.Tensor     # [num_seqs, blocks] block table, padded with block 0
    kv_len: int                 # longest context in the group (keys past a sequence's own are masked)
    first_block: int | None     # set when a lone sequence's blocks are consecutive: read a view, no gather
    mask: torch.Tensor | None   # [num_seqs, 1, query_len, max_kv_len] bool, True = may attend
    is_causal: bool             # one sequence, no cached context: plain causal attention
    context_lens: tuple[int, ...] = ()   # cached tokens before each sequence's queries

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_seqs * self.query_len

    @functools.cached_property
    def row_positions(self) -> torch.Tensor:
        """[num_seqs * query_len] each query row's position: the last key it may see."""
        return torch.tensor([c + j for c in self.context_lens for j in range(self.query_len)],
                            dtype=torch.long, device=self.kv_blocks.device)

    @functools.cached_property
    def context_lens_tensor(self) -> torch.Tensor:
        """[num_seqs] int64 on the CPU: the C attention kernels' copy of ``context_lens``, made once
        a step (every layer reads the same)."""
        return torch.tensor(self.context_lens, dtype=torch.int64)

    @functools.cached_property
    def row_tables(self) -> torch.Tensor:
        """[num_seqs * query_len, blocks] each query row's block table (its sequence's)."""
        return self.kv_blocks.repeat_interleave(self.query_len, dim=0)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key/value is written
    groups: list[AttentionGroup]


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_attention_metadata(query_lens: list[int], context_lens: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    slot_mapping: list[int] = []
    for q, ctx, table in zip(query_lens, context_lens, block_tables):
        slot_mapping += slots_for(table, ctx, ctx + q, block_size)
    groups: list[AttentionGroup] = []
    i, token = 0, 0
    while i < len(query_lens):
        j = i
        while j < len(query_lens) and query_lens[j] == query_lens[i]:
            j += 1
        groups.append(_build_group(token, query_lens[i], context_lens[i:j], block_tables[i:j],
                                   block_size, device))
        token += (j - i) * query_lens[i]
        i = j
    return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device), groups)


def _build_group(token_start: int, q: int, ctxs: list[int], tables: list[list[int]],
                 block_size: int, device) -> AttentionGroup:
    kv_lens = [c + q for c in ctxs]
    max_kv = max(kv_lens)
    # Attention gathers whole blocks (contiguous block_size x heads x dim chunks), which is far
    # cheaper than gathering token by token. Padding points at block 0; the mask hides it.
    num_blocks = (max_kv + block_size - 1) // block_size
    kv_blocks = torch.tensor([t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables],
                             dtype=torch.long, device=device)
    n = len(ctxs)
    if n == 1 and (q == 1 or ctxs[0] == 0):
        # No padding: a lone decode sees everything, a fresh prefill is plain causal.
        table = tables[0][:num_blocks]
        consecutive = table == list(range(table[0], table[0] + num_blocks))
        return AttentionGroup(token_start, 1, q, kv_blocks, max_kv, table[0] if consecutive else None,
                              None, is_causal=q > 1, context_lens=tuple(ctxs))
    # Query j of a sequence with c cached tokens sits at position c + j and sees keys 0..c+j.
    key_pos = torch.arange(max_kv, device=device)[None, None, :]
    last_visible = (torch.tensor(ctxs, device=device)[:, None, None]
                    + torch.arange(q, device=device)[None, :, None])
    mask = (key_pos <= last_visible).unsqueeze(1)
    return AttentionGroup(token_start, n, q, kv_blocks, max_kv, None, mask, is_causal=False,
                          context_lens=tuple(ctxs))
