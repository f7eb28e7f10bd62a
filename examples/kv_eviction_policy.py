"""A new KV eviction policy for the prefix cache, measured on the agent workload against LRU.

The agent scenario (minserve/bench/scenarios.py) starts every turn with the same long tool manual;
here its turns are interleaved with one-off document questions (the rag scenario), as a shared
server sees them. Under LRU, the default, each one-off prompt evicts whatever went free longest
ago, which between two agent turns is the manual itself: the next turn computes it again.

SLRU (segmented LRU) protects what has proved reusable: a cached block that was hit, or whose
contents were cached and evicted before, is evicted only after every block that never was, so a
stream of one-off prompts cannot flush the shared prefix. The policy plugs into the engine's seam (engine/eviction.py) with
``engine.kv.set_eviction_policy``; a step observer counts the evictions.

Prints and returns the prefix-cache hit rate (hit tokens / looked-up tokens, vLLM's meaning) and
the evictions of each policy on the same requests. ``--quick``: shorter prompts, fewer requests.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

from minserve import LLM, SamplingParams, StepObserver
from minserve.bench.datasets import sample_scenario
from minserve.engine.eviction import EvictionPolicy, LRUEviction


class SegmentedLRU(EvictionPolicy):
    """Evict blocks on probation first (oldest first), then protected ones (oldest first). A block
    is protected once its contents proved reusable: it was hit, or the same contents (its hash)
    were cached before and evicted, a "ghost" entry as ARC keeps: a prefix evicted before its
    first reuse is protected when it is computed again."""

    def __init__(self, max_ghosts: int = 4096) -> None:
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.hit: set[int] = set()                        # blocks whose contents were reused
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()  # hashes of evicted contents
        self.max_ghosts = max_ghosts

    def on_hit(self, block: int) -> None:
        self.hit.add(block)

    def add(self, block: int) -> None:
        reused = block in self.hit or self.pool.block_hash[block] in self.ghosts
        (self.protected if reused else self.probation)[block] = None

    def remove(self, block: int) -> None:
        self.probation.pop(block, None)
        self.protected.pop(block, None)

    def pop(self) -> int:
        block = (self.probation or self.protected).popitem(last=False)[0]
        self.hit.discard(block)  # its next contents start on probation
        self.ghosts[self.pool.block_hash[block]] = None
        if len(self.ghosts) > self.max_ghosts:
            self.ghosts.popitem(last=False)
        return block

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __iter__(self):
        yield from self.probation
        yield from self.protected


class EvictionCounter(StepObserver):
    def __init__(self) -> None:
        self.evictions = 0

    def on_kv_event(self, event) -> None:
        self.evictions += event.kind == "evict"


def serve(policy: EvictionPolicy, requests, num_kv_blocks: int) -> dict:
    """Serve ``requests`` one after the other under ``policy``; what the prefix cache saved."""
    llm = LLM("tiny-llama", num_kv_blocks=num_kv_blocks, max_num_seqs=1, max_num_batched_tokens=2048)
    engine = llm.llm_engine
    engine.kv.set_eviction_policy(policy)
    counter = EvictionCounter()
    engine.add_step_observer(counter)
    agent_prompt = agent_cached = 0
    for r in requests:
        out = llm.generate(r.prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        if r.scenario == "agent":
            agent_prompt += len(out.prompt_token_ids)
            agent_cached += out.num_cached_tokens
    queries = sum(s.prefix_cache_queries for s in engine.step_stats)
    hits = sum(s.prefix_cache_hits for s in engine.step_stats)
    return {"hit_rate": hits / queries, "agent_hit_rate": agent_cached / agent_prompt,
            "evictions": counter.evictions}


def agent_workload(tokenizer, turns: int, burst: int, scale: float) -> list:
    """Agent turns, each followed by ``burst`` one-off document questions."""
    agent = sample_scenario(tokenizer, "agent", turns, seed=0, length_scale=scale)
    docs = sample_scenario(tokenizer, "rag", turns * burst, seed=1, length_scale=scale)
    return [r for i, a in enumerate(agent) for r in [a, *docs[i * burst:(i + 1) * burst]]]


def main(quick: bool = False) -> dict:
    scale, turns, burst = (0.25, 8, 3) if quick else (1.0, 16, 3)
    tok = LLM("tiny-llama", num_kv_blocks=8).get_tokenizer()
    requests = agent_workload(tok, turns, burst, scale)
    # Room for the agent's manual and about two documents: a burst of three must evict something.
    num_kv_blocks = round(3 * 1024 * scale / 16) + 8
    print(f"{turns} agent turns, each followed by {burst} one-off documents; {num_kv_blocks} KV blocks of 16")
    results = {"lru": serve(LRUEviction(), requests, num_kv_blocks),
               "slru": serve(SegmentedLRU(), requests, num_kv_blocks)}
    for name, r in results.items():
        print(f"{name:5s} prefix-cache hit rate {r['hit_rate']:6.1%}, agent turns {r['agent_hit_rate']:6.1%} "
              f"({r['evictions']} evictions)")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter prompts, fewer requests")
    main(ap.parse_args().quick)
