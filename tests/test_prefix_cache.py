"""Automatic prefix caching: exact hit counts, tenant isolation by cache_salt, eviction, cleanup."""

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.kv_cache import BlockPool, KVCacheManager, KVCacheSpec
from conftest import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 16


def _engine(**kw):
    return LLM("tiny-llama", **{"num_kv_blocks": 128, "max_num_batched_tokens": 512, **kw}).llm_engine


def _run(eng, rid, prompt, params=GREEDY, salt=None):
    eng.add_request(rid, prompt, params, cache_salt=salt)
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished and o.request_id == rid:
                final = o
    return final


def _hits(eng):
    return sum(s.prefix_cache_hits for s in eng.step_stats), sum(s.prefix_cache_queries for s in eng.step_stats)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_shared_prefix_of_k_blocks_hits_k_blocks(k):
    eng = _engine()
    shared = list(range(1000, 1000 + k * BS))
    _run(eng, "a", shared + [7, 8, 9])
    before = _hits(eng)
    out = _run(eng, "b", shared + [11, 12, 13, 14])
    hits, queries = _hits(eng)
    assert hits - before[0] == k * BS and out.num_cached_tokens == k * BS
    assert queries - before[1] == k * BS + 4
    assert_all_blocks_free_engine(eng)


def test_only_the_computed_prefill_is_skipped():
    eng = _engine()
    prompt = list(range(2000, 2000 + 3 * BS + 5))
    _run(eng, "a", prompt)
    eng.add_request("b", prompt[:3 * BS] + [1, 2, 3, 4, 5], GREEDY)
    eng.step()
    assert eng.step_stats[-1].num_prefill_tokens == 5 and eng.step_stats[-1].prefix_cache_hits == 3 * BS
    while eng.has_unfinished_requests():
        eng.step()


def test_last_token_is_always_recomputed():
    eng = _engine()
    prompt = list(range(3000, 3000 + 2 * BS))  # exactly two full blocks
    _run(eng, "a", prompt)
    eng.add_request("b", prompt, GREEDY)
    eng.step()
    # The second block holds the last prompt token, whose logits are needed: only block 1 is reused.
    assert eng.step_stats[-1].prefix_cache_hits == BS and eng.step_stats[-1].num_prefill_tokens == BS
    while eng.has_unfinished_requests():
        eng.step()


def test_greedy_outputs_identical_with_caching_on_and_off(tiny_llm):
    from prompts import mixed_prompts
    system = list(range(4000, 4000 + 40))
    prompts = [system + p for p in mixed_prompts(tiny_llm.get_tokenizer(), 8, 3, 60, seed=11)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for on in (True, False):
        llm = LLM("tiny-llama", num_kv_blocks=128, enable_prefix_caching=on, max_num_seqs=4)
        first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
        runs[on] = [o.outputs[0].token_ids for o in first + rest]
        hits = sum(s.prefix_cache_hits for s in llm.llm_engine.step_stats)
        assert (hits >= 7 * 32) if on else hits == 0
        assert_all_blocks_free(llm)
    assert runs[True] == runs[False]


def test_different_salts_never_share_same_salt_does():
    eng = _engine()
    prompt = list(range(5000, 5000 + 4 * BS))
    _run(eng, "a", prompt, salt="tenant-a")
    for rid, salt, expect in (("b", "tenant-b", 0), ("c", None, 0), ("d", "tenant-a", 3 * BS)):
        before = _hits(eng)[0]
        out = _run(eng, rid, prompt, salt=salt)
        assert _hits(eng)[0] - before == expect and out.num_cached_tokens == expect, rid
    # Salted blocks were published under different keys: no block is shared across tenants.
    keys = [k for k in eng.kv.pool.block_key if k is not None]
    assert len({k[1] for k in keys}) == 3  # three tenants: a, b, unsalted
    with pytest.raises(ValueError, match="cache_salt"):
        eng.add_request("bad", prompt, GREEDY, cache_salt="")


def test_hash_collision_is_caught_by_token_check():
    pool = BlockPool(4)
    b = pool.allocate(1)[0]
    pool.register(b, b"same-hash", (b"", b"x", (1, 2, 3)))
    assert pool.lookup(b"same-hash", (b"", b"x", (1, 2, 3))) == b
    assert pool.lookup(b"same-hash", (b"", b"x", (9, 9, 9))) is None  # same hash, other tokens


def test_released_plain_blocks_are_reused_first_in_their_order():
    """Last in, first out: the next request writes into the pages the last one warmed, in the same
    order (consecutive blocks stay consecutive), before any never-used block."""
    pool = BlockPool(8)
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    pool.release(first)
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_eviction_is_lru_and_never_touches_blocks_in_use():
    kv = KVCacheManager(KVCacheSpec(num_blocks=6, block_size=4, bytes_per_token=1), True, "m")
    pool = kv.pool
    for i, b in enumerate(pool.allocate(3)):
        pool.register(b, bytes([i]), (b"", b"", (i,)))
    pool.release([0])           # block 0 freed first: least recently used
    pool.release([2])
    in_use = 1
    got = pool.allocate(5)      # 3 plain blocks, then evicts 0 and 2, in LRU order
    assert got[:3] == [3, 4, 5] and got[3:] == [0, 2] and in_use not in got
    assert pool.num_evictions == 2 and pool.lookup(bytes([1]), (b"", b"", (1,))) == 1
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_small_kv_budget_keeps_working_and_frees_everything(tiny_llm):
    from prompts import mixed_prompts
    system = list(range(6000, 6000 + 48))
    prompts = [system + p for p in mixed_prompts(tiny_llm.get_tokenizer(), 16, 5, 90, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = LLM("tiny-llama", num_kv_blocks=256, enable_prefix_caching=False)
    small = LLM("tiny-llama", num_kv_blocks=14, max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == want
    eng = small.llm_engine
    assert eng.kv.pool.num_evictions > 0 and eng.scheduler.num_preemptions > 0
    assert sum(s.prefix_cache_hits for s in eng.step_stats) > 0
    assert_all_blocks_free(small)


def test_preempted_request_reuses_its_cached_blocks():
    eng = _engine(num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=4)
    long_prompts = [list(range(7000 + 100 * i, 7000 + 100 * i + 40)) for i in range(4)]
    for i, p in enumerate(long_prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.num_preemptions > 0
    # Readmissions after preemption found some of their own blocks still cached.
    assert sum(s.prefix_cache_hits for s in eng.step_stats) > 0
    assert_all_blocks_free_engine(eng)


def assert_all_blocks_free_engine(eng):
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks and not eng.kv.block_tables
