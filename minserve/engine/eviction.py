"""Which cached KV block to evict: the prefix cache's eviction policy, swappable.

A block whose last reference goes keeps its contents and its prefix-cache key, so a later request
with the same prefix can revive it (engine/kv_cache.py). Those free *cached* blocks are given out
only when the free blocks holding nothing reusable run out; then one of them must lose its
contents. Which one is this policy's choice. The default is least recently used, vLLM's: the
block that went free longest ago goes first (and a request's tail blocks go free before its
head, so shared prefixes outlive what follows them).

An experiment swaps it on a running engine with ``engine.kv.set_eviction_policy(MyPolicy())``;
the blocks already waiting move over in LRU order. A policy sees four calls:

- :meth:`EvictionPolicy.add`: a cached block's last reference went (it may be evicted now);
- :meth:`EvictionPolicy.remove`: a waiting block was hit (revived by a prefix-cache hit);
- :meth:`EvictionPolicy.pop`: choose a waiting block, forget it and return it (it is evicted);
- :meth:`EvictionPolicy.on_hit`: any cached block a new request reuses, waiting or still held
  (the signal a frequency-aware policy counts); LRU ignores it.

``policy.pool`` is the engine's BlockPool once the policy is installed (:meth:`EvictionPolicy.bind`):
``pool.block_hash[b]`` is the content hash of block ``b`` while it is cached, so a policy can
remember contents across evictions (ARC's "ghost" entries), not only block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class EvictionPolicy:
    """Base class: subclass and implement add / remove / pop / __len__ / __iter__."""

    pool = None  # the BlockPool it serves, set by bind()

    def bind(self, pool) -> None:
        """Called once when the policy is installed in ``pool``."""
        self.pool = pool

    def add(self, block: int) -> None:
        raise NotImplementedError

    def remove(self, block: int) -> None:
        raise NotImplementedError

    def pop(self) -> int:
        raise NotImplementedError

    def on_hit(self, block: int) -> None:
        pass

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        """The waiting blocks, first to be evicted first (tests and set_eviction_policy read it)."""
        raise NotImplementedError


class LRUEviction(EvictionPolicy):
    """Least recently freed first: one ordered dict, O(1) for every call."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        self._blocks[block] = None

    def remove(self, block: int) -> None:
        del self._blocks[block]

    def pop(self) -> int:
        return self._blocks.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks)
