"""The scheduler and the KV manager, driven without a model through thousands of random steps.

A fake runner plays the model: every request has a scripted "true" continuation, and a verify step
keeps the proposals that match it (scripted rejections are the ones that do not). Proposals are
random: most are right, some wrong, so verify steps roll back. Requests arrive, share prefixes (so
the prefix cache is hit), get aborted and preempted (the pool is small) at random, under both
scheduling policies. After every step the invariants are checked:

- every block is owned (ref count = number of block tables holding it) or free, never both;
- a request's table covers its computed tokens, and its count never passes its tokens;
- no block published to the prefix cache holds a token that is not final: every cached hash is
  the hash of a block of some request's true sequence (a rejected proposal would give another);
- at the end every block is back in the pool, and every request got exactly its true tokens.
"""

from __future__ import annotations

import random

import pytest

from minserve.config import EngineConfig
from minserve.engine.kv_cache import KVCacheManager, KVCacheSpec, block_hash, extra_keys_digest
from minserve.engine.request import Request, RequestStatus
from minserve.engine.scheduler import Scheduler
from minserve.engine.step_io import ModelRunnerOutput, SampledToken
from minserve.sampling_params import SamplingParams
from minserve.spec.verify import accept_one_hot

VOCAB = 50
BLOCK = 4


class FakeRunner:
    """Returns, per sampling request, the tokens a model whose greedy answer is ``truth`` keeps.
    It also plays the KV cache: each slot remembers the token whose K/V was written there, and
    before a request's step every slot of its context must hold that request's own token at that
    position (what attention would read: a stale or rolled-back entry fails here)."""

    def __init__(self, truth: dict[str, list[int]], kv: KVCacheManager):
        self.truth, self.kv = truth, kv
        self.slots: dict[int, int] = {}
        self.num_verify_rows = 0

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    def execute(self, sched) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for s in sched.scheduled:
            req, table = s.request, self.kv.block_table(s.request.request_id)
            assert s.num_new_tokens >= 1
            context = req.token_ids(0, s.context_len)
            seen = [self.slots.get(self._slot(table, p)) for p in range(s.context_len)]
            assert seen == context, f"{req.request_id} would attend to K/V of other tokens"
            new = req.token_ids(s.context_len, s.context_len + s.num_new_tokens - len(s.spec_token_ids))
            for p, tok in enumerate(new + s.spec_token_ids, start=s.context_len):
                self.slots[self._slot(table, p)] = tok
        for s in sched.scheduled:
            req = s.request
            if not s.needs_sampling:
                continue
            true = self.truth[req.request_id]
            n_out = req.num_output_tokens
            drawn = true[n_out:n_out + len(s.spec_token_ids) + 1]
            keep = accept_one_hot(s.spec_token_ids, drawn)
            self.num_verify_rows += len(s.spec_token_ids)
            out.sampled[req.request_id] = [SampledToken(t, None, None) for t in drawn[:keep]]
        return out


def append_until_max_tokens(req: Request, tokens: list) -> tuple[int, RequestStatus | None]:
    for i, tok in enumerate(tokens):
        req.output_token_ids.append(tok.token_id)
        if req.num_output_tokens >= req.max_tokens:
            return i + 1, RequestStatus.FINISHED_LENGTH
    return len(tokens), None


def book(sched: Scheduler, out, ran: ModelRunnerOutput):
    """What the engine does after a step, with the output processor replaced by
    append_until_max_tokens: the scheduler books, the tokens are appended, the scheduler settles."""
    update = sched.update_from_output(out, ran)
    for a in update.accepted:
        for record in [a] + a.forks:
            record.keep(*append_until_max_tokens(record.request, record.tokens))
    sched.settle(update)
    return update


class World:
    def __init__(self, rng: random.Random, policy: str, num_blocks: int, k: int):
        self.rng, self.k = rng, k
        cfg = EngineConfig(model="tiny-llama", max_num_seqs=6, max_num_batched_tokens=24, block_size=BLOCK,
                           scheduling_policy=policy)
        self.kv = KVCacheManager(KVCacheSpec(num_blocks, BLOCK, 1), True, "fuzz")
        self.sched = Scheduler(cfg, self.kv, max_model_len=200, num_lookahead_tokens=k)
        self.truth: dict[str, list[int]] = {}
        self.true_hashes: set[bytes] = set()
        self.requests: dict[str, Request] = {}
        self.done: dict[str, Request] = {}
        self.runner = FakeRunner(self.truth, self.kv)
        self.prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 14))] for _ in range(4)]

    def add(self, i: int) -> None:
        rng = self.rng
        prompt = rng.choice(self.prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        max_tokens = rng.randrange(1, 30)
        rid = f"r{i}"
        # The true continuation depends on the prompt's last token only, so that requests sharing
        # a prompt share its continuation too (their output blocks may be cached and hit).
        gen = random.Random(prompt[-1] * 7919 + len(prompt))
        self.truth[rid] = [gen.randrange(VOCAB) for _ in range(max_tokens)]
        req = Request(rid, None, prompt, SamplingParams(max_tokens=max_tokens), arrival_s=float(i),
                      max_tokens=max_tokens, eos_token_ids=[], priority=rng.randrange(3))
        self._learn_true_hashes(req, prompt + self.truth[rid])
        self.requests[rid] = req
        self.sched.add(req)

    def _learn_true_hashes(self, req: Request, tokens: list[int]) -> None:
        extra = extra_keys_digest("fuzz", None)
        parent = b""
        for b in range(len(tokens) // BLOCK):
            parent = block_hash(parent, extra, tokens[b * BLOCK:(b + 1) * BLOCK])
            self.true_hashes.add(parent)

    def propose(self) -> None:
        for req in self.sched.running:
            if req.num_tokens - req.num_computed_tokens != 1 or self.rng.random() < 0.3:
                continue
            true = self.truth[req.request_id][req.num_output_tokens:]
            # Right most of the time, sometimes wrong, sometimes past the end of the answer.
            req.spec_token_ids = [t if self.rng.random() < 0.75 else (t + 1) % VOCAB
                                  for t in (true + [0, 0])[:self.rng.randrange(1, self.k + 1)]]

    def step(self) -> None:
        out = self.sched.schedule()
        assert not out.failed
        update = book(self.sched, out, self.runner.execute(out))
        assert not update.failed, update.failed
        for req, status in update.finished:
            self.sched.finish(req, status)
            self.done[req.request_id] = self.requests.pop(req.request_id)

    def abort_one(self) -> None:
        rid = self.rng.choice(sorted(self.requests))
        self.sched.finish(self.requests.pop(rid), RequestStatus.FINISHED_ABORTED)

    def check(self) -> None:
        pool, tables = self.kv.pool, self.kv.block_tables
        owners = [0] * pool.num_blocks
        for table in tables.values():
            for b in table:
                owners[b] += 1
        free = set(pool._free_plain) | set(pool._free_cached)
        assert len(free) == pool.num_free, "a block is in both free lists"
        for b in range(pool.num_blocks):
            assert pool.ref_count[b] == owners[b], f"block {b}: ref {pool.ref_count[b]}, {owners[b]} tables"
            assert (b in free) == (owners[b] == 0), f"block {b} owned and free, or neither"
        for req in self.sched.running:
            assert req.num_computed_tokens <= req.num_tokens
            assert len(tables[req.request_id]) * BLOCK >= req.num_computed_tokens
        for h, b in pool.cached.items():
            assert h in self.true_hashes, "a block with a token that is not final was published"
            assert pool.block_hash[b] == h


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_steps_keep_the_invariants(policy, seed):
    rng = random.Random(seed)
    world = World(rng, policy, num_blocks=rng.choice([24, 40, 80]), k=rng.choice([1, 3, 5]))
    added = 0
    for _ in range(1500):
        if added < 250 and rng.random() < 0.35:
            world.add(added)
            added += 1
        if world.requests and rng.random() < 0.02:
            world.abort_one()
        world.propose()
        world.step()
        world.check()
    while world.requests:
        world.propose()
        world.step()
        world.check()
    assert world.kv.pool.num_free == world.kv.pool.num_blocks, "blocks still held at the end"
    assert not world.kv.block_tables
    for rid, req in world.done.items():
        assert req.output_token_ids == world.truth[rid], f"{rid} got other tokens than its true ones"
    # The run exercised what it claims to: preemption, prefix hits, rejected proposals.
    assert world.sched.num_preemptions > 0
    assert world.runner.num_verify_rows > 0
    assert len(world.done) > 150


def test_rollback_trims_the_table_and_frees_emptied_blocks():
    kv = KVCacheManager(KVCacheSpec(16, BLOCK, 1), True, "fuzz")
    sched = Scheduler(EngineConfig(model="tiny-llama", block_size=BLOCK), kv, max_model_len=100)
    req = Request("a", None, list(range(7)), SamplingParams(max_tokens=20), 0.0, 20, [])
    sched.add(req)
    book(sched, sched.schedule(), ModelRunnerOutput({"a": [SampledToken(9, None, None)]}))
    assert req.num_computed_tokens == 7 and req.num_tokens == 8
    req.spec_token_ids = [1, 2, 3, 4, 5, 6]          # 8 + 6 tokens: 4 blocks of 4
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 7 and len(kv.block_tables["a"]) == 4
    assert out.num_decode_tokens == 7 and out.num_prefill_tokens == 0
    # The model keeps the first proposal and adds its own token: 5 proposals are rolled back.
    update = book(sched, out, ModelRunnerOutput({"a": [SampledToken(1, None, None),
                                                                  SampledToken(8, None, None)]}))
    assert update.num_accepted_spec_tokens == 1 and update.num_rejected_spec_tokens == 5
    assert req.output_token_ids == [9, 1, 8] and req.num_computed_tokens == 9
    assert len(kv.block_tables["a"]) == 3           # 10 tokens need 3 blocks; the 4th is free again
    assert kv.pool.num_free == 13
    assert [len(key[2]) for key in map(lambda b: kv.pool.block_key[b], kv.block_tables["a"][:2])] == [4, 4]
    assert kv.pool.block_hash[kv.block_tables["a"][2]] is None   # holds position 9, not final yet


def test_verify_step_is_never_split_and_respects_max_tokens():
    kv = KVCacheManager(KVCacheSpec(16, BLOCK, 1), False, "fuzz")
    cfg = EngineConfig(model="tiny-llama", block_size=BLOCK, max_num_batched_tokens=4)
    sched = Scheduler(cfg, kv, max_model_len=100)
    req = Request("a", None, [1, 2, 3], SamplingParams(max_tokens=3), 0.0, 3, [])
    sched.add(req)
    book(sched, sched.schedule(), ModelRunnerOutput({"a": [SampledToken(4, None, None)]}))
    req.spec_token_ids = [5, 6, 7, 8, 9]
    s = sched.schedule().scheduled[0]
    # 2 more tokens may come out (max_tokens 3): one proposal plus the model's own token.
    assert s.spec_token_ids == [5] and s.num_new_tokens == 2 and s.needs_sampling and not s.is_prefill
