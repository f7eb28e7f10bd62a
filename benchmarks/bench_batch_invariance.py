"""How far a prompt's first-token log-probabilities move when another prompt shares its step.

A seed fixes a request's random draws, so its tokens repeat exactly when its logits do
(docs/engine/sampling.md). For each engine setting, each short prompt runs alone and then beside a
longer one; the table gives the largest difference over the alone run's top 20 log-probabilities,
in nats, and how many prompts came out bit for bit the same. float32 differs only in the last
bits; settings whose steps take another path by size (bfloat16 prefill tiles for int8/int4 weights,
int8 activations between the fused C step and the PyTorch path) move more; with
``fused_decode=False`` int8 activations do not move in this test.

A second table is the harder case: a seeded request of 150 prompt tokens and 60 sampled ones alone
on one engine, then on a fresh one behind a request that shares its first 70 tokens (a prefix-cache
hit), beside others, in a KV pool small enough that it is preempted and with a token budget that
cuts its prompt elsewhere. There ``fused_decode=False`` is not enough (its chunks of under 16
queries take another attention kernel, float32 products another blocking); ``batch_invariant=True``
is (minserve/engine/batch_invariance.py).

    .venv/bin/python benchmarks/bench_batch_invariance.py [--model smollm2-135m --neighbour-tokens 300]
    .venv/bin/python benchmarks/bench_batch_invariance.py --cost   # what the recipe costs
    .venv/bin/python benchmarks/bench_batch_invariance.py --attention   # decode rows' attention, both kernels

``--cost`` times what batch invariance costs instead: SwiGLU and RoPE in C against PyTorch's at a
few rows (the C kernels take every row count since 2026-12-07), and, for float32, int4 and int4
with int8 activations, decode at batch 1 and 16 and prefill by default, in the batch-invariant
mode (every step in the fused C step since 2026-12-08), and in the mode on the PyTorch path
(``fused_decode=False``; two alternating rounds).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from minserve import LLM, SamplingParams

PROMPTS = ["Invent a word:", "The capital of France is", "def add(a, b):", "Once upon a time",
           "Water boils at", "List three colors:", "My favourite food is", "The quick brown fox"]
A8 = {"quantization": "int4", "quantization_config": {"activations": "int8"}}
SETTINGS = {"float32": {}, "int4": {"quantization": "int4"}, "int4, int8 activations": A8,
            # Every step through the PyTorch path: the batch-invariant recipe (docs/engine/sampling.md).
            "float32, fused_decode=False": {"fused_decode": False},
            "int4, int8 activations, fused_decode=False": {**A8, "fused_decode": False},
            "float32, batch_invariant=True": {"batch_invariant": True},
            "int4, int8 activations, batch_invariant=True": {**A8, "batch_invariant": True}}
CROWD_SETTINGS = {name: SETTINGS[name] for name in (
    "float32", "float32, fused_decode=False", "float32, batch_invariant=True", "int4, int8 activations",
    "int4, int8 activations, fused_decode=False", "int4, int8 activations, batch_invariant=True")}
# --cost: each weight format by default and in the mode
COST_SETTINGS = {"float32": {}, "int4": {"quantization": "int4"}, "int4, int8 activations": A8}


def first_logprobs(llm: LLM, prompt: str, neighbour: str | None) -> dict:
    probe = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    if neighbour is None:
        return llm.generate([prompt], probe, use_tqdm=False)[0].outputs[0].logprobs[0]
    outs = llm.generate([neighbour, prompt], [SamplingParams(max_tokens=1), probe], use_tqdm=False)
    return outs[1].outputs[0].logprobs[0]


def measure(model: str, engine_args: dict, neighbour: str) -> dict:
    llm = LLM(model, max_num_seqs=8, num_kv_blocks=256, **engine_args)
    apart = []
    for p in PROMPTS:
        alone, beside = first_logprobs(llm, p, None), first_logprobs(llm, p, neighbour)
        apart.append(max(abs(alone[t].logprob - beside[t].logprob) for t in alone if t in beside))
    del llm
    gc.collect()
    return {"max_nats": max(apart), "identical": sum(a == 0 for a in apart), "prompts": len(apart)}


def crowd(model: str, engine_args: dict) -> dict:
    """The second table's run (see the top): the seeded request alone, then in the crowd."""
    mk = lambda: LLM(model, max_num_seqs=6, num_kv_blocks=36, block_size=16, max_num_batched_tokens=48,  # noqa: E731
                     enable_prefix_caching=True, kv_cache_dtype="int8", **engine_args)
    llm = mk()
    text = llm.get_tokenizer().encode("Once upon a time in a small village by the sea, there lived an old "
                                      "fisherman who " * 6)
    prompt, seeded = text[:150], SamplingParams(temperature=1.0, seed=11, max_tokens=60, logprobs=5)
    alone = llm.generate([{"prompt_token_ids": prompt}], seeded, use_tqdm=False)[0].outputs[0]
    del llm
    llm = mk()
    others = [text[:70] + list(range(900, 940))] + [list(range(1000 + 50 * i, 1030 + 70 * i)) for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in others + [prompt]],
                        [SamplingParams(max_tokens=120, ignore_eos=True)] * 5 + [seeded], use_tqdm=False)
    together = outs[-1].outputs[0]
    apart = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(alone.logprobs, together.logprobs)
                for t in a if t in b)
    preempted = int(llm.llm_engine.requests_frame().num_preemptions.iloc[-1])
    del llm
    gc.collect()
    return {"max_nats": apart, "same_tokens": alone.token_ids == together.token_ids, "preempted": preempted}


def attention_ms(context: int, rows: int = 16, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """One layer of SmolLM2's decode-row attention (9 heads, 3 kv heads, 64 wide), ``rows``
    sequences at ``context`` tokens, float32 and int8 caches: (the decode kernel the default path
    uses, the flash kernel the batch-invariant mode uses) in ms, best of 20 calls, the fastest of
    ``rounds`` alternating rounds."""
    import torch

    from minserve.kernels import paged_attention as paged
    from minserve.kernels.prefill_attention import prefill_attention_paged
    from minserve.kernels.triton.reference import quantize_kv_int8
    H, Hkv, D, bs = 9, 3, 64, 16
    per_seq = (context + bs) // bs + 1
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(rows * per_seq * bs, Hkv, D, generator=g) for _ in range(2))
    q = torch.randn(rows, H, D, generator=g)
    tables = torch.arange(rows * per_seq).view(rows, per_seq)
    lens, positions = torch.full((rows,), context), torch.full((rows,), context)
    shape = (rows * per_seq, bs, Hkv)
    (kc, ks), (vc, vs) = quantize_kv_int8(k), quantize_kv_int8(v)
    caches = {"float32": (k.view(*shape, D), v.view(*shape, D), None, None),
              "int8": (kc.view(*shape, D), vc.view(*shape, D), ks.float().view(shape), vs.float().view(shape))}

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3
    out = {}
    for name, c in caches.items():
        runs = [(best(lambda: paged.paged_attention(q, c, tables, positions, 0.125)),
                 best(lambda: prefill_attention_paged(q, c, tables, lens, 0.125))) for _ in range(rounds)]
        out[name] = (min(r[0] for r in runs), min(r[1] for r in runs))
    return out


def token_ops_us(rows: int, calls: int = 2000) -> tuple[float, float]:
    """Microseconds for one SwiGLU and one RoPE over ``rows`` SmolLM2-sized rows: C, PyTorch."""
    import torch

    from minserve.kernels import token_ops
    gate_up, x = torch.randn(rows, 2 * 1536), torch.randn(rows, 12, 64)
    cos, sin = torch.randn(rows, 1, 64), torch.randn(rows, 1, 64)

    def c():
        token_ops.silu_mul(gate_up, 1536)
        token_ops.rope_(x, cos, sin)

    def pytorch():
        torch.nn.functional.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
        (x * cos) + (torch.roll(x, 32, dims=-1) * sin)

    out = []
    for fn in (c, pytorch):
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return out[0], out[1]


class _Timed:
    """An engine as bench_vs_vllm.py's decode measurements take it: run(prompts, max_tokens)."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, None]:
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, None


def rates(model: str, engine_args: dict) -> tuple[float, float, float]:
    """Decode tok/s at batch 1 (128 tokens) and batch 16 (64 each), prefill subtracted, and prefill
    tok/s of 512-token prompts, as bench_vs_vllm.py measures them."""
    from bench_vs_vllm import decode, decode_batch, prefill
    engine = _Timed(LLM(model, enable_prefix_caching=False, **engine_args))
    engine.run([list(range(100, 132))], [8])   # first-step costs, untimed
    got = (decode(engine, list(range(100, 132)), 129),
           decode_batch(engine, [list(range(200 + 40 * i, 232 + 40 * i)) for i in range(16)], 65),
           prefill(engine, [list(range(1000 + 7 * i, 1512 + 7 * i)) for i in range(3)]))
    del engine
    gc.collect()
    return got


def cost(model: str) -> None:
    print("| rows | SwiGLU + RoPE in C (us) | in PyTorch (us) |")
    print("| --- | --- | --- |")
    for rows in (1, 4, 8, 15):
        print("| {} | {:.1f} | {:.1f} |".format(rows, *token_ops_us(rows)))
    runs = {f"{fmt}{mode}": {**kw, **extra} for fmt, kw in COST_SETTINGS.items()
            for mode, extra in (("", {}), (", batch_invariant=True", {"batch_invariant": True}),
                                (", batch_invariant=True, fused_decode=False",
                                 {"batch_invariant": True, "fused_decode": False}))}
    got = {name: [] for name in runs}
    for _ in range(2):   # two alternating rounds
        for name, kw in runs.items():
            got[name].append(rates(model, kw))
    print("\n| setting | batch-1 decode (tok/s) | batch-16 decode (tok/s) | prefill, 512 tokens (tok/s) |")
    print("| --- | --- | --- | --- |")
    for name, rs in got.items():
        cells = [sorted(r[i] for r in rs) for i in range(3)]
        print(f"| {name} | " + " | ".join(f"{c[0]:.0f}-{c[-1]:.0f}" for c in cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--neighbour-tokens", type=int, default=300, help="words in the prompt beside each one (enough for a step of 256 tokens or more)")
    ap.add_argument("--cost", action="store_true", help="time the batch-invariant recipe's cost instead")
    ap.add_argument("--attention", action="store_true",
                    help="time one layer's decode-row attention, the default kernel against the mode's, instead")
    args = ap.parse_args()
    if args.cost:
        return cost(args.model)
    if args.attention:
        print("| context | cache | decode kernel (ms) | flash kernel, the mode's (ms) |\n| --- | --- | --- | --- |")
        for context in (100, 500, 2000):
            for name, (dec, flash) in attention_ms(context).items():
                print(f"| {context} | {name} | {dec:.3f} | {flash:.3f} |")
        return None
    neighbour = "x " * args.neighbour_tokens
    rows = {name: measure(args.model, kw, neighbour) for name, kw in SETTINGS.items()}
    print("| setting | largest difference (nats, top 20) | prompts bit for bit the same |")
    print("| --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['max_nats']:.2g} | {r['identical']} of {r['prompts']} |")
    crowds = {name: crowd(args.model, kw) for name, kw in CROWD_SETTINGS.items()}
    print("\n| setting | a crowd that cuts, shares and preempts: largest difference (nats) | same 60 tokens | preempted |")
    print("| --- | --- | --- | --- |")
    for name, r in crowds.items():
        print(f"| {name} | {r['max_nats']:.2g} | {'yes' if r['same_tokens'] else 'no'} | {r['preempted']} |")
    print(json.dumps({"first_token": rows, "crowd": crowds}))


if __name__ == "__main__":
    main()
