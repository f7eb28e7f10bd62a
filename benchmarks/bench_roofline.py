"""This CPU's ceilings, and how close each of minserve's step types comes to them, per format.

A step is bound by one of two things: the bytes it must read (weights, KV cache) over the memory
bandwidth, or the arithmetic it must do over the rate of the vector units. Which one, and how far
the step is from it, is the first thing to know before optimizing it. This script measures both
ceilings here and then times the three step types that decide a server's behaviour:

- **ceilings**: the instruction rates of fp32 FMA, bf16 dot products (``vdpbf16ps``, AVX-512
  BF16), int8 dot products (``vpdpbusd``, VNNI) and AMX's bf16 tile product (``TDPBF16PS``, where
  the CPU has it and Linux grants the tile state), measured in registers by kernels/ceiling.c on
  every thread; the rate PyTorch's own GEMM reaches on a 2048-cube in fp32 and bf16 (what the
  library achieves, cache blocking included); the read bandwidth (the faster of a C loop and
  ``torch.sum`` over 512 MiB). Measured before and after the steps; each ceiling is the higher of
  the two, and a warning says when they differ by more than 20 %. On a CPU without bf16 dot
  products (no AVX-512 BF16, no AMX) PyTorch emulates bf16 GEMMs at about 1 GFLOP/s (0.7 on the
  AVX2 EPYC: 24 s for one 2048-cube), so there the bf16 GEMM is not timed and bf16, int8 and int4
  are held to the fp32 ceiling, the arithmetic they run on there (minserve/models/gemm.py);
- **prefill**: one prompt of ``--prefill-len`` tokens in one step (the budget allows it);
- **batch-16 decode**: the median decode step with 16 requests running;
- **batch-1 decode**: the median decode step of one request;
- **the kernels by library**: each product of those steps in MKL fp32 (``F.linear``), oneDNN fp32
  (what minserve's float32 ``Linear`` uses, minserve/models/gemm.py), oneDNN bf16 (where the CPU
  multiplies bf16 natively; elsewhere minserve's bf16 ``Linear``, float32 tiles) and, at decode
  sizes, minserve's C (the fused step's float32 product, kernels/decode.c, and its bfloat16 one: the
  vector loop and, where the CPU has them, AMX tiles, kernels/amx_bf16.h); the prefill attention
  in PyTorch's CPU flash SDPA and in minserve's C (kernels/prefill_attention.c), in GFLOP/s; and
  the W8A8 and W4A8 products in minserve's C (per-32-column input scales) and the int8 one in
  oneDNN's int8 GEMM (``torch._int_mm``, per-row input scales), in GOP/s.

For each step and format the table gives the measured step time, the arithmetic it did (the
planner's formulas, minserve/plan/budget.py: matmuls of every layer, attention, the LM head of the
sampled rows) as GFLOP/s and as a fraction of the fp32 and bf16 ceilings, the bytes it read as GB/s
and as a fraction of the bandwidth, and the roofline: the least time the step could take at the
fastest arithmetic its format could use (fp32: fp32 FMA; fp32-high, ``fp32_matmul_precision="high"``:
a third of the AMX tile rate, three tile products per float32 one; bf16, int8, int4: the bf16 ceiling, the
highest of the bf16 dot-product rate, the AMX tile rate and PyTorch's bf16 GEMM; the fp32 FMA rate on a CPU without bf16 dot products; int8-a8, int4-a8 (int8 activations):
the int8 dot-product rate, VNNI's or AVX2's vpmaddubsw) and full bandwidth, over the measured
time. (The a8 formats run only their products in integers: attention and the rest stay fp32, so
their rooflines are optimistic.)

    .venv/bin/python benchmarks/bench_roofline.py                     # every format
    .venv/bin/python benchmarks/bench_roofline.py --formats fp32,int4 --runs 5
    .venv/bin/python benchmarks/bench_roofline.py --ceilings-only

Run it on a quiet machine: a neighbour's threads take vector units and bandwidth from both the
ceilings and the steps.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
A8 = {"activations": "int8"}
FORMATS = {"fp32": {}, "fp32-high": {"fp32_matmul_precision": "high"}, "bf16": {"dtype": "bfloat16"},
           "int8": {"quantization": "int8"},
           "int4": {"quantization": "int4"},
           "int8-a8": {"quantization": "int8", "quantization_config": A8},   # W8A8: int8 dot products
           "int4-a8": {"quantization": "int4", "quantization_config": A8}}   # W4A8
KINDS = {"fp32_fma": 0, "bf16_dot": 1, "int8_dot": 2, "bf16_tiles": 3}
KIND_ENTRIES = {"fp32_fma": "ms_ceiling_fp32", "bf16_dot": "ms_ceiling_bf16", "int8_dot": "ms_ceiling_int8",
                "bf16_tiles": "ms_ceiling_tiles"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3, help="repeats of each step measurement (median)")
    ap.add_argument("--ceilings-only", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/roofline.json")
    a = ap.parse_args(argv)
    a.format_list = [f.strip() for f in a.formats.split(",") if f.strip()]
    bad = [f for f in a.format_list if f not in FORMATS]
    if bad:
        ap.error(f"--formats must name only {', '.join(FORMATS)}, got {bad}")
    return a


# ---- ceilings -----------------------------------------------------------------------------------

def _ceiling_lib():
    from minserve.kernels.build import load
    lib = load("ceiling")
    lib.ms_ceiling_ops_per_iter.restype = ctypes.c_int64
    lib.ms_ceiling_ops_per_iter.argtypes = [ctypes.c_int]
    lib.ms_ceiling_threads.restype = ctypes.c_int
    for name in KIND_ENTRIES.values():
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_int64]
    lib.ms_ceiling_read.restype = ctypes.c_double
    lib.ms_ceiling_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return lib


def read_bandwidth(lib, nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second the C read loop streams from a buffer far larger than the caches."""
    import torch
    buf = torch.ones(nbytes // 4)
    best = min(_timed(lambda n: lib.ms_ceiling_read(buf.data_ptr(), n), buf.numel())
               for _ in range(repeats))
    return buf.numel() * 4 / best


def instruction_rate(lib, kind: str, seconds: float = 0.3, repeats: int = 5) -> float | None:
    """Operations per second of one instruction kind on every thread; None if not built here."""
    per_iter = lib.ms_ceiling_ops_per_iter(KINDS[kind])
    if per_iter < 0:
        return None
    fn = getattr(lib, KIND_ENTRIES[kind])
    iters = 1 << 16
    while True:   # grow the call until it lasts long enough to time
        t0 = time.perf_counter()
        fn(iters)
        if time.perf_counter() - t0 > seconds / 4:
            break
        iters *= 2
    best = min(_timed(fn, iters) for _ in range(repeats))
    return lib.ms_ceiling_threads() * iters * per_iter / best


def host_probe(seconds: float = 0.04) -> dict:
    """This moment's arithmetic, in GFLOP/s: fp32 FMA on one thread and on every thread, and AMX
    tiles on every thread (None without tiles). On this project's VM both move within minutes (this
    probe in bench_vs_vllm's rounds, 2026-12-06: the tiles 1,705 to 4,714 GFLOP/s, FMA on one
    thread 123 to 181), as other tenants come and go on the same cores; a benchmark prints it beside each round so a
    reader can tell which rounds ran in a slow phase. Takes ~0.3 s."""
    import torch
    lib, threads = _ceiling_lib(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)   # the OpenMP team our kernels get: the same libgomp as torch's
        one = instruction_rate(lib, "fp32_fma", seconds, repeats=3)
    finally:
        torch.set_num_threads(threads)
    rates = {"fma_1t": one, "fma": instruction_rate(lib, "fp32_fma", seconds, repeats=3),
             "tiles": instruction_rate(lib, "bf16_tiles", seconds, repeats=3)}
    return {k: None if v is None else round(v / 1e9, 1) for k, v in rates.items()}


def _timed(fn, iters: int) -> float:
    t0 = time.perf_counter()
    fn(iters)
    return time.perf_counter() - t0


def ceilings() -> dict:
    import torch

    from minserve.models import gemm
    from minserve.plan.probe import measure_bandwidth, measure_matmul
    lib = _ceiling_lib()
    out = {"threads": lib.ms_ceiling_threads()}
    for kind in KINDS:
        out[kind] = instruction_rate(lib, kind)
    out["fp32_gemm_torch"] = measure_matmul(torch.float32)
    out["bf16_gemm_torch"] = measure_matmul(torch.bfloat16) if gemm.native_bf16() else None
    out["read_bandwidth_torch"] = measure_bandwidth()
    out["read_bandwidth_c"] = read_bandwidth(lib)
    out["read_bandwidth"] = max(out["read_bandwidth_torch"], out["read_bandwidth_c"])
    return out


# The model's products at prefill (1024 rows) and in a batch-16 decode step, and its LM head.
GEMM_SHAPES = [(1024, 576, 1536), (1024, 1536, 576), (1024, 576, 576), (64, 576, 1536),
               (16, 576, 1536), (16, 1536, 576), (1, 576, 49152), (16, 576, 49152)]


def _median_time(fn, repeats: int = 9) -> float:
    fn()
    times = sorted(_timed(lambda _: fn(), 0) for _ in range(repeats))
    return times[len(times) // 2]


def _c_matmul():
    """decode.c's float32 product (the fused step's), as fn(x, w) -> y, or None without a compiler."""
    import ctypes

    import torch
    from minserve.kernels.build import KernelUnavailable, load
    try:
        lib = load("decode")
    except KernelUnavailable:
        return None
    f32 = ctypes.POINTER(ctypes.c_float)

    def run(x, w, y):
        lib.ms_matmul(*(ctypes.cast(t.data_ptr(), f32) for t in (w,)), None,
                      *(ctypes.cast(t.data_ptr(), f32) for t in (x, y)), ctypes.c_int64(x.shape[0]),
                      ctypes.c_int64(x.shape[1]), ctypes.c_int64(w.shape[0]), 0)
    return lambda x, w: run(x, w, torch.empty(x.shape[0], w.shape[0]))


C_BF16_KINDS = ("widened", "dot", "tiles")


def _c_bf16_matmul(kind: str):
    """decode.c's product for a bfloat16 weight (the fused step's, dtype="bfloat16"), as
    fn(x, w_bf16) -> y, by ``kind``: "widened" (each weight widened to float32, float32 inputs: the
    one-row loop), "dot" (AVX-512 BF16 dot products, inputs rounded to bf16: two rows or more on a
    CPU with them) or "tiles" (AMX, inputs split in two bf16 halves: two rows or more where the CPU
    has tiles, before the dot products). None without a compiler, or for a kind this CPU lacks."""
    import ctypes

    import torch
    from minserve.kernels.build import KernelUnavailable, load
    from minserve.kernels.decode import WEIGHT_BF16, _Weight
    try:
        lib = load("decode")
    except KernelUnavailable:
        return None
    lib.ms_weight_matmul.restype = ctypes.c_int64
    if (kind == "tiles" and not lib.ms_amx(1)) or (kind == "dot" and not lib.ms_bf16_dot(1)):
        return None

    def run(x, w):
        lib.ms_amx(int(kind == "tiles"))
        lib.ms_bf16_dot(int(kind == "dot"))
        y, xs = torch.empty(x.shape[0], w.shape[0]), torch.empty(x.shape[0] * (x.shape[1] + 1))
        desc = _Weight(WEIGHT_BF16, ctypes.c_void_p(w.data_ptr()), None, None, None, 0, 0)
        lib.ms_weight_matmul(ctypes.byref(desc), *(ctypes.c_void_p(t.data_ptr()) for t in (x, xs, y)),
                             ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
                             ctypes.c_int64(w.shape[0]), ctypes.c_int(0))
        lib.ms_amx(1)   # the defaults again
        lib.ms_bf16_dot(1)
        return y
    return run


def _int8_rates(x, w) -> dict:
    """GOP/s of the int8-activation products: minserve's C loops (kernels/quant_a8.h: the input
    quantized per block of 32 columns inside the call, the scheme `minserve eval` passes) for W8A8
    and W4A8 (int4 g32; again with the weight laid out at load in the loops' tile order, as an
    engine with int8 activations keeps it: quant_a8_tiles.h), and oneDNN's int8 GEMM (``torch._int_mm``) on inputs already quantized
    with one scale per row, the coarser scheme such a GEMM needs (the per-row scales are applied
    outside it). None where a path is missing (no C compiler; an int8 GEMM this torch build lacks)."""
    import torch
    from minserve.kernels.quant import a8_isa, a8_tiles, linear_a8
    from minserve.quant.formats import quantize_int4, quantize_int8
    codes, scales = quantize_int8(w)
    int4 = quantize_int4(w, 32)
    ops, out = 2 * x.shape[0] * x.shape[1] * w.shape[0], {}
    out["minserve C int8 a8"] = (ops / _median_time(lambda: linear_a8(x, 8, codes, scales, None, 0)) / 1e9
                                 if a8_isa() else None)
    out["minserve C int4 a8"] = (ops / _median_time(lambda: linear_a8(x, 4, *int4, 32)) / 1e9
                                 if a8_isa() else None)
    tiles = a8_tiles(4, *int4, 32) if a8_isa() else None   # laid out once, as an engine does (quant_a8_tiles.h)
    out["minserve C int4 a8, tiles"] = (ops / _median_time(lambda: linear_a8(x, 4, *int4, 32, tiles=tiles)) / 1e9
                                        if tiles is not None else None)
    xq = torch.randint(-127, 128, x.shape, dtype=torch.int8)
    try:
        out["oneDNN int8"] = ops / _median_time(lambda: torch._int_mm(xq, codes.t())) / 1e9
    except RuntimeError:   # shapes or a build this CPU's int8 GEMM does not take
        out["oneDNN int8"] = None
    return out


def kernel_rates() -> list[dict]:
    """GFLOP/s of the products a step runs, by library: MKL (``F.linear`` on float32), oneDNN on
    the plain float32 weight (minserve/models/gemm.py's choice), oneDNN in bf16, minserve's C (the
    fused decode step's product at decode sizes; the bf16 AMX product, kernels/bf16_gemm.c, at the
    rows it takes, and its float32 split product (fp32_matmul_precision="high"); the prefill
    attention kernel); and the prefill attention (PyTorch's CPU flash
    SDPA, causal, 1024 tokens, SmolLM2's 9 query / 3 KV heads)."""
    import torch
    import torch.nn.functional as F
    from minserve.kernels import bf16_gemm
    from minserve.kernels.prefill_attention import prefill_attention
    from minserve.models import gemm
    onednn = torch.ops.mkldnn._linear_pointwise
    c_matmul = _c_matmul()
    c_bf16 = {f"minserve C bf16, {kind}": _c_bf16_matmul(kind) for kind in C_BF16_KINDS}
    # Where bf16 is emulated (~1 GFLOP/s), time what a bf16 engine runs there instead: gemm.linear's
    # float32 tiles.
    bf16_name, bf16_linear = (("oneDNN bf16", F.linear) if gemm.native_bf16()
                              else ("bf16 via fp32 tiles", gemm.linear))
    rows = []
    for m, k, n in GEMM_SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        xb, wb = x.bfloat16(), w.bfloat16()
        flops = 2 * m * k * n

        c = flops / _median_time(lambda: c_matmul(x, w)) / 1e9 if c_matmul and m <= 16 else None
        tiles = (flops / _median_time(lambda: bf16_gemm.linear(xb, wb)) / 1e9
                 if bf16_gemm.linear(xb, wb) is not None else None)
        halves = bf16_gemm.split(w)   # fp32_matmul_precision="high": three bf16 products a float32 one
        split = (flops / _median_time(lambda: bf16_gemm.split_linear(x, halves)) / 1e9
                 if bf16_gemm.split_linear(x, halves) is not None else None)
        rows.append({"kernel": f"linear {m}x{k} -> {n}",
                     "MKL fp32": flops / _median_time(lambda: F.linear(x, w)) / 1e9,
                     "oneDNN fp32": flops / _median_time(lambda: onednn(x, w, None, "none", [], "")) / 1e9,
                     bf16_name: flops / _median_time(lambda: bf16_linear(xb, wb)) / 1e9,
                     "minserve C": c, "minserve bf16 tiles": tiles, "minserve fp32 split tiles": split,
                     "flash SDPA": None, **_int8_rates(x, w),
                     **{name: flops / _median_time(lambda: fn(x, wb)) / 1e9 if fn and m <= 16 else None
                        for name, fn in c_bf16.items()}})
    q, kv = torch.randn(1, 9, 1024, 64), torch.randn(1, 3, 1024, 64)
    flops = 4 * 1024 * 1024 * 64 * 9 / 2        # QK^T and PV, causal: half the square
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd = q.to(dtype), kv.to(dtype)
        t = _median_time(lambda: F.scaled_dot_product_attention(qd, kd, kd, is_causal=True, enable_gqa=True))
        # The C kernel takes [T, H, D] rows (bf16 on AMX tiles where the CPU has them, widened to
        # fp32 elsewhere).
        qr, kr = qd[0].transpose(0, 1).contiguous(), kd[0].transpose(0, 1).contiguous()
        c = None
        if prefill_attention(qr, kr, kr, 0.125) is not None:
            c = flops / _median_time(lambda: prefill_attention(qr, kr, kr, 0.125)) / 1e9
        rows.append({"kernel": f"causal attention, 1024 tokens, {str(dtype).replace('torch.', '')}",
                     "MKL fp32": None, "oneDNN fp32": None, bf16_name: None, "minserve C": c,
                     "minserve bf16 tiles": None, "minserve fp32 split tiles": None, "flash SDPA": flops / t / 1e9,
                     "minserve C int8 a8": None, "minserve C int4 a8": None, "minserve C int4 a8, tiles": None,
                     "oneDNN int8": None,
                     **dict.fromkeys(c_bf16)})
    return rows


def merged_ceilings(before: dict, after: dict) -> dict:
    """The higher of two measurements of each ceiling (a ceiling is what the machine *can* do),
    with both kept: on this project's VM the compute ceilings sometimes halve for minutes (seen:
    482 then 253 GFLOP/s), as if the host ran both vCPUs on one core's two hyperthreads."""
    out = {k: (max(v, after[k]) if isinstance(v, float) and after.get(k) is not None else v)
           for k, v in before.items()}
    out["before"], out["after"] = before, after
    return out


# ---- steps --------------------------------------------------------------------------------------

def measure_steps(fmt: str, args) -> dict:
    """Median step times (s) of prefill, batch-16 decode and batch-1 decode for one format."""
    from minserve import LLM, SamplingParams
    llm = LLM("smollm2-135m", max_num_seqs=16, max_num_batched_tokens=max(2048, args.prefill_len),
              max_model_len=max(2048, args.prefill_len + 64), enable_prefix_caching=False, seed=0,
              **FORMATS[fmt])
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    from minserve.lab.workload import make_requests
    long_ids = [tok(r.prompt).input_ids[:args.prefill_len] for r in
                make_requests(tok, args.prefill_len, 1, num_requests=args.runs + 1, seed=5)]
    short_ids = [tok(r.prompt).input_ids[:64] for r in make_requests(tok, 64, 1, num_requests=16, seed=6)]

    def steps_of(prompts, max_tokens):
        first = eng.num_steps
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        st = eng.steps_frame()
        return st[st.step >= first] if "step" in st else st.iloc[-(eng.num_steps - first):]

    prefill_s = []
    for i, ids in enumerate(long_ids):
        st = steps_of([ids], 1)
        t = st[st.num_prefill_tokens == len(ids)].step_time_s
        if i and len(t):          # the first prompt warms the shape up
            prefill_s.append(float(t.iloc[0]))
    decode = {}
    for batch in (16, 1):
        steps_of(short_ids[:batch], 8)   # warm-up of this batch size
        times = []
        for _ in range(args.runs):
            st = steps_of(short_ids[:batch], 32)
            d = st[(st.num_prefill_tokens == 0) & (st.num_decode_tokens == batch)]
            times += list(d.step_time_s)
        decode[batch] = statistics.median(times)
    kv = eng.kv_spec.bytes_per_token   # the engine's own: its dtype and kv_cache_dtype
    return {"prefill_s": statistics.median(prefill_s), "decode16_s": decode[16], "decode1_s": decode[1],
            "weight_bytes": eng.runner.weight_footprint().streamed_bytes, "kv_bytes_per_token": kv,
            "cfg": eng.model_config}


def bf16_ceiling(ceil: dict) -> float:
    """The bf16 rate a step could reach here: the highest of the dot-product instruction rate
    (AVX-512 BF16), AMX's tile instruction rate and PyTorch's bf16 GEMM. With AMX the tiles are
    several times the vector rate (this script on the Intel Xeon host, 2026-12-06: 4,741-4,799
    GFLOP/s on two threads against 178-182, torch's bf16 GEMM 2,123-2,173), and a GEMM on them
    stays below the tiles' own rate, which is the honest ceiling. Without bf16 dot products (no AVX-512 BF16, no AMX) the fp32 FMA rate: bf16, int8 and
    int4 products run in float32 tiles there (gemm.linear, kernels/quant.py's prefill_tile_dtype)."""
    rates = [ceil.get(k) for k in ("bf16_dot", "bf16_tiles", "bf16_gemm_torch")]
    return max((r for r in rates if r), default=0.0) or ceil["fp32_fma"]


def fp32_high_ceiling(ceil: dict) -> float:
    """The rate of float32 products at fp32_matmul_precision="high": a third of the tile rate
    (three bf16 tile products per float32 one, kernels/bf16_gemm.c); without tiles the engine
    runs the exact float32 products, so the fp32 FMA rate."""
    return ceil["bf16_tiles"] / 3 if ceil.get("bf16_tiles") else ceil["fp32_fma"]


def step_rows(fmt: str, m: dict, ceil: dict, args) -> list[dict]:
    """One row per step type: what it did, how fast, and how far from its roofline."""
    from minserve.plan import budget
    cfg, w, kv, bw = m["cfg"], m["weight_bytes"], m["kv_bytes_per_token"], ceil["read_bandwidth"]
    # The fastest arithmetic the format's float activations can use here: bf16 products for
    # everything but fp32 itself (a quantized weight is expanded before the product).
    bf16 = bf16_ceiling(ceil)
    rate = (ceil["fp32_fma"] if fmt == "fp32" else
            (ceil["int8_dot"] or ceil["fp32_fma"]) if fmt.endswith("-a8") else
            fp32_high_ceiling(ceil) if fmt == "fp32-high" else bf16)
    ctx = 64 + 16   # the decode runs: 64-token prompts, the median step about 16 tokens in
    shapes = {"prefill": budget.prefill(cfg, w, kv, args.prefill_len, bw, rate),
              "decode, batch 16": budget.decode_step(cfg, w, kv, 16, ctx, bw, rate),
              "decode, batch 1": budget.decode_step(cfg, w, kv, 1, ctx, bw, rate)}
    times = {"prefill": m["prefill_s"], "decode, batch 16": m["decode16_s"], "decode, batch 1": m["decode1_s"]}
    rows = []
    for step, roof in shapes.items():
        t = times[step]
        rows.append({"format": fmt, "step": step, "ms": 1000 * t, "GFLOP/s": roof.flops / t / 1e9,
                     "% fp32 FMA": 100 * roof.flops / t / ceil["fp32_fma"],
                     "% bf16 ceiling": 100 * roof.flops / t / bf16,
                     "GB/s": roof.bytes / t / 1e9, "% bandwidth": 100 * roof.bytes / t / bw,
                     "bound": roof.bound, "roofline ms": 1000 * roof.seconds,
                     "% of roofline": 100 * roof.seconds / t})
    return rows


def markdown(ceil: dict, rows: list[dict]) -> str:
    def g(x):
        return "n/a" if x is None else f"{x / 1e9:,.0f}"
    lines = [f"Ceilings ({ceil['threads']} threads): fp32 FMA {g(ceil['fp32_fma'])} GFLOP/s, bf16 dot "
             f"{g(ceil['bf16_dot'])} GFLOP/s, AMX bf16 tiles {g(ceil.get('bf16_tiles'))} GFLOP/s, int8 dot "
             f"{g(ceil['int8_dot'])} GOP/s (instruction rates); "
             f"torch GEMM fp32 {g(ceil['fp32_gemm_torch'])}, bf16 {g(ceil['bf16_gemm_torch'])} GFLOP/s"
             f"{' (emulated here, not timed)' if ceil['bf16_gemm_torch'] is None else ''}; "
             f"read bandwidth {ceil['read_bandwidth'] / 1e9:.1f} GB/s (C loop "
             f"{ceil['read_bandwidth_c'] / 1e9:.1f}, torch.sum {ceil['read_bandwidth_torch'] / 1e9:.1f})", ""]
    return "\n".join(lines) + (_table(rows) if rows else "")


def _table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(v if isinstance(v, str) else "-" if v is None else f"{v:,.1f}"
                                       for v in r.values()) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(HERE))
    from bench_offline import machine_info
    print("measuring the ceilings ...", flush=True)
    before = ceilings()
    measured = {}
    if not args.ceilings_only:
        for fmt in args.format_list:
            print(f"timing {fmt} steps ...", flush=True)
            measured[fmt] = measure_steps(fmt, args)
        print("measuring the ceilings again ...", flush=True)
    ceil = merged_ceilings(before, ceilings() if measured else before)
    for key in ("fp32_fma", "read_bandwidth"):
        a, b = ceil["before"][key], ceil["after"][key]
        if a and b and max(a, b) > 1.2 * min(a, b):
            print(f"warning: the {key} ceiling moved from {a / 1e9:,.0f} to {b / 1e9:,.0f} G/s during "
                  "the run (the host's placement of this VM's vCPUs, or a neighbour): rerun", flush=True)
    rows = [r for fmt, m in measured.items() for r in step_rows(fmt, m, ceil, args)]
    print("timing the step's kernels by library ...", flush=True)
    kernels = kernel_rates()
    res = {"machine": machine_info(), "ceilings": ceil, "rows": rows, "kernels": kernels,
           "markdown": markdown(ceil, rows) + "\n\nGFLOP/s by library:\n\n" + _table(kernels)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print("\n" + res["markdown"] + f"\n\nresults: {out}")


if __name__ == "__main__":
    main()
