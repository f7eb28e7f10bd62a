"""Parallel sampling (``SamplingParams(n=k)``): one prompt, k answers, one prefill.

A request with ``n > 1`` becomes k sequences, its *samples*. Sample 0 carries the request's own id
and is the only one queued: it computes the prompt. In the step whose forward pass finishes the
prompt, the scheduler forks the other samples off it (``Scheduler._fork_samples``): each gets a
block table that shares the prompt's full KV blocks by reference count and a copy of the partly
filled last block (the only one they will write into), and draws its first token from the same
logits row as sample 0, with its own generator. From then on every sample is an ordinary running
sequence: it is scheduled, preempted, stopped and finished on its own. Aborting the request's id
aborts all of them; one sample failing fails the request (its siblings are aborted): a request's
samples are one answer.

When the running set has no seat (``max_num_seqs``) or the pool no block for a sample's copy at
that moment, the sample still gets its first token from the shared logits but waits in the queue
like a preempted request, and recomputes its prompt when admitted (the prefix cache, when on,
serves the prompt's full blocks). So "one prefill" holds whenever the seats and blocks are free.

Seeds follow vLLM: sample j of a request seeded ``s`` uses a generator seeded ``s + j`` (wrapped
into torch's seed range), so sample j is exactly what an ``n=1`` request seeded ``s + j`` returns,
whatever else runs in the batch, and the samples differ from each other. Without a seed each
sample draws from the engine's shared generator; greedy samples are all identical (as in vLLM).
"""

from __future__ import annotations

from typing import Container

from minserve.engine.request import Request

# torch.Generator.manual_seed accepts [-2**63, 2**64); a sample's seed wraps into [0, 2**64).
SEED_MODULUS = 2**64


def sample_request_id(request_id: str, index: int) -> str:
    """The internal id of sample ``index`` (0 keeps the request's id: it is the one queued)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample ``index``'s seed: ``seed + index`` (vLLM's rule), wrapped into torch's range."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % SEED_MODULUS


class ParentRequest:
    """The request a client sent with ``n > 1``: its samples, and what its outputs have sent."""

    def __init__(self, request_id: str, params, samples: list[Request]):
        self.request_id = request_id
        self.params = params                 # as given: n, output_kind, prompt_logprobs
        self.samples = samples               # index order; samples[0] computes the prompt
        self.changed: list[Request] = []     # samples that got tokens in the current step
        self.num_outputs_sent = 0
        self.error: str | None = None        # why the request failed, if a sample did

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


def fan_out(first: Request, make_generator, ids_in_use: Container[str]) -> ParentRequest:
    """Turn ``first`` (built from the client's parameters, ``n > 1``) into sample 0 of a parent
    and create samples 1..n-1, waiting to be forked off it. Every sample's params have ``n=1`` and
    its own seed; only sample 0 computes prompt logprobs (the parent's output takes them from it).
    ``make_generator(params)`` builds a seeded sample's generator. ValueError, before anything
    changes, if a sample's id is in ``ids_in_use``."""
    params = first.params
    taken = [i for i in range(1, params.n) if sample_request_id(first.request_id, i) in ids_in_use]
    if taken:
        raise ValueError(f"request_id {sample_request_id(first.request_id, taken[0])!r} (sample "
                         f"{taken[0]} of {first.request_id!r}) is already in use")
    samples = []
    for index in range(params.n):
        own = params.clone()
        own.n = 1
        own.seed = sample_seed(params.seed, index)
        if index > 0:
            own.prompt_logprobs = None
        sample = first if index == 0 else Request(
            sample_request_id(first.request_id, index), first.prompt, first.prompt_token_ids, own,
            first.arrival_s, first.max_tokens, first.eos_token_ids, cache_salt=first.cache_salt,
            priority=first.priority)
        sample.params, sample.generator = own, make_generator(own)
        sample.sample_index = index
        samples.append(sample)
    parent = ParentRequest(first.request_id, params, samples)
    for sample in samples:
        sample.parent = parent
    first.unforked_samples = samples[1:]
    return parent
