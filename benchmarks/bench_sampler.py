"""What sampling costs on this CPU: the noise, the filters, one sampler call, and decode throughput.

    .venv/bin/python benchmarks/bench_sampler.py            # everything (~4 min on 2 cores)
    .venv/bin/python benchmarks/bench_sampler.py --no-decode

Parts (one thread unless said, SmolLM2's 49,152-token vocabulary):
- noise: ``Tensor.exponential_`` over one row (what the exponential race needs per sampled row)
  against one row's inverse-CDF draw (``engine/draws.py``: ``draw_token``) and
  ``torch.multinomial``;
- filters: ``topk`` of 1,024 and 8,192 and a full sort over 16 rows (``sampler.NUCLEUS_WINDOW``,
  ``NUCLEUS_WIDE_WINDOW``); the top-p filter (``sampler.apply_top_k_top_p``, top_p 0.95) over 16
  rows from peaked to flat, in kernels/nucleus.c and in the torch windows
  (``MINSERVE_SAMPLER_FILTERS=torch``);
- sampler: one ``Sampler`` call over 16 rows, by parameters (temperature, flat top-p, top-k),
  the CPU's inverse CDF against the exponential race on the same rows;
- decode: 16 requests of 32 prompt and 96 output tokens, temperature 0.8 (unseeded and seeded),
  through the engine with the race and with the inverse CDF, alternating in one process, and
  greedy beside them (tok/s, every round printed); then temperature 0.8 with top_p 0.95, the
  filter in C and in the torch windows, alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import minserve.engine.sampler as sampler_mod
from bench_roofline import _median_time   # one warm-up call, then the median
from minserve.engine.draws import draw_token
from minserve.engine.sampler import Sampler, SamplingBatch
from minserve.sampling_params import SamplingParams

VOCAB = 49152
ROWS = 16
FILTERS_ENV = "MINSERVE_SAMPLER_FILTERS"


def ms(fn, n: int = 30) -> float:
    """Median milliseconds of ``fn()`` over ``n`` calls, after one unmeasured call."""
    return _median_time(fn, n) * 1e3


def race_sample(self, logits, params, generators):
    """The exponential race on every device: the CPU's draw until 2026-12-06."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits.div_(temps.unsqueeze(1))
    sampler_mod.apply_min_p(logits, params)
    sampler_mod.apply_top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    return sampler_mod._argmax_rows(probs.div_(self._exponentials(probs, generators)))


def noise_and_filters() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    row, p = torch.empty(VOCAB), torch.randn(VOCAB).softmax(-1)
    print(f"one row, one thread: exponential_ {ms(lambda: row.exponential_(generator=g)):.2f} ms, "
          f"draw_token {ms(lambda: draw_token(p, g)):.3f} ms, "
          f"multinomial {ms(lambda: torch.multinomial(p, 1, generator=g)):.3f} ms")
    x = torch.randn(ROWS, VOCAB) * 3
    print(f"{ROWS} rows, one thread: topk 1024 {ms(lambda: x.topk(1024, dim=-1), 10):.1f} ms, "
          f"topk 8192 {ms(lambda: x.topk(8192, dim=-1), 10):.1f} ms, "
          f"sort {ms(lambda: x.sort(dim=-1, descending=True), 10):.1f} ms")


def with_filters(choice: str, fn):
    """``fn()`` with the sampler's top-p filter in C ("c") or in the torch windows ("torch")."""
    before = os.environ.get(FILTERS_ENV)
    os.environ[FILTERS_ENV] = choice
    try:
        return fn()
    finally:
        if before is None:
            os.environ.pop(FILTERS_ENV, None)
        else:
            os.environ[FILTERS_ENV] = before


def top_p_filters() -> None:
    torch.set_num_threads(1)
    params = [SamplingParams(temperature=1.0, top_p=0.95)] * ROWS
    for name, scale in (("peaked rows (randn x 8)", 8.0), ("randn x 3", 3.0), ("flat rows (randn x 0.5)", 0.5)):
        x = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(1)) * scale
        y = torch.empty_like(x)
        copy = ms(lambda: y.copy_(x), 10)
        out = {c: with_filters(c, lambda: ms(lambda: sampler_mod.apply_top_k_top_p(y.copy_(x), params), 10)) - copy
               for c in ("c", "torch")}
        kept = statistics.median((y > float("-inf")).sum(dim=1).tolist())
        print(f"top_p 0.95 filter, {ROWS} rows, one thread, {name}: C {out['c']:.2f} ms, "
              f"torch windows {out['torch']:.2f} ms ({kept:.0f} tokens kept a row)")


def sampler_calls() -> None:
    torch.set_num_threads(1)
    logits = torch.randn(ROWS, VOCAB) * 3   # flat rows: a wide top-p nucleus
    new = Sampler._sample
    for name, kw in (("temperature 0.8", dict(temperature=0.8)),
                     ("top_p 0.95 (flat rows)", dict(temperature=0.8, top_p=0.95)),
                     ("top_k 50", dict(temperature=0.8, top_k=50))):
        batch = SamplingBatch([SamplingParams(**kw)] * ROWS, [None] * ROWS, [[] for _ in range(ROWS)])
        s = Sampler(torch.Generator().manual_seed(0))
        out = {}
        for label, fn in (("race", race_sample), ("inverse cdf", new)):
            Sampler._sample = fn
            out[label] = ms(lambda: s(logits, batch), 10)
        Sampler._sample = new
        print(f"sampler, {ROWS} rows, one thread, {name}: race {out['race']:.1f} ms, "
              f"inverse cdf {out['inverse cdf']:.1f} ms")


def decode(dtype: str, rounds: int) -> None:
    from minserve import LLM
    torch.set_num_threads(2)
    llm = LLM("smollm2-135m", dtype=dtype, max_num_seqs=ROWS, max_num_batched_tokens=512, num_kv_blocks=256)
    prompts = [{"prompt_token_ids": [1000 + 37 * i + k for k in range(32)]} for i in range(ROWS)]
    greedy = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)] * ROWS
    new = Sampler._sample
    for seeded in (False, True):
        sampled = [SamplingParams(temperature=0.8, max_tokens=96, ignore_eos=True,
                                  seed=i if seeded else None) for i in range(ROWS)]
        res: dict[str, list[float]] = {"race": [], "inverse cdf": [], "greedy": []}
        for _ in range(rounds):
            for label, fn, params in (("race", race_sample, sampled), ("inverse cdf", new, sampled),
                                      ("greedy", new, greedy)):
                Sampler._sample = fn
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                res[label].append(ROWS * 96 / (time.perf_counter() - t))
        Sampler._sample = new
        print(f"decode {dtype}, {'seeded' if seeded else 'unseeded'}, temperature 0.8, tok/s: "
              + "; ".join(f"{k} {', '.join(f'{v:.0f}' for v in vs)} (median {statistics.median(vs):.0f})"
                          for k, vs in res.items()), flush=True)
    top_p = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96, ignore_eos=True)] * ROWS
    res = {"C": [], "torch windows": []}
    for _ in range(rounds):
        for label, choice in (("C", "c"), ("torch windows", "torch")):
            t = time.perf_counter()
            with_filters(choice, lambda: llm.generate(prompts, top_p, use_tqdm=False))
            res[label].append(ROWS * 96 / (time.perf_counter() - t))
    print(f"decode {dtype}, temperature 0.8, top_p 0.95, tok/s: "
          + "; ".join(f"filter in {k} {', '.join(f'{v:.0f}' for v in vs)} (median {statistics.median(vs):.0f})"
                      for k, vs in res.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-decode", action="store_true", help="skip the engine runs")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the engine runs")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    noise_and_filters()
    top_p_filters()
    sampler_calls()
    if not args.no_decode:
        for dtype in args.dtypes.split(","):
            decode(dtype, args.rounds)


if __name__ == "__main__":
    main()
