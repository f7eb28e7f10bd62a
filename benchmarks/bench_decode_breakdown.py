"""Where a batch-1 decode step goes, and how long loading takes.

Backs the README's explanation of batch-1 decode speed with numbers from this machine:
- one decode token (context ~300 tokens) through the PyTorch model (``fused_decode=False``),
- the same step through the fused C kernel (minserve/kernels/decode.py, the default on CPU),
- the 121 weight matrix-vector products alone in PyTorch (the part the roofline counts), as GB/s,
- the remainder of each path: the small per-layer operations (norms, RoPE, KV writes, attention,
  residuals) and, for PyTorch, the cost of dispatching ~35 of them per layer from Python;
and the load times: a fresh Python process that imports minserve and builds `LLM(model)` from the
cache (warm), and optionally the first-use GGUF conversion into an empty cache (`--cold`).

    .venv/bin/python benchmarks/bench_decode_breakdown.py [--cold]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

LOAD_SNIPPET = ("import time; t = time.perf_counter(); from minserve import LLM; llm = LLM({model!r}); "
                "print(time.perf_counter() - t, llm.llm_engine.load_time_s)")


def timed_ms(fn, repeats: int = 5, inner: int = 10) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` calls, in ms."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t) / inner * 1e3)
    return statistics.median(runs)


def decode_breakdown(model: str) -> dict:
    from minserve import LLM
    from minserve.attention import build_attention_metadata
    from minserve.models.layers import Linear
    llm = LLM(model, kv_cache_memory="256MiB")
    m, kv = llm.llm_engine.runner.model, llm.llm_engine.runner.kv_caches
    meta = build_attention_metadata([1], [300], [list(range(20))], llm.llm_engine.kv_spec.block_size)
    args = (torch.tensor([5]), torch.tensor([300]), kv, meta, torch.tensor([0]))
    weights = [mod.weight for mod in m.modules() if isinstance(mod, Linear)]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    fused = llm.llm_engine.runner.fused
    if fused is None:
        raise SystemExit("the fused decode kernel is unavailable here (see the engine's log)")
    forward_ms = timed_ms(lambda: m(*args))
    fused_ms = timed_ms(lambda: fused(args[0], args[1], meta.groups[0].kv_blocks, args[4]))
    gemv_ms = timed_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {"matrices": len(weights), "weight_mb": nbytes / 1e6, "forward_ms": forward_ms,
            "fused_ms": fused_ms, "gemv_ms": gemv_ms, "gemv_gb_s": nbytes / gemv_ms / 1e6}


def load_seconds(model: str, cache: str | None) -> tuple[float, float]:
    env = dict(os.environ, MINSERVE_LOG_LEVEL="WARNING")
    if cache:
        env["MINSERVE_CACHE"] = cache
    out = subprocess.run([sys.executable, "-c", LOAD_SNIPPET.format(model=model)], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cold", action="store_true", help="also time the first-use conversion")
    a = ap.parse_args()
    load_seconds(a.model, None)  # make sure the cache exists before timing warm loads
    warm = [load_seconds(a.model, None) for _ in range(3)]
    b = decode_breakdown(a.model)
    print(f"\n{a.model}, batch-1 decode step at ~300 tokens of context, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    g = b["gemv_ms"]
    print(f"{b['matrices']} weight GEMVs alone (PyTorch):   {g:.1f} ms ({b['weight_mb']:.0f} MB at "
          f"{b['gemv_gb_s']:.1f} GB/s)")
    print(f"decode step, PyTorch model:        {b['forward_ms']:.1f} ms (GEMVs + {b['forward_ms'] - g:.1f} ms)")
    print(f"decode step, fused C kernel:       {b['fused_ms']:.1f} ms (GEMVs {b['fused_ms'] - g:+.1f} ms)")
    proc = statistics.median(w[0] for w in warm)
    eng = statistics.median(w[1] for w in warm)
    print(f"\nwarm load, fresh process (median of 3): {proc:.1f} s (engine construction {eng:.1f} s)")
    if a.cold:
        with tempfile.TemporaryDirectory() as empty:
            total, engine = load_seconds(a.model, empty)
        print(f"cold load into an empty cache (GGUF conversion): {total:.1f} s (engine {engine:.1f} s)")


if __name__ == "__main__":
    main()
