"""The paged KV cache: fixed-size blocks, per-request block tables, reference counts, a free list.

Memory is carved into blocks of ``block_size`` token slots in every layer's K and V tensors. A
request owns a *block table*, the list of block ids holding its tokens in order, so its cache need
not be contiguous and grows one block at a time: no request reserves memory for tokens it has not
produced yet, which is what lets many requests share one cache (the PagedAttention idea).

Parallel sampling (``n > 1``) forks a sequence: the new table shares the full blocks by reference
count and gets its own copy of the partly filled last one (:meth:`KVCacheManager.fork`).

Automatic prefix caching: once a block is full, it gets a key that chains the previous block's
key, its own token ids and the *extra keys* (model fingerprint and the request's ``cache_salt``).
A later request whose prompt starts with the same tokens, for the same model and salt, points its
block table at those blocks instead of recomputing them. Reference counts let many requests share
a block; at zero the block goes back to the free list but keeps its contents and key, so it can be
revived until the space is needed. Blocks that hold nothing reusable are handed out first; cached
ones are evicted least recently used first, or in the order of another eviction policy
(engine/eviction.py, ``KVCacheManager.set_eviction_policy``).

How many blocks there are and what a block holds per token (``kv_cache_dtype``) is decided in
engine/kv_sizing.py; this module only hands the blocks out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable

from minserve.engine.eviction import EvictionPolicy, LRUEviction
# Sizing moved to engine/kv_sizing.py; its names stay importable from here.
from minserve.engine.kv_sizing import (KV_SCALE_BYTES, KVCacheSpec, LayerKV, allocate_kv_tensors,  # noqa: F401
                                       allocate_layer_kv, kv_budget_bytes, kv_bytes_per_token,
                                       kv_cache_bytes_per_token, plan_kv_cache)


BlockKey = tuple  # (parent hash, extra-keys digest, token ids): the identity a hash stands for


def block_hash(parent: bytes, extra: bytes, tokens: list[int]) -> bytes:
    """SHA-256 of the parent block's hash, the extra keys and the block's token ids."""
    return hashlib.sha256(parent + extra + array("q", tokens).tobytes()).digest()


def extra_keys_digest(model_fingerprint: str, cache_salt: str | None) -> bytes:
    """Requests share blocks only with the same model (weights, dtype, quantization, KV cache dtype)
    and salt."""
    return hashlib.sha256(f"{model_fingerprint}\0{cache_salt or ''}".encode()).digest()


class BlockPool:
    """Block ids, reference counts, the two free lists and the prefix-cache index."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding those tokens
        # Free blocks with nothing reusable are used first; free cached blocks wait in the
        # eviction policy (least recently used by default; engine/eviction.py) and are evicted
        # only when the plain ones run out. Plain blocks go last in, first out: a block just
        # released has its pages mapped and possibly in the CPU's caches, while a never-used one
        # costs page faults on first touch (a CPU KV cache is zeroed on demand, kv_sizing.py):
        # 1024 prompt tokens into fresh blocks cost an fp32 prefill ~8 % more on a 2-core host.
        self._free_plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_cached: EvictionPolicy = LRUEviction()
        self._free_cached.bind(self)
        self.num_evictions = 0
        self.on_evict: Callable[[int], None] | None = None  # step observers (engine/observers.py)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free_plain:
                b, _ = self._free_plain.popitem(last=False)
            else:
                b = self._free_cached.pop()
                self._evict(b)
            self.ref_count[b] = 1
            blocks.append(b)
        return blocks

    def _evict(self, b: int) -> None:
        del self.cached[self.block_hash[b]]
        self.block_hash[b] = self.block_key[b] = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(b)

    def release(self, blocks: list[int]) -> None:
        # Reversed, so a request's tail blocks (the least likely to be shared) are evicted first.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} released twice"
            if self.ref_count[b] == 0:
                if self.block_hash[b] is not None:
                    self._free_cached.add(b)
                else:
                    self._free_plain[b] = None
                    self._free_plain.move_to_end(b, last=False)

    def lookup(self, h: bytes, key: BlockKey) -> int | None:
        """The cached block for hash ``h``, if its stored key really matches (no collision)."""
        b = self.cached.get(h)
        return b if b is not None and self.block_key[b] == key else None

    def acquire(self, blocks: list[int], hits: bool = False) -> None:
        """Take a reference on blocks, reviving those that sat in the free list. ``hits``: they are
        prefix-cache hits (not a fork's sharing), which the eviction policy hears of."""
        for b in blocks:
            if hits:
                self._free_cached.on_hit(b)
            if self.ref_count[b] == 0:
                self._free_cached.remove(b)
            self.ref_count[b] += 1

    def set_eviction_policy(self, policy: EvictionPolicy) -> None:
        """Evict by ``policy`` from now on; the blocks waiting now join it in their old order."""
        policy.bind(self)
        for b in list(self._free_cached):
            policy.add(b)
        self._free_cached = policy

    def register(self, b: int, h: bytes, key: BlockKey) -> None:
        """Publish a full block under its hash (first writer wins for duplicate content)."""
        if h not in self.cached and self.block_hash[b] is None:
            self.cached[h] = b
            self.block_hash[b], self.block_key[b] = h, key


class KVCacheManager:
    """Per-request block tables on top of a :class:`BlockPool`, and prefix-cache lookups."""

    def __init__(self, spec: KVCacheSpec, enable_prefix_caching: bool = True, model_fingerprint: str = ""):
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = BlockPool(spec.num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_fingerprint = model_fingerprint
        self.block_tables: dict[str, list[int]] = {}
        # Step observers' fan-out (engine/observers.py StepObservers), None when there are none:
        # then a block operation builds no event.
        self.events = None

    def set_eviction_policy(self, policy) -> None:
        """Which free cached block to evict first (an engine/eviction.py EvictionPolicy)."""
        self.pool.set_eviction_policy(policy)

    def observe(self, events) -> None:
        """Send block events to ``events`` (a StepObservers), or stop (None)."""
        self.events = events
        self.pool.on_evict = None if events is None else (lambda b: events.kv_event("evict", None, (b,)))

    # ---- prefix cache ------------------------------------------------------------------

    def _hashes(self, req) -> list[tuple[bytes, BlockKey]]:
        """(hash, key) of every full block of the request's known tokens, extended lazily."""
        out = req.block_hashes
        if req.extra_keys is None:
            req.extra_keys = extra_keys_digest(self.model_fingerprint, req.cache_salt)
        bs = self.block_size
        for i in range(len(out), req.num_tokens // bs):
            parent = out[-1][0] if out else b""
            tokens = tuple(req.token_ids(i * bs, (i + 1) * bs))
            out.append((block_hash(parent, req.extra_keys, list(tokens)), (parent, req.extra_keys, tokens)))
        return out

    def find_cached_prefix(self, req) -> list[int]:
        """Blocks holding the longest cached prefix of the request. At least the last token is
        always left to compute: its logits are needed to sample the next token."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h, key in self._hashes(req)[:(req.num_tokens - 1) // self.block_size]:
            b = self.pool.lookup(h, key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def cache_full_blocks(self, req) -> None:
        """After a step: publish the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(req.request_id, [])
        # Only tokens that are final: computed, and part of the request (not a proposal that a
        # verify step may still reject; those are never among its tokens).
        full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(table))
        hashes = self._hashes(req)
        for i in range(req.num_registered_blocks, full):
            self.pool.register(table[i], *hashes[i])
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    # ---- block tables --------------------------------------------------------------------

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_slots(self, request_id: str, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens in all, starting with
        ``cached_blocks`` (prefix hits) if given. False, with nothing changed, when the pool
        cannot supply the blocks: the scheduler then preempts or waits."""
        need = self.blocks_needed(request_id, num_tokens) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.pool.ref_count[b] == 0)
        if need + revived > self.pool.num_free:
            return False
        self.pool.acquire(list(cached_blocks), hits=True)  # before allocate, so hits cannot be evicted
        table = self.block_tables.setdefault(request_id, [])
        table.extend(cached_blocks)
        new = self.pool.allocate(max(0, need))
        table.extend(new)
        if self.events is not None and (new or cached_blocks):
            self.events.kv_event("allocate", request_id, new, cached_blocks)
        return True

    def fork(self, request_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child_id`` a block table holding the first ``num_tokens`` tokens of
        ``request_id``'s (parallel sampling): the full blocks are shared (one more reference
        each; neither sequence writes into a full block again), the partly filled last block is
        a new block of the child's own. Returns the (source, destination) pair to copy into it
        once the step has written the source ([] when the tokens end on a block boundary), or
        None, with nothing changed, when the pool has no block for the copy."""
        table = self.block_tables[request_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and self.pool.num_free == 0:
            return None
        shared = table[:num_full]
        self.pool.acquire(shared)
        child = self.block_tables[child_id] = list(shared)
        copy = self.pool.allocate(1) if partial else []
        child.extend(copy)
        if self.events is not None:
            self.events.kv_event("allocate", child_id, copy, shared)
        return [(table[num_full], copy[0])] if partial else []

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks that ``num_tokens`` tokens need; the blocks
        cut off (emptied by a rollback) go back to the pool."""
        table = self.block_tables.get(request_id)
        if table is None:
            return
        keep = -(-max(0, num_tokens) // self.block_size)
        if keep < len(table):
            self.pool.release(table[keep:])
            if self.events is not None:
                self.events.kv_event("free", request_id, table[keep:])
            del table[keep:]

    def free(self, request_id: str) -> None:
        blocks = self.block_tables.pop(request_id, [])
        self.pool.release(blocks)
        if self.events is not None and blocks:
            self.events.kv_event("free", request_id, blocks)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing changed) while any block is in use:
        blocks in use cannot be forgotten, and forgetting only the idle ones would leave a
        half-warm cache. It allocates every free block and gives them back: the pool hands out
        plain blocks first and then evicts each cached one (the path it always takes), so the
        prefix index empties through its own bookkeeping (eviction count and observers
        included), not around it."""
        pool = self.pool
        if pool.num_free != pool.num_blocks:
            return False
        pool.release(pool.allocate(pool.num_free))
        return not pool.cached

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc: 1.0 = full). Free blocks that
        still hold cached prefixes count as free: they are reclaimable at any moment."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks
