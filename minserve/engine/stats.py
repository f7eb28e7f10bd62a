"""What one engine step did: a leaf module (no engine or metrics imports), so the engine, the
metrics and the frames can all use it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepStats:
    step: int
    start_s: float                # perf_counter seconds since engine start
    step_time_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int              # after the step
    num_waiting: int
    kv_cache_usage: float         # fraction of blocks in use after the step
    num_preemptions: int          # in this step
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache in this step
    prefix_cache_hits: int = 0     # of those, tokens found cached
    # Speculative decoding: proposals verified in this step (vLLM's num_draft_tokens; they are
    # part of num_decode_tokens) and how many of them the model accepted.
    num_spec_tokens: int = 0
    num_accepted_spec_tokens: int = 0
    # The step's prefill work, per request: (request_id, context_len, num_tokens) for every prompt
    # chunk (or recompute after preemption) computed in it; the tokens sum to num_prefill_tokens.
    # Decode tokens are not listed (a decode-only step keeps the shared empty tuple), so a long
    # history stays small. Lab timelines draw chunk boundaries from it.
    prefill_chunks: tuple = ()
