"""Check every Triton kernel against its torch reference on a CUDA GPU and time it against the roofline.

    python kernels/bench_gpu.py --out results.json

Needs only torch and triton (it loads kernels/triton/ by path, not through ``minserve``). For each
kernel, dtype (fp16, bf16) and shape it prints and records: the max error against the float32
reference, the median time (``triton.testing.do_bench``, L2 flushed before every run), the bytes the
kernel must move divided by that time, and that rate as a share of the bandwidth of a large
device-to-device copy measured in the same run. Decode-sized matmuls and decode attention are
memory-bound, so % of copy bandwidth is the number that says how close to the hardware limit a
kernel is (at M=128 the matmuls start to be compute-bound; TFLOP/s is recorded too).
``torch_linear`` rows time cuBLAS on the dequantized fp16/bf16 weights: the bytes fused
dequantization saves.

Robust by design, since it may run once on a borrowed machine: every case is wrapped (a failure
prints its traceback and the run goes on), the JSON is rewritten after every case, and cases past
--budget-s seconds are recorded as skipped. Without a CUDA GPU it says so and exits 0.
``--cpu-interpret`` runs a few tiny cases under the Triton interpreter to test this script itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# `python kernels/bench_gpu.py` puts kernels/ first on sys.path, where kernels/triton/ would shadow
# the real triton package (torch imports it too): drop that entry before importing anything.
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != HERE]

import argparse  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

# (model, layer, N, K, W4 group): SmolLM2-135M (hidden 576, 9 heads of 64, 3 kv heads, intermediate
# 1536, vocab 49152) and a Llama-7B-sized layer.
MATMUL_SHAPES = [
    ("smollm2-135m", "qkv_proj", 576 + 2 * 192, 576, 32),
    ("smollm2-135m", "o_proj", 576, 576, 32),
    ("smollm2-135m", "gate_up_proj", 2 * 1536, 576, 32),
    ("smollm2-135m", "down_proj", 576, 1536, 32),
    ("smollm2-135m", "lm_head", 49152, 576, 32),
    ("llama-7b", "q_proj", 4096, 4096, 128),
    ("llama-7b", "up_proj", 11008, 4096, 128),
    ("llama-7b", "down_proj", 4096, 11008, 128),
]
BATCHES = (1, 16, 128)
ATTN_MODELS = [("smollm2-135m", 9, 3, 64), ("llama-7b", 32, 32, 128)]  # heads, kv heads, head dim
ATTN_BATCHES, ATTN_CONTEXTS, BLOCK_SIZE = (1, 16, 64), (512, 4096), 16
TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-4}  # max error / max |reference|


def _load_kernels():
    """kernels/triton/ as a private top-level package (its imports are relative, torch and triton)."""
    name, pkg = "_minserve_triton_kernels", HERE / "triton"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return types.SimpleNamespace(**{m: importlib.import_module(f"{name}.{m}")
                                    for m in ("reference", "w8a16", "w4a16", "paged_decode")})


class Bench:
    def __init__(self, args, torch, triton, k):
        self.args, self.torch, self.triton, self.k = args, torch, triton, k
        self.device = "cpu" if args.cpu_interpret else "cuda"
        self.start = time.perf_counter()
        self.result = {"status": "running", "argv": sys.argv, "rows": [], "failures": 0,
                       "python": platform.python_version(), "torch": torch.__version__,
                       "triton": getattr(triton, "__version__", "?")}
        self.copy_gbps = None

    # ------------------------------------------------------------------------------ bookkeeping
    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        os.replace(tmp, out)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.args.budget_s

    def time_ms(self, fn) -> float:
        if self.device == "cpu":
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t) * 1e3)
            return statistics.median(runs)
        try:
            return self.triton.testing.do_bench(fn, warmup=10, rep=self.args.rep_ms, return_mode="median")
        except TypeError:  # an older do_bench without return_mode: CUDA events, median of 50
            torch = self.torch
            fn()
            times = []
            for _ in range(50):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            return statistics.median(times)

    def header(self) -> None:
        print(f"\n{'kernel':<20} {'dtype':<8} {'model':<13} {'shape':<34} {'max err':>9} {'rel':>8} "
              f"{'us':>9} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8}", flush=True)

    def case(self, row: dict, run) -> None:
        """Run one case; ``run`` fills in the row (and may raise). Always records and saves."""
        if self.over_budget():
            row["status"] = f"skipped: past the {self.args.budget_s:.0f} s budget"
        else:
            try:
                run(row)
                row["status"] = "ok" if row.get("rel_err", 0.0) <= TOLERANCE[row["dtype"]] else "WRONG"
            except Exception as e:  # keep going: one broken kernel must not hide the others
                traceback.print_exc()
                row["status"] = "error"
                row["error"] = f"{type(e).__name__}: {e}"
                if self.device == "cuda":
                    self.torch.cuda.empty_cache()
        if row["status"] in ("error", "WRONG"):
            self.result["failures"] += 1
        gbps = row.get("GBps")
        row["pct_of_copy"] = round(100 * gbps / self.copy_gbps, 1) if gbps and self.copy_gbps else None

        def fmt(key, spec):
            return "-" if row.get(key) is None else format(row[key], spec)
        print(f"{row['kernel']:<20} {row['dtype']:<8} {row['model']:<13} {row['shape']:<34} "
              f"{fmt('max_abs_err', '.2e'):>9} {fmt('rel_err', '.1e'):>8} {fmt('us', '.1f'):>9} "
              f"{fmt('GBps', '.0f'):>8} {fmt('pct_of_copy', '.0f'):>6} {fmt('TFLOPs', '.1f'):>8}"
              + ("" if row["status"] == "ok" else f"  <- {row['status']}"), flush=True)
        self.result["rows"].append(row)
        self.save()

    def measure(self, row: dict, fn, out, ref, nbytes: int, flops: int = 0) -> None:
        err = (out.float() - ref.float()).abs().max().item()
        row["max_abs_err"] = err
        row["rel_err"] = err / (ref.float().abs().max().item() or 1.0)
        ms = self.time_ms(fn)
        row["us"], row["bytes"] = ms * 1e3, nbytes
        row["GBps"] = nbytes / (ms * 1e-3) / 1e9
        if flops:
            row["TFLOPs"] = flops / (ms * 1e-3) / 1e12

    # --------------------------------------------------------------------------------- sections
    def copy_bandwidth(self) -> None:
        torch = self.torch
        n = (1 << 30) if self.device == "cuda" else (1 << 24)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        src.fill_(1)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        self.copy_gbps = 2 * n / (ms * 1e-3) / 1e9  # read + write
        self.result["copy_bandwidth_GBps"] = round(self.copy_gbps, 1)
        print(f"device-to-device copy of {n >> 20} MiB: {ms * 1e3:.0f} us, {self.copy_gbps:.0f} GB/s "
              "(read + write): the roofline below", flush=True)
        src = dst = None   # free the buffers (closures above are done with them)

    def matmuls(self, dtypes, shapes, batches) -> None:
        torch, R = self.torch, self.k.reference
        for model, layer, n, k, group in shapes:
            try:
                w = torch.randn(n, k, device=self.device) * 0.02
                codes, scales = R.quantize_w8(w)
                packed, g_scales, g_mins = R.quantize_w4(w, group)
            except Exception:
                traceback.print_exc()
                continue
            for dt_name in dtypes:
                dt = getattr(torch, dt_name)
                for m in batches:
                    shape = f"{layer} M={m} N={n} K={k}"
                    base = dict(model=model, dtype=dt_name, M=m, N=n, K=k)
                    x = torch.randn(m, k, device=self.device, dtype=dt)
                    act = (m * k + m * n) * x.element_size()

                    def w8(row, x=x):
                        fn = lambda: self.k.w8a16.w8a16_matmul(x, codes, scales)  # noqa: E731
                        self.measure(row, fn, fn(), R.w8a16_matmul_reference(x, codes, scales),
                                     n * k + 4 * n + act, 2 * m * n * k)

                    def w4(row, x=x):
                        fn = lambda: self.k.w4a16.w4a16_matmul(x, packed, g_scales, g_mins, group)  # noqa: E731
                        ref = R.w4a16_matmul_reference(x, packed, g_scales, g_mins, group)
                        self.measure(row, fn, fn(), ref, n * k // 2 + 8 * n * (k // group) + act, 2 * m * n * k)

                    def dense(row, x=x):
                        wd = R.dequantize_w8(codes, scales).to(dt)
                        fn = lambda: torch.nn.functional.linear(x, wd)  # noqa: E731
                        ref = R.w8a16_matmul_reference(x, codes, scales)
                        self.measure(row, fn, fn(), ref, n * k * x.element_size() + act, 2 * m * n * k)

                    self.case(dict(kernel="w8a16", shape=shape, **base), w8)
                    self.case(dict(kernel="w4a16", shape=shape + f" g={group}", group=group, **base), w4)
                    self.case(dict(kernel="torch_linear", shape=shape, **base), dense)
            w = codes = scales = packed = g_scales = g_mins = None   # free before the next shape

    def attention(self, dtypes, models, batches, contexts) -> None:
        torch = self.torch
        for model, heads, kv_heads, d in models:
            for dt_name in dtypes:
                dt = getattr(torch, dt_name)
                for b in batches:
                    for ctx in contexts:
                        for int8 in (False, True):
                            shape = f"B={b} ctx={ctx} H={heads}/{kv_heads} D={d}"
                            row = dict(kernel="paged_decode" + ("_int8kv" if int8 else ""), model=model,
                                       dtype=dt_name, shape=shape, B=b, context=ctx, heads=heads,
                                       kv_heads=kv_heads, head_dim=d, block_size=BLOCK_SIZE)
                            self.case(row, lambda row, a=(b, ctx, heads, kv_heads, d, dt, int8):
                                      self._attention_case(row, *a))
                            if self.device == "cuda":
                                torch.cuda.empty_cache()

    def _attention_case(self, row, b, ctx, heads, kv_heads, d, dt, int8) -> None:
        torch, R, pd = self.torch, self.k.reference, self.k.paged_decode
        per_seq = -(-ctx // BLOCK_SIZE)
        num_blocks = b * per_seq
        # Shuffled tables (a pool's blocks are not consecutive) and lengths that end inside a block.
        tables = torch.randperm(num_blocks, device=self.device).view(b, per_seq)
        lens = ctx - torch.randint(0, BLOCK_SIZE, (b,), device=self.device)
        shape = (num_blocks, BLOCK_SIZE, kv_heads, d)
        q = torch.randn(b, heads, d, device=self.device, dtype=dt)
        if int8:
            k, ks = R.quantize_kv_int8(torch.randn(shape, device=self.device))
            v, vs = R.quantize_kv_int8(torch.randn(shape, device=self.device))
        else:
            k, v = torch.randn(shape, device=self.device, dtype=dt), torch.randn(shape, device=self.device, dtype=dt)
            ks = vs = None
        row["num_splits"] = pd._choose_splits(q.device, b, kv_heads, per_seq * BLOCK_SIZE, 64)
        tokens = int(lens.sum().item())
        kv_bytes = tokens * kv_heads * (d * k.element_size() + (4 if int8 else 0)) * 2
        nbytes = kv_bytes + 2 * q.numel() * q.element_size() + tables.numel() * 8
        fn = lambda: pd.paged_decode(q, k, v, tables, lens, ks, vs)  # noqa: E731
        ref = R.paged_decode_reference(q, k, v, tables, lens, ks, vs)
        self.measure(row, fn, fn(), ref, nbytes, 4 * tokens * heads * d)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_gpu.json", help="where to write the JSON results")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip cases that would start after this")
    ap.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per case")
    ap.add_argument("--cpu-interpret", action="store_true",
                    help="tiny cases on the CPU under the Triton interpreter (tests this script)")
    args = ap.parse_args(argv)
    result = {"status": "starting", "rows": []}
    # Triton reads this when a kernel is decorated, its own library's included: set it (or clear
    # it) before triton is first imported.
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.pop("TRITON_INTERPRET", None):
        print("note: TRITON_INTERPRET unset: this benchmark times compiled kernels")

    def save_plain():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    try:
        import torch
    except ImportError as e:
        print(f"bench_gpu.py needs torch: {e}")
        result["status"] = f"error: {e}"
        save_plain()
        return 1
    if not args.cpu_interpret and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU and found none: nothing to measure here.")
        result["status"] = "skipped: no CUDA GPU"
        save_plain()
        return 0
    try:
        import triton
        import triton.testing  # noqa: F401
        kernels = _load_kernels()
    except Exception as e:
        traceback.print_exc()
        result["status"] = f"error: cannot load the Triton kernels: {type(e).__name__}: {e}"
        save_plain()
        return 1

    bench = Bench(args, torch, triton, kernels)
    torch.manual_seed(0)
    if args.cpu_interpret:
        bench.result["device"] = "cpu (Triton interpreter)"
        plan = dict(dtypes=("float16", "float32"), shapes=[("tiny", "proj", 40, 64, 32)], batches=(1, 3),
                    models=[("tiny", 4, 2, 16)], attn_batches=(2,), contexts=(40,))
    else:
        props = torch.cuda.get_device_properties(0)
        bench.result.update(device=props.name, sm_count=props.multi_processor_count,
                            memory_GiB=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
              f"triton {bench.result['triton']}", flush=True)
        plan = dict(dtypes=("float16", "bfloat16"), shapes=MATMUL_SHAPES, batches=BATCHES, models=ATTN_MODELS,
                    attn_batches=ATTN_BATCHES, contexts=ATTN_CONTEXTS)
    try:
        try:
            bench.copy_bandwidth()
        except Exception:
            traceback.print_exc()
        bench.header()
        # One dtype at a time, every kernel: should the time budget run out, the first dtype is whole.
        sections = [section for dt in plan["dtypes"] for section in (
            (bench.matmuls, ((dt,), plan["shapes"], plan["batches"])),
            (bench.attention, ((dt,), plan["models"], plan["attn_batches"], plan["contexts"])))]
        for section, section_args in sections:
            try:
                section(*section_args)
            except Exception as e:  # a section that breaks outside a case (an OOM making inputs, ...)
                traceback.print_exc()
                bench.result["failures"] += 1
                bench.result.setdefault("section_errors", []).append(f"{section.__name__}: {type(e).__name__}: {e}")
        rows = bench.result["rows"]
        done = sum(r["status"] == "ok" for r in rows)
        bench.result["status"] = "done" if not bench.result["failures"] else "done with failures"
        print(f"\n{done} of {len(rows)} cases ok, {bench.result['failures']} failed, "
              f"{sum(r['status'].startswith('skipped') for r in rows)} skipped; "
              f"{time.perf_counter() - bench.start:.0f} s")
    except BaseException as e:  # even Ctrl-C leaves a JSON behind
        traceback.print_exc()
        bench.result["status"] = f"aborted: {type(e).__name__}: {e}"
    finally:
        bench.result["elapsed_s"] = round(time.perf_counter() - bench.start, 1)
        bench.save()
        print(f"results: {args.out}")
    return 0 if bench.result["status"] == "done" else 1


if __name__ == "__main__":
    raise SystemExit(main())
