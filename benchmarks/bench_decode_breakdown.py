"""Where a batch-1 decode step goes, and how long loading takes.

Backs docs/engine/fused-step.md's explanation of batch-1 decode speed with numbers from this machine:
- one decode token (context ~300 tokens) through the PyTorch model (``fused_decode=False``),
- the same step through the fused C kernel (kernels/decode.py, the default on CPU),
- the 121 weight matrix-vector products alone in PyTorch (the part the roofline counts), as GB/s,
- the remainder of each path: the small per-layer operations (norms, RoPE, KV writes, attention,
  residuals) and, for PyTorch, the cost of dispatching ~35 of them per layer from Python;
- a decode step of 1, 4 and 16 sequences on both paths (where the batched kernel stops being
  memory-bound);
and the load times: a fresh Python process that imports minserve and builds `LLM(model)` from the
cache (warm), and optionally the first use into an empty cache (`--cold`): GGUF conversion and
the fused decode kernel's compilation.

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


def step_ms(llm, batch: int, context: int = 300) -> tuple[float, float]:
    """(PyTorch model, fused kernel) time of one decode step of ``batch`` sequences."""
    from minserve.attention import build_attention_metadata
    runner, bs = llm.llm_engine.runner, llm.llm_engine.kv_spec.block_size
    per_seq = context // bs + 1
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    meta = build_attention_metadata([1] * batch, [context] * batch, tables, bs)
    ids, pos, rows = torch.full((batch,), 5), torch.full((batch,), context), torch.arange(batch)
    torch_ms = timed_ms(lambda: runner.model(ids, pos, runner.kv_caches, meta, rows))
    fused_ms = timed_ms(lambda: runner.fused(ids, pos, meta.groups[0].kv_blocks, rows))
    return torch_ms, fused_ms


def decode_breakdown(model: str) -> dict:
    from minserve import LLM
    from minserve.models.layers import Linear
    llm = LLM(model, kv_cache_memory="256MiB")
    if llm.llm_engine.runner.fused is None:
        raise SystemExit("the fused decode kernel is unavailable here (see the engine's log)")
    weights = [mod.weight for mod in llm.llm_engine.runner.model.modules() if isinstance(mod, Linear)]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    gemv_ms = timed_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    batches = {b: step_ms(llm, b) for b in (1, 4, 16)}
    return {"matrices": len(weights), "weight_mb": nbytes / 1e6, "forward_ms": batches[1][0],
            "fused_ms": batches[1][1], "gemv_ms": gemv_ms, "gemv_gb_s": nbytes / gemv_ms / 1e6,
            "batches": batches}


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
    print("\ndecode step of B sequences (~300 tokens of context each), ms: PyTorch model | fused kernel")
    for batch, (t, f) in b["batches"].items():
        print(f"  B={batch:<3} {t:7.1f} | {f:7.1f}   ({t / f:.2f}x)")
    proc = statistics.median(w[0] for w in warm)
    eng = statistics.median(w[1] for w in warm)
    print(f"\nwarm load, fresh process (median of 3): {proc:.1f} s (engine construction {eng:.1f} s)")
    if a.cold:
        with tempfile.TemporaryDirectory() as empty:
            total, engine = load_seconds(a.model, empty)
        print(f"cold load into an empty cache (GGUF conversion + kernel build): {total:.1f} s "
              f"(engine {engine:.1f} s)")
        with tempfile.TemporaryDirectory() as empty:
            os.environ["MINSERVE_CACHE"] = empty
            from minserve.kernels.build import build
            t = time.perf_counter()
            build("decode")
            print(f"of which compiling the fused decode kernel: {time.perf_counter() - t:.1f} s")
            del os.environ["MINSERVE_CACHE"]


if __name__ == "__main__":
    main()
