"""Lab 04 (prefix caching): block-sized hits, tokens saved, hit rate, and the TTFT side channel."""

from __future__ import annotations

import math

import numpy as np

from minserve.lab.checks import ChoiceCheck, FunctionCheck, Mistake, NumberCheck, _fmt
from minserve.lab.sidechannel import u_statistic


def q1_cached_tokens(common_tokens: int, block_size: int, prompt_tokens: int, measured: int) -> NumberCheck:
    """Prompt tokens the warm request got from the cache: whole blocks of the shared start only,
    and never the last prompt token (its logits are needed to sample)."""
    C, bs, P = common_tokens, block_size, prompt_tokens
    usable = min(C, P - 1)
    return NumberCheck(
        "Exercise 1", measured, unit="tokens", integer=True,
        tolerance_why="a count of tokens, the same on every machine",
        hint=f"the two prompts share their first {C} token ids. The cache stores and looks up whole "
             f"blocks of {bs} tokens, each keyed by its own tokens and everything before it. How "
             "many whole blocks fit in the shared part?",
        solution="answer = block_size * (min(C, P - 1) // block_size)",
        namespace={"C": C, "block_size": bs, "P": P},
        explanation=f"{usable // bs} whole blocks of {bs}: the {usable % bs} shared tokens after "
                    "them sit in a block that also holds the new question's tokens, so its key "
                    "differs and that block is computed again.",
        mistakes=_q1_mistakes(C, bs, P, usable))


def _q1_mistakes(C: int, bs: int, P: int, usable: int) -> list[Mistake]:
    out = []
    if usable % bs:
        out.append(Mistake(f"the prompts share {C} tokens, but the cache works in whole blocks of "
                           f"{bs}: the last, partly shared block has a different key and is "
                           "computed again.", test=lambda a: a in (C, usable)))
        out.append(Mistake("that rounds up: the block that holds both the end of the system "
                           "prompt and the start of the question is not in the cache under this "
                           "request's key.", value=-(-usable // bs) * bs, rel_tol=0.0))
    out.append(Mistake("that is the whole prompt; only the shared start can come from the cache, "
                       "and at least the last prompt token is always computed.", value=P, rel_tol=0.0))
    out.append(Mistake("the first request put the system prompt's blocks in the cache; the second "
                       "starts with the same tokens, so it finds them.", value=0, rel_tol=0.0))
    return out


def q2_tokens_saved(run, per_request_hit: int) -> NumberCheck:
    """Prompt tokens of the shared-prefix run served from the cache (prefill work skipped)."""
    rq, st = run.requests, run.steps
    hits = int(st.prefix_cache_hits.sum())
    queries = int(st.prefix_cache_queries.sum())
    n = len(rq)
    with_hits = int((rq.cached_tokens > 0).sum())
    return NumberCheck(
        "Exercise 2", hits, unit="tokens", integer=True,
        tolerance_why="a count of tokens from the engine's records",
        hint="the engine counts hits in tokens: per step in steps.prefix_cache_hits, per request "
             "in requests.cached_tokens. Which requests found the prefix, and how much of it?",
        solution="answer = int(shared_run.requests.cached_tokens.sum())\n"
                 "# the same as shared_run.steps.prefix_cache_hits.sum()",
        namespace=lambda: {"shared_run": run},
        explanation="Each hit is a prompt token whose keys and values were reused instead of computed.",
        mistakes=_q2_mistakes(n, with_hits, queries, per_request_hit))


def _q2_mistakes(n: int, with_hits: int, queries: int, per_request_hit: int) -> list[Mistake]:
    out = [Mistake(f"{with_hits} is the number of requests that hit; the question asks for tokens. "
                   "Counting cache entries instead of tokens saved hides how much prefill a hit "
                   "actually skipped.", value=with_hits, rel_tol=0.0),
           Mistake(f"that is the queries counter: all {queries} prompt tokens looked up. Hits are "
                   "the part of them found in the cache.", value=queries, rel_tol=0.0)]
    if n - with_hits > 1:
        out.append(Mistake(
            f"that assumes only the first request missed. Look at cached_tokens: {n - with_hits} "
            "requests missed. Those admitted in the same step as the first looked the prefix up "
            "before the first had computed it, and a block only enters the cache once it has "
            "been computed.", value=(n - 1) * per_request_hit, rel_tol=0.0))
    out.append(Mistake("that counts a hit for every request; the very first one found an empty "
                       "cache.", value=n * per_request_hit, rel_tol=0.0))
    return out


def q3_hit_rate(run) -> NumberCheck:
    """Token hit rate of the shared-prefix run: hits / queries."""
    rq, st = run.requests, run.steps
    hits, queries = float(st.prefix_cache_hits.sum()), float(st.prefix_cache_queries.sum())
    rate = hits / queries
    by_requests = float((rq.cached_tokens > 0).mean())
    return NumberCheck(
        "Exercise 3", rate, unit="", abs_tol=0.01,
        tolerance_why="rounding to two decimals is fine",
        hint="vLLM's hit rate is in tokens: the hits counter divided by the queries counter "
             "(both are columns of shared_run.steps).",
        solution="st = shared_run.steps\n"
                 "answer = st.prefix_cache_hits.sum() / st.prefix_cache_queries.sum()",
        namespace=lambda: {"shared_run": run},
        explanation="A fraction of prompt tokens, between 0 and 1: the share of prefill the "
                    "cache saved in this workload.",
        mistakes=[
            Mistake("that is the share of *requests* that hit. A request that found one block and "
                    "one that found twenty count alike there; the token rate weighs them by the "
                    "work saved.", value=by_requests, rel_tol=0.01),
            Mistake("that looks like a percentage; give the rate as a fraction between 0 and 1.",
                    value=100 * rate, rel_tol=0.02),
            Mistake("that is the inverse (queries / hits); the rate is hits / queries.",
                    value=1 / rate if rate else math.nan, rel_tol=0.02),
        ])


def guess_table(probes, candidates) -> "object":
    """One row per candidate: its probe's TTFT (ms) and cached tokens."""
    df = probes.copy()
    df["candidate"] = list(candidates)
    df["TTFT (ms)"] = df.ttft_s * 1000
    return df[["candidate", "TTFT (ms)", "cached_tokens"]].reset_index(drop=True)


def q4_which_memo(guess, truth: str) -> ChoiceCheck:
    """Which candidate memo did the victim send? ``guess``: :func:`guess_table`'s frame. Every
    option's text is worked out from this run's timings and cached-token counts, so it cannot
    call a slower probe "faster"."""
    ttft = {r["candidate"]: float(r["TTFT (ms)"]) for _, r in guess.iterrows()}
    cached = {r["candidate"]: int(r["cached_tokens"]) for _, r in guess.iterrows()}
    fastest = min(ttft, key=ttft.get)
    others = [v for k, v in ttft.items() if k != truth]
    rest = float(np.median(others)) if others else math.nan
    options = {}
    for name, t in ttft.items():
        if name == truth:
            if name == fastest:
                timing = (f"its probe answered in {t:.0f} ms, {times_word(t, rest)} than the others' "
                          f"median ({rest:.0f} ms)")
            else:
                timing = (f"its probe took {t:.0f} ms, not the fastest this run ({fastest} took "
                          f"{ttft[fastest]:.0f} ms: the machine was busy at that moment), yet")
            options[name] = (f"{timing}: {cached[name]} of its prompt tokens were already in the "
                             "cache, and only the victim could have put them there.")
        else:
            found = ("nothing of it was cached, so nobody had sent it" if cached[name] == 0 else
                     f"{cached[name]} of its tokens were cached")
            options[name] = (f"its probe took {t:.0f} ms: {found}. Look for the probe that skipped "
                             "its prefill.")
    return ChoiceCheck(
        "Exercise 4", truth, options=options,
        hint="a cached prefix is not prefilled again. Which probe got its first token clearly "
             "sooner than the others?",
        solution='answer = guess.loc[guess["TTFT (ms)"].idxmin(), "candidate"]',
        namespace=lambda: {"guess": guess})


def times_word(t: float, ref: float) -> str:
    """How ``t`` compares with ``ref`` (two durations), in words that follow from the numbers:
    "3.1x faster", "1.2x slower", or "as fast" when they are within 5 %."""
    if not (math.isfinite(t) and math.isfinite(ref)) or t <= 0 or ref <= 0:
        return "not comparable"
    if abs(t / ref - 1) < 0.05:
        return "about as fast"
    return f"{ref / t:.1f}x faster" if t < ref else f"{t / ref:.1f}x slower"


def leak_causes(hit_s, miss_s, hit_cached) -> list[str]:
    """What this run measured that can hide the leak: probes of sent memos that found nothing in
    the cache (evicted, or the victim's request failed), and probes of sent memos slower than
    the fastest probe of an unsent one (a busy moment slowed them)."""
    hit, miss = np.asarray(hit_s, float), np.asarray(miss_s, float)
    out = []
    empty = int((np.asarray(hit_cached) == 0).sum())
    if empty:
        out.append(f"{empty} of {len(hit)} probes of sent memos found nothing in the cache")
    slow = int((hit >= miss.min()).sum()) if len(miss) else 0
    if slow:
        out.append(f"{slow} of {len(hit)} probes of sent memos took longer than the fastest probe of an "
                   f"unsent memo ({1000 * miss.min():.0f} ms): those probes were slowed by something "
                   "other than their prefill")
    return out


class _UCheck(FunctionCheck):
    """FunctionCheck that recognises the usual slips in computing U."""

    def compare(self, answer, expected):
        ok, why = super().compare(answer, expected)
        if ok or not callable(answer):
            return ok, why
        got = []
        for kwargs, want in expected:
            try:
                got.append((float(answer(**kwargs)), want, kwargs))
            except Exception:  # noqa: BLE001 - the base message already says it raised
                return ok, why
        na_nb = [len(k["a"]) * len(k["b"]) for _, _, k in got]
        if all(abs(g - (m - w)) < 1e-9 for (g, w, _), m in zip(got, na_nb)):
            return False, ("it counts the pairs where a is *smaller* than b: that is U of the other "
                           "sample (len(a) * len(b) - U). U of a counts pairs with x > y.")
        ties = [_tie_pairs(k["a"], k["b"]) for _, _, k in got]
        if all(abs(g - (w - 0.5 * t)) < 1e-9 for (g, w, _), t in zip(got, ties)):
            return False, "ties are left out: a pair with x == y counts one half."
        if all(abs(g - (w + 0.5 * t)) < 1e-9 for (g, w, _), t in zip(got, ties)):
            return False, "a tie counts one half, not one."
        return ok, why


def _tie_pairs(a, b) -> int:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return int((a[:, None] == b[None, :]).sum())


def q5_u_statistic(hit_ms, miss_ms) -> FunctionCheck:
    """The learner's Mann-Whitney U, tried on this run's probe timings and on a case with ties."""
    hit_ms = [round(float(x), 3) for x in hit_ms]
    miss_ms = [round(float(x), 3) for x in miss_ms]
    tie_a, tie_b = [1.0, 2.0, 2.0, 3.0], [2.0, 4.0, 0.5]
    cases = [({"a": hit_ms, "b": miss_ms}, u_statistic(hit_ms, miss_ms)),
             ({"a": miss_ms, "b": hit_ms}, u_statistic(miss_ms, hit_ms)),
             ({"a": tie_a, "b": tie_b}, u_statistic(tie_a, tie_b))]
    return _UCheck(
        "Exercise 5", cases,
        hint="two loops: for every x in a and every y in b, add 1 when x > y and 0.5 when x == y.",
        solution="def answer(a, b):\n"
                 "    return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)",
        namespace={}, abs_tol=1e-9,
        tolerance_why="U is a count of pairs (halves for ties): exact",
        explanation=_u_meaning(cases[0][1], len(hit_ms) * len(miss_ms)))


def _u_meaning(u: float, pairs: int) -> str:
    """What this run's U of the hits says, in words chosen from its value."""
    share = u / pairs if pairs else math.nan
    if share == 0:
        how = "every hit probe was faster than every miss probe"
    elif share < 0.1:
        how = f"a hit probe was the slower one in only {share:.0%} of the pairs"
    elif share < 0.4:
        how = f"a hit probe was the slower one in {share:.0%} of the pairs: hits tend to be faster"
    else:
        how = (f"a hit probe was the slower one in {share:.0%} of the pairs: the timings barely "
               "separate the groups in this run")
    return (f"U of the hits = {_fmt(u)} out of {pairs} pairs: {how}. The rank test turns U into a "
            "p-value.")


def q6_salted(salted_probes, test) -> ChoiceCheck:
    """With per-tenant salts, does the timing still leak? Decided by the mechanism (cross-tenant
    cache hits), with the test's p-value as the evidence a learner reads."""
    hits = int(salted_probes.cached_tokens.sum())
    truth = "no leak" if hits == 0 else "leak"
    p = _fmt(test.p_value)
    if test.significant:
        aside = (f" The test did flag this run (p = {p} < {test.alpha:g}): with identical "
                 f"distributions that happens in {test.alpha:.0%} of runs, and the cached_tokens "
                 "column shows it cannot come from the cache.")
    else:
        aside = f" The test agrees: p = {p}, not significant at alpha = {test.alpha:g}."
    options = {
        "no leak": (f"the attacker's probes found {hits} cached tokens: with different salts no "
                    "block is shared, so a probe of a text the victim sent is timed like one "
                    "nobody sent." + (aside if truth == "no leak" else "")),
        "leak": (f"look at cached_tokens in the salted probes ({hits} in all) and at the test: "
                 f"p = {p}." + (aside if truth == "no leak" else "")),
    }
    return ChoiceCheck(
        "Exercise 6", truth, options=options,
        hint="two things to read: did any attacker probe get tokens from the cache "
             "(cached_tokens), and is the two-sample test still significant?",
        solution='answer = "no leak" if salted.cached_tokens.sum() == 0 else "leak"',
        namespace=lambda: {"salted": salted_probes})
