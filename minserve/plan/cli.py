"""``minserve plan``: the serving envelope of a model on named hardware, as a table."""

from __future__ import annotations

import argparse
import sys

from minserve.config import KV_CACHE_DTYPES
from minserve.plan.budget import GROUP_SIZES, PRECISIONS


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="minserve plan",
        description="Weight and KV-cache bytes, sequences that fit and a prefill/decode roofline "
                    "for a model on named hardware (formulas: minserve/plan/budget.py).",
        epilog="example: minserve plan --model smollm2-135m --hardware h100 --context-len 4096 "
               "--precision int4 --memory 80GiB")
    ap.add_argument("--model", default="smollm2-135m", help="alias or Hugging Face model directory")
    ap.add_argument("--hardware", default="this",
                    help="a name from --list-hardware, 'this' (measured here, then cached), "
                         "or several names separated by commas for a comparison")
    ap.add_argument("--list-hardware", action="store_true", help="list the known hardware and exit")
    ap.add_argument("--context-len", type=int, help="tokens per sequence (default: min(4096, the model's))")
    ap.add_argument("--precision", default="fp32", help=f"weights: {', '.join(PRECISIONS)} (default fp32)")
    ap.add_argument("--dtype", help="activation dtype for int8/int4 (default: float32 on a CPU, as the engine; bfloat16 on a GPU)")
    ap.add_argument("--group-size", type=int, default=32, help=f"int4 group size: {GROUP_SIZES} (default 32, "
                    "the engine's)")
    ap.add_argument("--lm-head", choices=("quantize", "int8", "keep"), default=None,
                    help="int8/int4: the LM head in the format, in int8 (int4 only) or dense "
                         "(default: the engine's: int8)")
    ap.add_argument("--activations", choices=("float", "int8"), default="float",
                    help="int8/int4 on the CPU: int8 quantizes the inputs too (W8A8, W4A8), as the engine's "
                         "quantization_config; the weights then count the tiles its integer loops keep")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (engine default 16)")
    ap.add_argument("--memory", help="memory for weights + KV, e.g. 80GiB (default: the hardware's)")
    ap.add_argument("--kv-cache-memory", help="fix the KV budget instead, e.g. 2GiB (as the engine flag)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="KV cache storage, as the engine flag: auto (the activation dtype) or int8")
    ap.add_argument("--remeasure", action="store_true", help="probe 'this' machine again")
    return ap


def _list_hardware() -> None:
    from minserve.plan.hardware import DATASHEET
    from minserve.plan.planner import format_table
    rows = [(k, h.name, f"{h.memory_bytes / 2**30:g} GiB", f"{h.bandwidth_bytes_per_s / 1e9:,.0f} GB/s",
             f"{h.bf16_flops_per_s / 1e12:,.1f}", f"{h.fp32_flops_per_s / 1e12:,.1f}", h.source)
            for k, h in DATASHEET.items()]
    rows.append(("this", "this machine", "RAM or GPU memory", "measured", "measured", "measured",
                 "torch probe, cached in $MINSERVE_CACHE/probe"))
    print(format_table(("name", "device", "memory", "bandwidth", "bf16 TFLOP/s", "fp32 TFLOP/s", "source"), rows))


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.list_hardware:
        _list_hardware()
        return 0
    from minserve.plan.hardware import get_hardware
    from minserve.plan.planner import format_table, plan
    try:
        names = [n for n in a.hardware.split(",") if n.strip()]
        if a.remeasure and "this" in names:
            get_hardware("this", remeasure=True)
        plans = [plan(a.model, hardware=n, memory_budget=a.memory, context_len=a.context_len,
                      precision=a.precision, dtype=a.dtype, group_size=a.group_size, lm_head=a.lm_head,
                      block_size=a.block_size, kv_cache_memory=a.kv_cache_memory,
                      kv_cache_dtype=a.kv_cache_dtype, activations=a.activations) for n in names]
    except ValueError as e:
        print(f"minserve plan: {e}", file=sys.stderr)
        return 2
    if len(plans) == 1:
        print(plans[0].table())
        return 0
    rows = [(p.hardware, f"{p.weight_bytes / 2**20:,.1f}", f"{p.kv_budget_bytes / 2**30:,.2f}",
             f"{p.max_num_seqs:,}", f"{p.prefill_s * 1e3:,.2f}", f"{p.decode_tok_s:,.0f}",
             "-" if p.decode_tok_s_full is None else f"{p.decode_tok_s_full:,.0f}") for p in plans]
    print(f"{plans[0].model}, {plans[0].precision}, {plans[0].context_len} tokens per sequence")
    print(format_table(("hardware", "weights MiB", "KV GiB", "max seqs", "prefill ms", "tok/s batch 1",
                        "tok/s at max seqs"), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
