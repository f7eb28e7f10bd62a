"""Weight formats side by side on one model: bytes, KV capacity, greedy agreement, decode speed.

    .venv/bin/python benchmarks/bench_quant_formats.py                  # every row, SmolLM2-135M
    .venv/bin/python benchmarks/bench_quant_formats.py --rows fp32,int4 --decode-tokens 32
    .venv/bin/python benchmarks/bench_quant_formats.py --reproduction   # only formats.reproduction
    .venv/bin/python benchmarks/bench_quant_formats.py --head           # only the LM head, per format

Per row (a quantization and its quantization_config): resident weight bytes and bytes streamed per
decode token (engine.runner.weight_footprint()), KV blocks a fixed memory_budget leaves, greedy
agreement with fp32 (the first 16 tokens of each of the 20 paragraphs of datasets/eval/prose.jsonl,
48 new tokens each: position of the first differing token), and batch-1 decode tokens/s on the
engine's default path and on the PyTorch path (quantized layers through kernels/quant.py).
``--reproduction``: how many of the checkpoint's linear weights each format stores back exactly.
Timings are one run on a shared host: compare ratios within a run, not across runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from minserve import LLM, SamplingParams
from minserve.attention.fused_cpu import FusedCpuBackend
from minserve.eval.data import load_texts
from minserve.models.loader import load_model
from minserve.plan.budget import kv_budget_within
from minserve.quant import formats

ROWS = {  # label: (quantization, quantization_config); "head=" names the LM head's format
    "fp32": (None, None),
    "int8": ("int8", None),
    "int8 head=fp32": ("int8", {"lm_head": "keep"}),
    "int4 g32 (head=int8)": ("int4", None),
    "int4 g32 head=int4": ("int4", {"lm_head": "quantize"}),
    "int4 g32 head=fp32": ("int4", {"lm_head": "keep"}),
    "int4 g64": ("int4", {"group_size": 64}),
    "int4 g128+fallback": ("int4", {"group_size": 128, "fallback": True}),
    "int4-awq g32": ("int4-awq", None),
    "int4-awq g64": ("int4-awq", {"group_size": 64}),
    "int4-awq g64 head=int4": ("int4-awq", {"group_size": 64, "lm_head": "quantize"}),
}


def agreement(ref: list[list[int]], out: list[list[int]]) -> list[int]:
    """Per prompt, the position of the first token that differs (the length when none does)."""
    return [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref, out)]


def decode_tok_s(llm: LLM, prompt: list[int], tokens: int, repeats: int = 2) -> float:
    """Batch-1 decode rate: (time for 1 + tokens outputs - time for 1 output) / tokens, best of."""
    def run(n):
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)
        return time.perf_counter() - t0
    run(4)  # warm-up (kernel builds, thread choice)
    best = min(run(tokens + 1) - run(1) for _ in range(repeats))
    return tokens / best


def measure_row(label: str, args, prompts, ref) -> tuple[dict, list[list[int]]]:
    quant, qc = ROWS[label]
    t0 = time.perf_counter()
    llm = LLM(args.model, quantization=quant, quantization_config=qc, kv_cache_memory="256MiB",
              max_num_seqs=len(prompts))
    load_s = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    fp = runner.weight_footprint()
    spec = llm.llm_engine.kv_spec
    kv = kv_budget_within(args.memory_budget, fp.resident_bytes)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    first = agreement(ref if ref is not None else out, out)
    row = dict(format=label, load_s=round(load_s, 1), resident_mib=fp.resident_bytes / 2**20,
               streamed_mib=fp.streamed_bytes / 2**20,
               kv_blocks=kv // (spec.bytes_per_token * spec.block_size),
               identical=sum(f == args.new_tokens for f in first), mean_first_diff=sum(first) / len(first),
               min_first_diff=min(first), fused=runner.fused is not None)
    if args.decode_tokens:
        row["default_tok_s"] = decode_tok_s(llm, prompts[0], args.decode_tokens)
        runner.backends = [b for b in runner.backends if not isinstance(b, FusedCpuBackend)]
        row["pytorch_tok_s"] = decode_tok_s(llm, prompts[0], args.decode_tokens)
    del llm, runner
    gc.collect()
    return row, out


def reproduction_table(model: str) -> list[dict]:
    """Exact fraction and relative error of every format on the checkpoint's block linears and its
    embedding / tied LM head table (group 128 only where it divides: down_proj's 1536 inputs)."""
    weights = load_model(model).weights
    linears = [w for n, w in weights.items() if n.startswith("model.layers.") and n.endswith("proj.weight")]
    table = weights["model.embed_tokens.weight"]
    rows = []
    for fmt, g in (("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)):
        fits = [w for w in linears if g is None or w.shape[1] % g == 0]
        reps = [(formats.reproduction(w, fmt, g), w.numel(), float(w.float().norm()) ** 2) for w in fits]
        n = sum(k for _, k, _ in reps)
        err = (sum((r.relative_error ** 2) * e for r, _, e in reps) / sum(e for *_, e in reps)) ** 0.5
        head = formats.reproduction(table, fmt, g) if g is None or table.shape[1] % g == 0 else None
        rows.append(dict(format=fmt + (f" g{g}" if g else ""), linear_weights=n,
                         linear_exact=sum(r.exact_fraction * k for r, k, _ in reps) / n, linear_rel_error=err,
                         table_exact=None if head is None else head.exact_fraction,
                         table_rel_error=None if head is None else head.relative_error))
    return rows


def head_timings(model: str, repeats: int = 30) -> list[dict]:
    """The LM head alone at batch 1 (one decode step's head), each format through what the engine's
    PyTorch path runs (F.linear for fp32, kernels/quant.py for int8 / int4): formats interleaved,
    median of ``repeats``, so a busy neighbour slows all of them alike."""
    from minserve.models.layers import Linear
    from minserve.quant import Int4Linear, Int8Linear
    table = load_model(model).weights["model.embed_tokens.weight"]
    dense = Linear.from_weight(table)
    heads = {"fp32": dense, "int8": Int8Linear(dense), "int4 g32": Int4Linear(dense, 32),
             "int4 g64": Int4Linear(dense, 64)}
    x = torch.randn(1, table.shape[1])
    times = {k: [] for k in heads}
    for _ in range(repeats):
        for k, h in heads.items():
            t0 = time.perf_counter()
            h(x)
            times[k].append(time.perf_counter() - t0)
    rows = []
    for k, h in heads.items():
        ms = sorted(times[k])[len(times[k]) // 2] * 1e3
        nbytes = h.descriptor().nbytes
        rows.append(dict(format=k, head_mib=nbytes / 2**20, median_ms=ms, gb_per_s=nbytes / ms / 1e6))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--decode-tokens", type=int, default=64, help="0: skip the speed columns")
    ap.add_argument("--memory-budget", type=int, default=1 << 30, help="bytes, for the KV blocks column")
    ap.add_argument("--reproduction", action="store_true")
    ap.add_argument("--head", action="store_true", help="only the LM head at batch 1, per format")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.reproduction:
        result = reproduction_table(args.model)
    elif args.head:
        result = head_timings(args.model)
    else:
        tok = load_model(args.model).tokenizer
        prompts = [tok.encode(t)[:16] for t in load_texts()]
        result, ref = [], None
        labels = [r.strip() for r in args.rows.split(",")]
        for label in ["fp32"] + [r for r in labels if r != "fp32"]:  # the reference first
            row, out = measure_row(label, args, prompts, ref)
            ref = ref if ref is not None else out
            result.append(row)
            print(json.dumps(row), flush=True)
    for row in result:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
