"""The paged KV cache: fixed-size blocks, per-request block tables, reference counts, a free list.

Memory is carved into blocks of ``block_size`` token slots in every layer's K and V tensors. A
request owns a *block table*, the list of block ids holding its tokens in order, so its cache need
not be contiguous and grows one block at a time: no request reserves memory for tokens it has not
produced yet, which is what lets many requests share one cache (the PagedAttention idea).

Blocks carry a reference count so that, with prefix caching, several requests can point at the
same full block of a shared prompt; a block returns to the free list when its count drops to zero.
The free list is ordered oldest-freed first, the order in which cached blocks will be evicted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from minserve.config import EngineConfig
from minserve.models.registry import ModelConfig

log = logging.getLogger("minserve")


@dataclass
class KVCacheSpec:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.max_tokens * self.bytes_per_token


def plan_kv_cache(model: ModelConfig, cfg: EngineConfig) -> KVCacheSpec:
    """Decide the number of blocks from ``num_kv_blocks``, the free CUDA memory or a byte budget."""
    per_token = model.kv_bytes_per_token(torch.empty((), dtype=cfg.torch_dtype).element_size())
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
    elif str(cfg.device).startswith("cuda"):
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(cfg.device))
        blocks = int(free_bytes * cfg.gpu_memory_utilization) // (per_token * cfg.block_size)
    else:
        blocks = cfg.kv_cache_memory_bytes // (per_token * cfg.block_size)
    if blocks < 1:
        raise ValueError(f"the KV cache budget holds no block of {cfg.block_size} tokens "
                         f"({per_token} bytes per token); raise kv_cache_memory or num_kv_blocks")
    spec = KVCacheSpec(blocks, cfg.block_size, per_token)
    log.info("KV cache: %d bytes per token (2 x %d layers x %d kv heads x %d head dim x %d bytes), "
             "%d blocks of %d tokens = %d tokens, %.1f MiB", per_token, model.num_layers,
             model.num_kv_heads, model.head_dim, per_token // (2 * model.num_layers * model.num_kv_heads
                                                              * model.head_dim), blocks, cfg.block_size,
             spec.max_tokens, spec.total_bytes / 2**20)
    return spec


def allocate_kv_tensors(model: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype,
                        device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (spec.num_blocks, spec.block_size, model.num_kv_heads, model.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)]


class BlockPool:
    """Block ids, their reference counts, and the free list."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self.ref_count[b] = 1
            blocks.append(b)
        return blocks

    def release(self, blocks: list[int]) -> None:
        # Freed in reverse so a request's tail blocks (least likely to be shared) are evicted first.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} released twice"
            if self.ref_count[b] == 0:
                self._free[b] = None


class KVCacheManager:
    """Per-request block tables on top of a :class:`BlockPool`."""

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = BlockPool(spec.num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens in all. False (and no change)
        when the pool cannot supply the blocks: the scheduler then preempts or waits."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free:
            return False
        self.block_tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        self.pool.release(self.block_tables.pop(request_id, []))

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc: 1.0 = full)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks
