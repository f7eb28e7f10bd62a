"""Which proposed tokens a verify step keeps.

A verify step computes the model's logits at the last token and at each of the k proposals, and
the sampler draws one token per row with the request's own parameters (and generator). Row i's
token is what the model would have produced after the proposals before it. The rule: keep
proposals while each equals the token drawn at its row; the first row that disagrees contributes
its own draw instead, and if all k agree, the last row's draw is a bonus token.

Why this is exact for proposals that carry no distribution (n-gram lookup, an oracle): treat the
proposal d as one-hot. Rejection sampling accepts d with probability min(1, p(d) / 1) = p(d) and
otherwise samples from p with d removed and renormalized. Drawing x ~ p and keeping d iff x == d
gives exactly that: P(keep) = p(d), and a rejected x is p restricted to x != d. Greedy rows are
the special case p = one-hot(argmax). Proposals that come with a draft distribution need the
general rule (min(1, p/q) and the residual max(0, p - q)); that lives beside this one.
"""

from __future__ import annotations

import torch

from minserve.engine.draws import draw_token
from minserve.engine.sampler import apply_min_p, apply_top_k_top_p, ban_tokens_, gather_logprobs
from minserve.engine.step_io import SampledToken


def accept_one_hot(proposals: list[int], drawn: list[int]) -> int:
    """How many rows' draws the request keeps: ``drawn`` has one token per row (len(proposals) + 1);
    the answer n (1 <= n <= k + 1) means ``drawn[:n]`` are its new tokens, the first n - 1 of them
    equal to the proposals they confirmed."""
    assert len(drawn) == len(proposals) + 1, "one drawn token per proposal, plus the bonus row"
    n = 0
    while n < len(proposals) and drawn[n] == proposals[n]:
        n += 1
    return n + 1


def rejection_sample(target_probs, draft_probs, proposals: list[int], generator=None) -> list[int]:
    """The general rule, for proposals drawn from a draft distribution q (a draft model).

    ``target_probs`` [k + 1, V]: the target's distribution at each row (after temperature, top-k,
    top-p); ``draft_probs`` [k, V]: the draft's at each proposal. Proposal i is kept with
    probability min(1, p_i(d) / q_i(d)); the first one refused is replaced by a draw from the
    residual max(0, p_i - q_i), normalized, and the rest are dropped; if all are kept, a bonus
    token is drawn from p_k. Whatever q is, each returned token is distributed exactly as the
    target would have sampled it (Leviathan et al. 2023; Chen et al. 2023): accepting d and
    drawing from the residual together give P(x) = min(p, q)(x) + (1 - sum min(p, q)) *
    residual(x) = p(x). Returns the tokens (1 to k + 1)."""
    out: list[int] = []
    for i, d in enumerate(proposals):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if q[d] > 0 and u * q[d] <= p[d]:   # u < p/q without dividing (q may be tiny)
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p  # p == q: nothing to correct (cannot refuse)
        out.append(draw_token(dist, generator))
        return out
    out.append(draw_token(target_probs[len(proposals)], generator))
    return out


def sampling_probs(logits: torch.Tensor, params: list, banned: list[list[int]]) -> torch.Tensor:
    """The distribution the sampler draws each row from (engine/sampler.py, same order): bans,
    temperature, min-p, top-k, top-p, softmax. [R, V] fp32; ``logits`` is not modified. Rejection
    sampling needs the target's p explicitly, where the sampler only needs to draw from it."""
    x = logits.float().clone()
    ban_tokens_(x, banned)
    x.div_(torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device).unsqueeze(1))
    apply_min_p(x, params)
    apply_top_k_top_p(x, params)
    return x.softmax(dim=-1)


def verify_with_draft(logits: torch.Tensor, params, banned: list[list[int]], proposals: list[int],
                      draft_probs: torch.Tensor, generator, raw: torch.Tensor | None = None
                      ) -> list[SampledToken]:
    """A sampled request's verify step against a draft distribution: ``logits`` [k + 1, V] are the
    target's rows (after penalties and biases, when the request has any), ``draft_probs`` [>= k, V]
    the q each proposal was drawn from. Returns the kept tokens with their logprobs, when asked,
    from ``raw`` (the model's logits, as the sampler reports them; default ``logits``)."""
    k = len(proposals)
    target = sampling_probs(logits, [params] * (k + 1), banned)
    tokens = rejection_sample(target, draft_probs[:k], proposals, generator)
    if params.logprobs is None:
        return [SampledToken(t, None, None) for t in tokens]
    raw = logits if raw is None else raw
    chosen = torch.tensor(tokens, dtype=torch.long, device=raw.device)
    logprobs, ranks = gather_logprobs(raw[:len(tokens)].float(), chosen, [params] * len(tokens))
    return [SampledToken(t, lp, r) for t, lp, r in zip(tokens, logprobs, ranks)]
