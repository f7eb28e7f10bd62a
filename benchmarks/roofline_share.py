"""How close each row of a side-by-side run came to this CPU's ceilings: the fraction of the
ceiling the issue on the vLLM comparison asks for beside every row of ``bench_vs_vllm.py``.

Each step is held to its roofline (minserve/plan/budget.py, the planner's formulas): the longer of
its bytes over the read bandwidth and its arithmetic over the rate of the arithmetic its format
multiplies in; the table gives roofline time over measured time and which of the two bounds the
step. The arithmetic ceiling is the one the row's own rounds measured, since the host's phase
moves it 2-3x within minutes (host_phase.py): the fp32 FMA rate on every thread for float32 (a
third of the AMX tile rate for fp32-high, fp32_matmul_precision="high"), the AMX tile rate for the rest where the CPU has tiles (bf16 weights multiply on them, and quantized
weights are expanded to bf16 tiles at prefill sizes, kernels/quant.py), else the bf16 dot-product
rate measured once; a ``-kv8`` row's K/V bytes are int8's. The int8-activation rows (``-a8``) multiply in integer dot products, which
the probe does not time: only their batch-1 decode, which their bytes bound, gets a share. Both
engines get the same formulas: a row's share says how much of the machine that engine used for
the work both had to do.
"""

from __future__ import annotations

import statistics

# Each row's weights and activations as the planner names them (minserve.plan.budget).
ROW_FORMATS = {"fp32": ("fp32", "float32"), "fp32-high": ("fp32", "float32"), "bf16": ("bf16", "bfloat16"),
               "int8": ("int8", "float32"), "int4": ("int4", "float32"), "int8-a8": ("int8", "float32"),
               "int4-a8": ("int4", "float32")}


# A row's name + this suffix: the same engine with its K/V in 8 bits (minserve's int8, vLLM's fp8).
KV8 = "-kv8"


def row_format(name: str) -> tuple[str, str]:
    """("fp32", "float32") for "minserve-fp32" or "vllm-fp32", and so on."""
    return ROW_FORMATS[name.removesuffix(KV8).split("-", 1)[1]]


def row_kv_cache_dtype(name: str) -> str:
    """The kv_cache_dtype a row runs with: a ``-kv8`` row "int8" (minserve) or "fp8" (vLLM), else "auto"."""
    if not name.endswith(KV8):
        return "auto"
    return "fp8" if name.startswith("vllm-") else "int8"


def arithmetic_ceiling(name: str, probes: list[dict], bf16_dot: float | None) -> float | None:
    """GFLOP/s the row's arithmetic could reach during its rounds (None: not measured here)."""
    def median(key):
        vals = [p[key] for p in probes if p.get(key)]
        return statistics.median(vals) if vals else None
    if name.removesuffix(KV8).endswith("-a8"):
        return None
    from bench_roofline import bf16_ceiling, fp32_high_ceiling   # the roofline script's own rules
    if name.endswith("-high"):
        return fp32_high_ceiling({"bf16_tiles": median("tiles"), "fp32_fma": median("fma")})
    if row_format(name)[0] == "fp32":
        return median("fma")
    return bf16_ceiling({"bf16_dot": bf16_dot, "bf16_tiles": median("tiles"), "fp32_fma": median("fma")})


def shares(engines: dict, cfg, args, bandwidth_gbs: float, bf16_dot: float | None = None) -> dict:
    """Per row and step (prefill, batch-``max_num_seqs`` decode, batch-1 decode): the planner's
    roofline time over the measured time, in percent, and which ceiling bounds the step. A row
    without an arithmetic ceiling (``-a8``) gets its batch-1 share only. ``engines``: bench_vs_vllm's
    medians and ``host_probe_runs``; ``args``: its arguments; ``cfg``: the model's ModelConfig."""
    from minserve.engine.kv_sizing import kv_cache_bytes_per_token
    from minserve.plan import budget
    bw = bandwidth_gbs * 1e9
    ctx = 32 + args.decode_tokens // 2   # both decode measurements start from 32-token prompts
    seqs = args.max_num_seqs
    out = {}
    for name, r in engines.items():
        precision, dtype = row_format(name)
        w = budget.weight_bytes(cfg, precision, dtype).per_step
        # 8-bit K/V: int8's bytes (with its scales) stand for vLLM's fp8 too (one scale per tensor)
        kv = kv_cache_bytes_per_token(cfg, "auto" if row_kv_cache_dtype(name) == "auto" else "int8", dtype)
        gflops = arithmetic_ceiling(name, r.get("host_probe_runs", []), bf16_dot)
        rate = gflops * 1e9 if gflops else float("inf")
        steps = {"prefill": (budget.prefill(cfg, w, kv, args.prefill_len, bw, rate),
                             args.prefill_len / r["prefill_tok_s"]),
                 "decode_batch": (budget.decode_step(cfg, w, kv, seqs, ctx, bw, rate), seqs / r["decode16_tok_s"]),
                 "decode_1": (budget.decode_step(cfg, w, kv, 1, ctx, bw, rate), 1 / r["decode_tok_s"])}
        if gflops is None:   # no arithmetic ceiling: only the byte-bound step is judged
            steps = {k: v for k, v in steps.items() if k == "decode_1"}
        out[name] = {"ceiling_gflops": gflops, "bandwidth_gbs": bandwidth_gbs,
                     **{f"{k}_pct": 100 * roof.seconds / t for k, (roof, t) in steps.items()},
                     **{f"{k}_bound": roof.bound for k, (roof, _) in steps.items()}}
    return out


def markdown(rows: dict, seqs: int) -> str:
    lines = [f"| % of the roofline (bound) | prefill | batch-{seqs} decode | batch-1 decode | "
             "arithmetic ceiling (GFLOP/s, the row's rounds) |",
             "| --- | --- | --- | --- | --- |"]
    for name, s in rows.items():
        cells = [f"{s[k + '_pct']:.0f} % ({s[k + '_bound']})" if k + "_pct" in s else "-"
                 for k in ("prefill", "decode_batch", "decode_1")]
        ceiling = "- (bytes only)" if s["ceiling_gflops"] is None else f"{s['ceiling_gflops']:,.0f}"
        lines.append(f"| {name.replace('-', ' ')} | " + " | ".join(cells) + f" | {ceiling} |")
    bw = next(iter(rows.values()))["bandwidth_gbs"] if rows else 0
    lines.append(f"\nThe roofline of a step is the longer of its bytes over the read bandwidth ({bw:.1f} GB/s, "
                 "measured once after the rounds) and its arithmetic over the ceiling in the last column "
                 "(minserve/plan/budget.py's formulas, the same for both engines).")
    if any(v > 100 for s in rows.values() for k, v in s.items() if k.endswith("_pct")):
        lines.append("Over 100 %: the step ran faster than the ceilings measured around it allow (the host "
                     "was in a faster phase during the step than during the measurement).")
    return "\n".join(lines)


def measure_once() -> tuple[float, float | None]:
    """This CPU's read bandwidth (GB/s) and bf16 dot-product rate (GFLOP/s; None where it has none),
    from bench_roofline's C loops: the ceilings the round probes do not time."""
    from bench_roofline import _ceiling_lib, instruction_rate, read_bandwidth
    lib = _ceiling_lib()
    dot = instruction_rate(lib, "bf16_dot", seconds=0.1, repeats=3)
    return read_bandwidth(lib) / 1e9, None if dot is None else dot / 1e9


def for_run(engines: dict, model_dir, args) -> dict:
    """shares() for a bench_vs_vllm run over the model in ``model_dir``, its two ceilings measured now."""
    from minserve.plan.planner import model_config
    _, cfg = model_config(model_dir)
    bandwidth, dot = measure_once()
    return shares(engines, cfg, args, bandwidth, dot)
