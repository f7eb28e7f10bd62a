"""int8 / int4 linear kernels (kernels/quant.c) against PyTorch's fp32 F.linear, as weight GB/s.

At decode sizes a linear layer streams its weight once per call, so the figure that matters is
weight bytes / time: the bytes the format stores (codes + scales + mins), not fp32-equivalent
bytes. Equal GB/s means int8 runs 4x and int4 5.3x (g32) to 7.1x (g128) faster than fp32.
Shapes are SmolLM2-135M's ([out x in]): down_proj 576x1536, gate/up 1536x576, the LM head 49152x576;
int4 is timed with g32 and with g128 (g64 where 128 does not divide in_features, as for 576).

    .venv/bin/python benchmarks/bench_quant_kernels.py             # batch 1 and 16, GB/s from DRAM
    .venv/bin/python benchmarks/bench_quant_kernels.py --hot       # the same, weights hot in cache
    .venv/bin/python benchmarks/bench_quant_kernels.py --prefill   # fused C vs dequant+torch, B=16..512
    .venv/bin/python benchmarks/bench_quant_kernels.py --exactness # what each format keeps of SmolLM2's weights
    .venv/bin/python benchmarks/bench_quant_kernels.py --a8        # int8 activations vs fp32, GFLOP/s

Medians of single calls (timed_ms says why); the host is shared, so compare ratios from one run,
and run it on a quiet machine (the load average is printed first): with one busy neighbour on
2 cores, every two-thread call waits a scheduler slice (a flat ~8 ms) and the table is noise.

Measured on the 2-core AMD EPYC (AVX-512), quiet (load 1.2), 2 threads, from DRAM; GB/s of the
bytes each format stores (scales and mins included) and speed against fp32 F.linear:
    shape      batch  fp32        int8              int4 g32          int4 g64/g128
    49152x576  1      11.4 GB/s   25.6 GB/s  8.9x   24.9 GB/s  11.7x  23.6 GB/s  13.3x
    1536x576   1      11.6        19.6       6.7x   14.7       6.8x   12.8       7.1x
    576x1536   1      14.8        14.4       3.9x   13.7       4.9x   10.6       5.1x
    49152x576  16      5.6         4.8       3.4x    3.5       3.4x    3.1       3.5x
    1536x576   16      7.3         4.6       2.5x    3.0       2.2x    2.6       2.3x
The small matrices take 43-62 us a call, much of it a fixed cost per call (Python checks, the
ctypes call, the OpenMP fork/join): with the weights hot in cache (--hot) int8 still takes 31 us
and int4 41 us. Batch 16 is compute-bound (16 multiply-adds per weight on 2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch
import torch.nn.functional as F

from minserve.kernels.quant import int4_linear, int8_linear
from minserve.quant.formats import quantize_int4, quantize_int8, reproduction

SHAPES = [(576, 1536), (1536, 576), (49152, 576)]


def timed_ms(fn, min_time_s: float = 0.3) -> float:
    """Median time of one call, in ms, over calls made for ``min_time_s`` (at least 5).

    Each call is timed alone: on a shared 2-core host a thread of the team is now and then
    descheduled and that call takes a whole scheduler slice (~8 ms); a mean over a loop of calls
    would count those slices, the median of single calls ignores them.
    """
    for _ in range(3):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_time_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def formats_for(w: torch.Tensor, stream_bytes: int = 0) -> dict[str, tuple[int, callable]]:
    """name -> (weight bytes, fn(x, path) -> y) for fp32 and each quantized format of ``w``.

    With ``stream_bytes``, each format holds enough copies of its tensors to fill that many bytes
    and each call uses the next copy, so the weights come from DRAM as in a real decode step (a
    576x1536 matrix alone would stay in the 32 MiB L3 and time the cache instead).
    """
    codes, scales = quantize_int8(w)
    # g128 where it divides in_features; 576 = 4.5 x 128, so SmolLM2's 576-wide inputs get g64.
    g_big = 128 if w.shape[1] % 128 == 0 else 64
    tensors = {"fp32": (w,), "int8": (codes, scales),
               **{f"int4 g{g}": quantize_int4(w, g) for g in (32, g_big)}}
    calls = {"fp32": lambda x, path, t: F.linear(x, t[0]),
             "int8": lambda x, path, t: int8_linear(x, *t, path=path)}
    out = {}
    for name, ts in tensors.items():
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        copies = [ts] + [tuple(t.clone() for t in ts) for _ in range(stream_bytes // nbytes)]
        call = calls.get(name) or (lambda x, path, t, g=int(name[6:]): int4_linear(x, *t, g, path=path))
        rotation = itertools.cycle(copies)
        out[name] = (nbytes, lambda x, path, call=call, rotation=rotation: call(x, path, next(rotation)))
    return out


def decode_table(batches: list[int], stream_bytes: int) -> None:
    print(f"weights {'streamed from DRAM' if stream_bytes else 'hot in cache'}")
    print("| shape [out x in] | batch | format | weight MB | ms | GB/s | x fp32 speed |")
    print("|---|---|---|---|---|---|---|")
    for out, inn in SHAPES:
        w = torch.randn(out, inn) * 0.02
        fmts = formats_for(w, stream_bytes)
        for batch in batches:
            x = torch.randn(batch, inn)
            fp32_ms = None
            for name, (nbytes, fn) in fmts.items():
                ms = timed_ms(lambda: fn(x, "fused"))
                fp32_ms = fp32_ms or ms
                print(f"| {out}x{inn} | {batch} | {name} | {nbytes / 1e6:.2f} | {ms:.3f} | "
                      f"{nbytes / ms / 1e6:.1f} | {fp32_ms / ms:.2f} |")


def prefill_table(batches: list[int]) -> None:
    print("| shape [out x in] | batch | format | fp32 ms | fused C ms | dequant+torch ms |")
    print("|---|---|---|---|---|---|")
    for out, inn in SHAPES:
        w = torch.randn(out, inn) * 0.02
        fmts = formats_for(w)
        for batch in batches:
            x = torch.randn(batch, inn)
            fp32_ms = timed_ms(lambda: F.linear(x, w), min_time_s=0.2)
            for name, (_, fn) in fmts.items():
                if name == "fp32":
                    continue
                fused = timed_ms(lambda: fn(x, "fused"), min_time_s=0.2)
                deq = timed_ms(lambda: fn(x, "dequant"), min_time_s=0.2)
                print(f"| {out}x{inn} | {batch} | {name} | {fp32_ms:.2f} | {fused:.2f} | {deq:.2f} |")


def a8_table(batches: list[int], rounds: int = 15) -> None:
    """GFLOP/s (2 x batch x in x out over the time) of the int8-activation loops (W4A8 g32, W8A8)
    beside the float products the engine would otherwise run: minserve/models/gemm.py's float32
    linear (oneDNN on AMD, MKL on Intel) and W4A16 g32 (kernels/quant.py's auto path). The calls
    alternate within each round and every figure is a median over rounds, so a noisy neighbour
    hurts all columns alike."""
    from minserve.kernels.quant import a8_isa, linear_a8
    from minserve.models import gemm
    print(f"int8-activation loops: {a8_isa()}")
    print("| shape [out x in] | batch | fp32 linear | W4A16 g32 | W4A8 g32 | W8A8 | W4A8 / fp32 |")
    print("|---|---|---|---|---|---|---|")
    for (out, inn), batch in itertools.product(SHAPES[:2], batches):
        g = torch.Generator().manual_seed(out + batch)
        w, x = torch.randn(out, inn, generator=g), torch.randn(batch, inn, generator=g)
        p4, c8 = quantize_int4(w, 32), quantize_int8(w)
        fns = [lambda: gemm.linear(x, w), lambda: int4_linear(x, *p4, 32),
               lambda: linear_a8(x, 4, *p4, 32), lambda: linear_a8(x, 8, *c8, None, 0)]
        times: list[list[float]] = [[] for _ in fns]
        for fn in fns:
            fn()
        for _ in range(rounds):
            for fn, ts in zip(fns, times):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
        rate = [2 * batch * inn * out / statistics.median(ts) / 1e9 for ts in times]
        print(f"| {out}x{inn} | {batch} | " + " | ".join(f"{r:.1f}" for r in rate) + f" | {rate[2] / rate[0]:.2f} |")


def exactness() -> None:
    """How much of the cached SmolLM2-135M weights (GGUF Q4_1, dequantized) each format reproduces."""
    from safetensors import safe_open
    from minserve.config import cache_dir
    path = cache_dir() / "smollm2-135m" / "model.safetensors"
    if not path.exists():
        print(f"{path} does not exist: load the default model once (minserve prepare) first")
        return
    # The GGUF stores the linear layers as Q4_1 but the (tied) embedding as Q8_0: counted apart.
    totals: dict[tuple, list[float]] = {}   # (part, format) -> [exact, squared error, squared norm, n]
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            w = f.get_tensor(name).float()
            if w.dim() != 2:
                continue
            for fmt, g in (("int4", 32), ("int4", 64), ("int8", None)):
                r = reproduction(w, fmt, g)
                part = "embedding (Q8_0 in the GGUF)" if "embed" in name else "linear layers (Q4_1)"
                t = totals.setdefault((part, r.format), [0.0, 0.0, 0.0, 0])
                sq = float(w.square().sum())
                t[0] += r.exact_fraction * w.numel()
                t[1] += r.relative_error ** 2 * sq
                t[2] += sq
                t[3] += w.numel()
    for (part, fmt), (exact, err, norm, n) in totals.items():
        print(f"{part}, {fmt}: {n} weights, exact {exact / n:.4%}, relative error {(err / norm) ** 0.5:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--exactness", action="store_true")
    ap.add_argument("--a8", action="store_true", help="int8 activations against the float products")
    ap.add_argument("--hot", action="store_true", help="reuse one copy of each matrix (cache-resident)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.exactness:
        exactness()
    elif args.a8:
        a8_table([1, 16, 256, 1024])
    elif args.prefill:
        prefill_table([16, 32, 64, 96, 128, 256, 512])
    else:
        decode_table([1, 16], 0 if args.hot else 256 * 2**20)


if __name__ == "__main__":
    main()
