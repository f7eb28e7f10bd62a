"""Turn a batch of next-token logits into tokens: greedy, temperature, top-k, top-p, min-p, seeds.

One call handles a whole batch where every row has its own ``SamplingParams``. The order of
operations follows vLLM V1:

1. logprobs (when asked) come from the *raw* logits, before any banning, temperature or truncation,
   so they describe what the model thinks, not what the sampler was allowed to pick;
2. custom logits processors (engine/logits_processor.py), when the engine has some, on a copy;
3. the logits controls (engine/penalties.py: allowed ids, bad words, logit bias, penalties, the
   structured-output grammar mask) change a copy of the logits, for the rows that use them; a
   batch where no row does pays one check per row and no copy. A row they leave with no token at
   all is reported in ``SamplerOutput.failed_rows`` (its drawn token means nothing), and the rest
   of the batch is sampled as usual: one request's contradictory constraints fail it alone;
4. banned tokens (``min_tokens``: EOS and stop ids until enough tokens exist) are set to -inf;
5. greedy rows take the argmax;
6. random rows: divide by temperature, drop tokens below min-p, keep top-k, then top-p, then
   draw (vLLM V1's order: min-p first, so top-p measures its mass over what min-p kept).

The draw, on a CPU, inverts the row's distribution function: one uniform u per row, and the token
is the first whose cumulative probability (float64) exceeds u times the row's total. On a GPU it
is the exponential race, as in vLLM: with ``q_i ~ Exp(1)`` independent, ``argmax_i p_i / q_i`` is
distributed exactly as ``Categorical(p)`` (``q_i / p_i ~ Exp(p_i)``, and the smallest of
independent exponentials is ``i`` with probability ``p_i / sum(p)``); it needs no scan, but a
vocabulary's worth of noise per row, which a GPU draws in microseconds and a CPU does not
(engine/draws.py's ``inverse_cdf`` has the figures). Either way, unlike ``torch.multinomial``
over the whole batch, each row's noise is one call on that row's own generator, so a seeded
request's tokens depend only on its seed and its logits, never on which other requests share the
batch.

A seeded request's noise is keyed by its output position (engine/draws.py says why).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Callable

import torch

from minserve.engine.draws import inverse_cdf, position_generator
from minserve.engine.penalties import apply_logits_controls, needs_output_ids
from minserve.kernels import nucleus
from minserve.sampling_params import SamplingParams

# Top-p rows without top-k go to kernels/nucleus.c where it applies. Elsewhere (and with
# MINSERVE_SAMPLER_FILTERS=torch) they look for their nucleus among this many best tokens first, then among
# NUCLEUS_WIDE_WINDOW (exact: rows whose nucleus is wider still fall back to a full sort). LLM
# nuclei at top_p <= 0.95 are usually far smaller; the constants only trade the cost of a topk
# against how often the next step runs. [16, 49152], one thread, Zen 4 EPYC (2026-12-06,
# benchmarks/bench_sampler.py): topk 1024 7.6 ms, topk 8192 15.2 ms, a full sort 57.5 ms; flat
# rows (a small model on an odd prompt, top_p 0.95) took the sort every step before the second
# window.
NUCLEUS_WINDOW = 1024
NUCLEUS_WIDE_WINDOW = 8192


@dataclass
class SamplingBatch:
    """What the sampler needs to know about each row of the logits."""

    params: list[SamplingParams]  # one per row
    # Per-row generator for seeded requests; None = the sampler's shared default generator.
    generators: list[torch.Generator | None]
    # Per row: token ids forbidden this step (EOS / stop ids while min_tokens is not reached).
    banned_token_ids: list[list[int]]
    # Per row, for the penalties and bad words: the tokens generated before this row, and (for a
    # repetition penalty) the prompt. None for the whole batch, or a row, that needs none.
    output_token_ids: list[list[int] | None] | None = None
    prompt_token_ids: list[list[int] | None] | None = None
    # Rows constrained by a grammar, and their packed allowed-token bitmask ([len(rows), ceil(V/32)]
    # int32, bit b of word w = token 32w + b; see minserve/structured).
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # The engine's custom logits processors, bound to this batch's rows (engine/logits_batch.py):
    # called as ``logits_processors(logits, params)``, returns a processed copy. None: none run.
    logits_processors: Callable[[torch.Tensor, list[SamplingParams]], torch.Tensor] | None = None

    @classmethod
    def for_requests(cls, reqs: list, proposed_before: list[list[int]], grammar=None,
                     logits_processors=None) -> "SamplingBatch":
        """The batch for logits rows drawn for ``reqs`` (one request per row, a request once per
        row it owns): each row's params, generator and :func:`banned_tokens`, and the fields of the
        logits controls, built only for the rows that use them (a plain batch builds nothing).
        ``proposed_before``: per row, the proposals a verify step puts before it, which count as
        output for that row's bans and penalties. ``grammar``: the engine's GrammarBackend, which
        fills the bitmask of grammar-constrained rows."""
        # Greedy rows draw nothing: no generator built for them (a seeded greedy request is common).
        generators = [None if r.params.is_greedy else position_generator(r, len(r.output_token_ids) + len(ahead))
                      for r, ahead in zip(reqs, proposed_before)]
        batch = cls(params=[r.params for r in reqs], generators=generators,
                    banned_token_ids=[banned_tokens(r, len(ahead)) for r, ahead in zip(reqs, proposed_before)],
                    logits_processors=logits_processors)
        if any(needs_output_ids(r.params) for r in reqs):
            batch.output_token_ids = [r.output_token_ids + ahead if needs_output_ids(r.params) else None
                                      for r, ahead in zip(reqs, proposed_before)]
            batch.prompt_token_ids = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else None
                                      for r in reqs]
        rows = [i for i, r in enumerate(reqs) if r.params.structured_outputs is not None]
        if rows:
            # The matcher only knows final tokens; proposals are never made for such requests.
            if any(proposed_before[i] for i in rows):
                raise ValueError("structured_outputs requests take no speculative proposals")
            batch.grammar_rows = rows
            batch.grammar_bitmask = grammar.fill_bitmask([reqs[i] for i in rows])
        return batch


def banned_tokens(req, ahead: int = 0) -> list[int]:
    """Until ``min_tokens`` are out, the tokens that would stop the request may not be sampled
    (``ahead``: the row's place in a verify step, i.e. outputs it has before that row)."""
    if len(req.output_token_ids) + ahead >= req.params.min_tokens:
        return []
    stops = list(req.params.stop_token_ids)
    if not req.params.ignore_eos:
        stops += req.eos_token_ids
    return stops


@dataclass
class SamplerOutput:
    token_ids: list[int]  # sampled token per row
    # Per row: [(sampled_id, logprob), then the top-N (id, logprob) in rank order]. The sampled
    # token comes first and may appear again in the top-N (as in vLLM). Rows whose params have
    # ``logprobs=None`` get []. The whole field is None when no row asked.
    logprobs: list[list[tuple[int, float]]] | None
    # Rank (1 = best) of each row's sampled token in the raw distribution; None when no row asked
    # for logprobs (computed for every row otherwise, it costs one comparison).
    ranks: list[int] | None
    # The logits after the controls (penalties, biases, bans, grammar mask) when a row used one,
    # else None (the input is what was sampled from): the target distribution for verification.
    controlled_logits: torch.Tensor | None = None
    # Rows whose logits controls left no token that may be sampled: row -> which controls (e.g.
    # "allowed_token_ids and min_tokens together leave no token that may be sampled"). Their
    # entry in ``token_ids`` is meaningless; the caller fails their requests.
    failed_rows: dict[int, str] = field(default_factory=dict)


def make_generator(params: SamplingParams,
                   device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for a seeded request (None for unseeded ones).

    The engine creates it once per request and keeps it across steps. The sampler does not draw
    from it (each token's noise has a generator of its own, draws.position_generator); the draft
    method does, as one stream (spec/draft.py's proposals, spec/verify.py's rejection sampling).
    """
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


class Sampler:
    """Stateless apart from the shared generator used by unseeded random rows."""

    def __init__(self, default_generator: torch.Generator | None = None):
        # None falls back to torch's global RNG (torch.manual_seed controls it).
        self.default_generator = default_generator

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V]; ``logits`` is never modified."""
        _check_batch(logits, batch)
        raw = logits if logits.dtype == torch.float32 else logits.float()  # never modified below
        params, banned = batch.params, batch.banned_token_ids
        # A copy when some row uses a control (raw stays the model's: logprobs come from it).
        failed: dict[int, str] = {}
        work = raw
        if batch.logits_processors is not None:
            work = batch.logits_processors(raw, params)
            _fail_empty_rows(work, failed)
        work = apply_logits_controls(work, params, batch.output_token_ids, batch.prompt_token_ids,
                                     batch.grammar_rows, batch.grammar_bitmask, banned, dead_rows=failed)
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]

        if not random_rows:  # common fast path (temperature=0 everywhere): no softmax, no RNG
            tokens = _greedy(work, banned)
        else:
            tokens = torch.empty(raw.shape[0], dtype=torch.long, device=raw.device)
            if greedy_rows:
                tokens[greedy_rows] = _greedy(work[greedy_rows], [banned[i] for i in greedy_rows])
            sub = work[random_rows]  # advanced indexing copies: safe to modify in place
            ban_tokens_(sub, [banned[i] for i in random_rows])
            tokens[random_rows] = self._sample(
                sub, [params[i] for i in random_rows], [batch.generators[i] for i in random_rows])

        token_list = tokens.tolist()
        controlled = work if work is not raw else None
        if all(p.logprobs is None for p in params):
            return SamplerOutput(token_ids=token_list, logprobs=None, ranks=None, controlled_logits=controlled,
                                 failed_rows=failed)
        logprobs, ranks = gather_logprobs(raw, tokens, params)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs, ranks=ranks, controlled_logits=controlled,
                             failed_rows=failed)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """Draw one token per row of ``logits`` [R, V] (a copy the caller does not reuse)."""
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                             device=logits.device)
        logits.div_(temps.unsqueeze(1))
        apply_min_p(logits, params)
        apply_top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        if probs.device.type == "cpu":
            return inverse_cdf(probs, self._uniforms(len(generators), generators))
        q = self._exponentials(probs, generators)
        # No renormalization needed anywhere above: the race is invariant to scaling a row.
        return _argmax_rows(probs.div_(q))

    def _uniforms(self, rows: int, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One float64 uniform in [0, 1) per row: the shared generator's in one call for the
        unseeded rows, each seeded row's from its own generator."""
        u = torch.empty(rows, dtype=torch.float64)
        shared = [j for j, g in enumerate(generators) if g is None]
        if shared:
            u[shared] = torch.rand(len(shared), dtype=torch.float64, generator=self.default_generator)
        for j, gen in enumerate(generators):
            if gen is not None:
                u[j] = torch.rand((), dtype=torch.float64, generator=gen)
        return u

    def _exponentials(self, probs: torch.Tensor,
                      generators: list[torch.Generator | None]) -> torch.Tensor:
        q = torch.empty_like(probs)
        shared = [j for j, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            q.exponential_(generator=self.default_generator)
        elif shared:
            q[shared] = torch.empty((len(shared), q.shape[1]), dtype=q.dtype,
                                    device=q.device).exponential_(generator=self.default_generator)
        for j, gen in enumerate(generators):
            if gen is not None:
                # One V-sized draw from this row's own stream: same numbers whatever the batch.
                q[j].exponential_(generator=gen)
        # exponential_ can return exactly 0 (-log1p(-u) with u = 0); 0/0 would be NaN, and argmax
        # treats NaN as the maximum, so a zero-probability token could win. Clamping keeps the
        # race exact for every token with p > 0.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _fail_empty_rows(logits: torch.Tensor, failed: dict[int, str]) -> None:
    """Rows the logits processors left without a finite logit fail (their requests alone): they
    are zeroed so that the rest of the batch samples as usual, and their token is dropped."""
    empty = (logits.amax(dim=-1) == float("-inf")).nonzero().squeeze(1).tolist()
    if empty:
        logits[empty] = 0.0
        failed.update((i, "the logits processors leave no token that may be sampled") for i in empty)


def _check_batch(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must have shape [batch, vocab] with vocab >= 1, "
                         f"got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    for name in ("params", "generators", "banned_token_ids", "output_token_ids", "prompt_token_ids"):
        if getattr(batch, name) is None:
            continue
        n = len(getattr(batch, name))
        if n != rows:
            raise ValueError(f"batch.{name} must have one entry per logits row ({rows}), got {n}")
    for i, banned in enumerate(batch.banned_token_ids if any(batch.banned_token_ids) else ()):
        if any(t < 0 or t >= vocab for t in banned):
            raise ValueError(f"banned_token_ids[{i}] must be in [0, {vocab - 1}], got {banned}")
        # With every token banned there is nothing valid to pick; argmax would silently return 0.
        if len(set(banned)) == vocab:
            raise ValueError(f"banned_token_ids[{i}] must leave at least one of the {vocab} "
                             f"tokens allowed, got all of them banned")
    if batch.grammar_rows and (batch.grammar_bitmask is None
                               or batch.grammar_bitmask.shape[0] != len(batch.grammar_rows)):
        raise ValueError("batch.grammar_bitmask must have one packed row per entry of batch.grammar_rows")


def ban_tokens_(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """In place: in row ``i`` of ``logits`` [R, V], the ids ``banned[i]`` -> -inf (so they get
    probability 0 and never win an argmax). Step 4 of the module's order; speculative
    verification (spec/verify.py) applies it to the target rows the same way."""
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    if rows:
        logits[rows, [t for ids in banned for t in ids]] = float("-inf")


def _greedy(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """Argmax per row, never a banned id, without copying ``logits`` (it may be the caller's)."""
    tokens = _argmax_rows(logits)
    if not any(banned):
        return tokens
    # A ban only matters when it hits the argmax: redo just those rows, on a copy, bans applied.
    redo = [i for i, t in enumerate(tokens.tolist()) if banned[i] and t in banned[i]]
    if redo:
        sub = logits[redo]
        ban_tokens_(sub, [banned[i] for i in redo])
        tokens[redo] = _argmax_rows(sub)
    return tokens


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, the same index in every case (the first maximum; a NaN counts as
    the maximum). A CPU float32 row goes through numpy, whose single-threaded vectorized argmax
    costs a fraction of torch's dispatch, paid by every greedy token (tests/test_step_overhead.py
    checks both agree, ties, infinities and NaNs included)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: set to -inf the tokens outside each row's top-k, then outside its top-p nucleus
    (row ``j`` by ``params[j]``).

    Rows with top-p and no top-k go to kernels/nucleus.c where it applies (float32 on the CPU): it
    bins each row and sorts only the bin where the nucleus ends, 3-25x faster than the windows
    below (benchmarks/bench_sampler.py). Otherwise, since a full sort of [R, V] costs ~25x a
    ``topk`` of 1024 on CPU, rows are processed in a window
    of their best tokens: exactly ``top_k`` of them when top-k is on, else ``NUCLEUS_WINDOW``
    (then ``NUCLEUS_WIDE_WINDOW``, then a full sort, for the rare row whose nucleus is wider). Rows are grouped by
    window size and the size never depends on other rows, so a row's result does not depend on
    the batch it is in (needed for seeded reproducibility). Top-k keeps exactly k tokens; ties at
    the k-th value are broken by ``topk`` (vLLM keeps all tied tokens: rare with float logits).
    """
    vocab = logits.shape[1]
    nucleus_window = (min(NUCLEUS_WINDOW, vocab), False)
    windows: dict[tuple[int, bool], list[int]] = {}
    for j, p in enumerate(params):
        if 0 < p.top_k < vocab:
            windows.setdefault((p.top_k, True), []).append(j)
        elif p.top_p < 1.0:
            windows.setdefault(nucleus_window, []).append(j)
    top_p_only = windows.get(nucleus_window, [])
    if top_p_only and nucleus.top_p_(logits, top_p_only, [params[j].top_p for j in top_p_only]):
        del windows[nucleus_window]   # the C filter took the top-p-only rows
    for (window, is_top_k), rows in windows.items():
        wide = _truncate_rows(logits, rows, window, is_top_k, params)
        if wide and window < NUCLEUS_WIDE_WINDOW < vocab:
            wide = _truncate_rows(logits, wide, NUCLEUS_WIDE_WINDOW, False, params)
        if wide:
            _truncate_rows(logits, wide, vocab, False, params)


def _truncate_rows(logits: torch.Tensor, rows: list[int], window: int, is_top_k: bool,
                   params: list[SamplingParams]) -> list[int]:
    """Keep, in each of ``rows``, the best ``window`` tokens intersected with the top-p nucleus.

    Returns the rows left untouched because their nucleus may extend past the window.
    """
    sub = logits[rows]
    vocab = sub.shape[1]
    if window < vocab:
        vals, idx = sub.topk(window, dim=-1)  # sorted, best first
    else:
        vals, idx = sub.sort(dim=-1, descending=True)
    keep = list(range(len(rows)))
    ps = [params[j].top_p for j in rows]
    if any(p < 1.0 for p in ps):
        # With top-k on, the distribution is renormalized over the k kept tokens (top-k first,
        # then top-p, as in vLLM); otherwise the probabilities are those of the full row.
        lse = (vals if is_top_k else sub).logsumexp(dim=-1, keepdim=True)
        probs = (vals - lse).exp()
        cum = probs.cumsum(dim=-1)
        # top_p = 1 must never drop a token, even if rounding pushes a cumulative sum past 1.
        top_p = torch.tensor([p if p < 1.0 else float("inf") for p in ps],
                             dtype=sub.dtype, device=sub.device).unsqueeze(1)
        # Drop a token when the tokens above it already reach top_p. The top token has nothing
        # above it, so it always stays and a tiny top_p degrades to greedy, never to nothing.
        vals.masked_fill_(cum - probs >= top_p, float("-inf"))
        if not is_top_k and window < vocab:
            # The nucleus fits in the window iff the window's own mass reaches top_p.
            keep = (cum[:, -1:] >= top_p).squeeze(1).nonzero().squeeze(1).tolist()
    out = torch.full_like(sub, float("-inf")).scatter_(1, idx, vals)
    if len(keep) == len(rows):
        logits[rows] = out
    elif keep:
        logits[[rows[i] for i in keep]] = out[keep]
    kept = set(keep)
    return [rows[i] for i in range(len(rows)) if i not in kept]


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place, row ``j`` by ``params[j]`` (temperature already applied): drop tokens whose probability is below ``min_p * max(prob)`` in each row that
    sets min_p. In logit space that is ``logit < max_logit + log(min_p)``: no softmax needed."""
    rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if not rows:
        return
    sub = logits[rows]
    log_min_p = torch.tensor([math.log(params[j].min_p) for j in rows], dtype=sub.dtype, device=sub.device)
    threshold = sub.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
    logits[rows] = sub.masked_fill_(sub < threshold, float("-inf"))


def gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
                    ) -> tuple[list[list[tuple[int, float]]], list[int]]:
    """From the raw logits ``raw`` [R, V] and each row's chosen token ``tokens`` [R]: per row that
    asks for logprobs (``params[i].logprobs``), ``[(token, logprob), then the top-N (id, logprob)
    best first]`` ([] for the others), and every row's rank of its token (1 = most likely). The
    layout of :class:`SamplerOutput` and of ``SampledToken``."""
    chosen = raw.gather(1, tokens.unsqueeze(1))
    # Rank from the raw logits: log_softmax is monotone, so this is the rank in the distribution,
    # and comparing logits avoids a softmax over rows that did not ask for logprobs.
    ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs = torch.log_softmax(raw[asking], dim=-1)
    sampled_lp = logprobs.gather(1, tokens[asking].unsqueeze(1)).squeeze(1).tolist()
    top_n = min(max(params[i].logprobs for i in asking), raw.shape[1])
    if top_n > 0:
        top_vals, top_ids = logprobs.topk(top_n, dim=-1)  # sorted, best first
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[list[tuple[int, float]]] = [[] for _ in params]
    token_list = tokens.tolist()
    for j, i in enumerate(asking):
        n = min(params[i].logprobs, top_n)
        row = [(token_list[i], sampled_lp[j])]
        if n > 0:
            row += list(zip(top_ids[j][:n], top_vals[j][:n]))
        out[i] = row
    return out, ranks
