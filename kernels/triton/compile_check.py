"""Compile the kernels for an NVIDIA GPU on a machine that has none (ahead of time, no launch).

The interpreter (TRITON_INTERPRET=1) checks what a kernel computes, but runs it with numpy: it never
lowers the kernel to PTX, so a layout the GPU compiler rejects (a reshape it cannot do, a dot shape
the tensor cores do not take) would first show up on the GPU. This module runs each launcher under
``capture_launches`` on small CPU tensors, specialises the recorded arguments as Triton's JIT would
(dtypes, 16-divisible integers and pointers, integers equal to 1), and compiles the result down to
a cubin for the target architecture with the ptxas that ships in the Triton wheel.

    python -m minserve.kernels.triton.compile_check            # sm_90 (H100/H200), every config
    python -m minserve.kernels.triton.compile_check --quick    # one config per kernel

Must run *without* TRITON_INTERPRET (the kernels have to be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from . import reference as R
from ._checks import capture_launches
from .paged_decode import paged_decode
from .w4a16 import w4a16_matmul
from .w8a16 import w8a16_matmul

_OPTIONS = ("num_warps", "num_stages")


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int = 90):
    """Compile one recorded launch for ``cuda:<arch>``; returns the compiled kernel."""
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in _OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _cases(quick: bool):
    """(label, thunk) pairs: each thunk calls a launcher on small CPU tensors shaped like the real
    ones, so the launcher picks the same block sizes and constexprs it would on the GPU."""
    dtypes = (torch.float16,) if quick else (torch.float16, torch.bfloat16, torch.float32)
    ms = (1,) if quick else (1, 32, 128)
    for dt in dtypes:
        for m in ms:
            x = torch.randn(m, 256, dtype=dt)
            codes, scales = R.quantize_w8(torch.randn(8192, 256))
            yield f"w8a16 {dt} M={m}", lambda x=x, c=codes, s=scales: w8a16_matmul(x, c, s)
            for g in ((32,) if quick else (32, 128)):
                packed, sc, mn = R.quantize_w4(torch.randn(64, 256), g)
                bias = torch.randn(64, dtype=dt)
                yield (f"w4a16 {dt} M={m} g={g}",
                       lambda x=x, p=packed, s=sc, z=mn, g=g, b=bias: w4a16_matmul(x, p, s, z, g, b))
        for heads, kv_heads, d in (((9, 3, 64),) if quick else ((9, 3, 64), (32, 32, 128))):
            for int8 in (False, True):
                for splits in (1, 4):
                    q = torch.randn(2, heads, d, dtype=dt)
                    if int8:
                        k, ks = R.allocate_kv_int8(8, 16, kv_heads, d)
                        v, vs = R.allocate_kv_int8(8, 16, kv_heads, d)
                    else:
                        k = torch.zeros(8, 16, kv_heads, d, dtype=dt)
                        v, ks, vs = k.clone(), None, None
                    tables = torch.arange(8).view(2, 4)
                    lens = torch.tensor([5, 64])
                    yield (f"paged_decode {dt} H={heads}/{kv_heads} D={d} int8={int8} splits={splits}",
                           lambda a=(q, k, v, tables, lens, ks, vs), s=splits: paged_decode(*a, num_splits=s))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--quick", action="store_true", help="one configuration per kernel")
    args = ap.parse_args(argv)
    failures = 0
    for label, call in _cases(args.quick):
        with capture_launches() as launches:
            call()
        for kernel, _grid, a, kw in launches:
            t = time.perf_counter()
            try:
                compiled = compile_launch(kernel, a, kw, args.arch)
                print(f"ok   {label} {kernel.__name__}: {time.perf_counter() - t:.1f}s, "
                      f"{compiled.metadata.shared} B shared", flush=True)
            except Exception as e:  # report every failure, not only the first
                failures += 1
                print(f"FAIL {label} {kernel.__name__}: {type(e).__name__}: {e}", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
