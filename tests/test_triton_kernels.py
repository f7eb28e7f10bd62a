"""The Triton kernels (kernels/triton/) against their torch references, on the CPU.

Triton decides at decoration time (``@triton.jit``) whether a function is compiled for a GPU or run
by its numpy interpreter, from ``TRITON_INTERPRET`` -- for its own library's jit functions too, which
are decorated when ``triton`` is first imported. So the ``tk`` fixture, for this module only, sets
the variable and imports fresh copies of triton and the kernel modules (setting aside any copies
already imported); on teardown it drops the interpreted copies, puts the set-aside ones back and
unsets the variable, so the rest of the process sees neither (triton's C extension is shared).

The interpreter is slow and has no bfloat16: shapes are small and computed in float32 (one float16
case each); kernels/bench_gpu.py covers fp16/bf16 on a GPU. What the interpreter cannot catch, a
kernel the GPU compiler would reject, one test catches by compiling every kernel for sm_90
(H100/H200) in a subprocess without the interpreter; another runs bench_gpu.py's own CPU mode.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minserve.kernels.triton import reference as R  # noqa: E402  (torch only, no triton)

ROOT = Path(__file__).resolve().parent.parent
PKG = "minserve.kernels.triton"
KERNEL_MODULES = ("w8a16", "w4a16", "paged_decode")


def _set_aside_triton() -> dict:
    """Remove (and return) triton's Python modules and ours that import it from sys.modules."""
    ours = {f"{PKG}.{m}" for m in (*KERNEL_MODULES, "compile_check")}
    return {n: sys.modules.pop(n) for n in list(sys.modules)
            if n in ours or ((n == "triton" or n.startswith("triton.")) and not n.startswith("triton._C"))}


def _interpreter_unusable() -> str | None:
    """Triton's interpreter before 3.8 turns scalar kernel arguments into 1-element arrays and calls
    int() on them, which NumPy 2.4 refuses: every kernel with a loop then fails. (3.8 is fine; the
    compiled GPU path of older releases is not affected, see the sm_90 test.)"""
    import importlib.metadata

    import numpy
    version = tuple(int(p) for p in importlib.metadata.version("triton").split(".")[:2])
    try:
        int(numpy.ones(1))
    except TypeError:
        if version < (3, 8):
            return f"the interpreter of triton {version[0]}.{version[1]} fails with NumPy {numpy.__version__}"
    return None


@contextlib.contextmanager
def interpreted_kernels():
    package = importlib.import_module(PKG)
    before = {m: getattr(package, m) for m in KERNEL_MODULES if hasattr(package, m)}
    saved = _set_aside_triton()
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        yield types.SimpleNamespace(**{m: importlib.import_module(f"{PKG}.{m}") for m in KERNEL_MODULES})
    finally:
        _set_aside_triton()
        sys.modules.update(saved)
        for m in KERNEL_MODULES:
            if m in before:
                setattr(package, m, before[m])
            elif hasattr(package, m):
                delattr(package, m)
        mp.undo()


@pytest.fixture(scope="module")
def tk():
    reason = _interpreter_unusable()
    if reason:
        pytest.skip(reason)
    with interpreted_kernels() as kernels:
        yield kernels


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Max error relative to the output's scale (fp32 accumulation, so no growth with K)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() or 1.0
    assert err <= tol * scale, f"max error {err:.3g} > {tol} x {scale:.3g}"


def test_reference_and_package_do_not_need_triton():
    """The engine may import the layouts where Triton is not installed (macOS, a CPU-only box)."""
    import ast
    for name in ("__init__.py", "reference.py", "_checks.py"):
        tree = ast.parse((ROOT / "kernels" / "triton" / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m == "triton" or m.startswith("triton.") for m in imported), name


# ------------------------------------------------------------------------------------------ W8A16

@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 72, False), (3, 33, 100, True), (17, 50, 64, True)])
def test_w8a16_matches_reference(tk, m, n, k, bias):
    g = _gen(m * 1000 + n)
    x = torch.randn(m, k, generator=g)
    codes, scales = R.quantize_w8(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    # 16 x 16 x 32 tiles: several tiles in every dimension, each with a ragged (masked) edge.
    out = tk.w8a16.w8a16_matmul(x, codes, scales, b, block_m=16, block_n=16, block_k=32)
    _close(out, R.w8a16_matmul_reference(x, codes, scales, b), 1e-5)


def test_w8a16_default_blocks_and_fp16(tk):
    g = _gen(1)
    codes, scales = R.quantize_w8(torch.randn(24, 96, generator=g))
    x32 = torch.randn(3, 96, generator=g)
    _close(tk.w8a16.w8a16_matmul(x32, codes, scales), R.w8a16_matmul_reference(x32, codes, scales), 1e-5)
    x16 = x32.half()
    _close(tk.w8a16.w8a16_matmul(x16, codes, scales), R.w8a16_matmul_reference(x16, codes, scales), 2e-3)


def test_w8_quantization_roundtrip():
    w = torch.randn(8, 64, generator=_gen(2))
    codes, scales = R.quantize_w8(w)
    assert codes.dtype == torch.int8 and scales.shape == (8,)
    assert codes.abs().max() <= 127
    assert ((R.dequantize_w8(codes, scales) - w).abs() <= scales[:, None] / 2 + 1e-6).all()


# ------------------------------------------------------------------------------------------ W4A16

@pytest.mark.parametrize("m,n,k,group,block_k", [
    (1, 40, 64, 32, 64),      # tile spans 2 groups
    (3, 33, 192, 64, 128),    # 1.5 tiles: the last one masked on a group boundary
    (17, 50, 128, 128, 32),   # tile inside one group
    (3, 20, 96, 32, 64),
])
def test_w4a16_matches_reference(tk, m, n, k, group, block_k):
    g = _gen(m * 7 + k)
    x = torch.randn(m, k, generator=g)
    packed, scales, mins = R.quantize_w4(torch.randn(n, k, generator=g), group)
    b = torch.randn(n, generator=g)
    out = tk.w4a16.w4a16_matmul(x, packed, scales, mins, group, b, block_m=16, block_n=16, block_k=block_k)
    _close(out, R.w4a16_matmul_reference(x, packed, scales, mins, group, b), 1e-5)


def test_w4a16_default_blocks_and_fp16(tk):
    g = _gen(3)
    packed, scales, mins = R.quantize_w4(torch.randn(24, 192, generator=g), 64)
    x32 = torch.randn(2, 192, generator=g)
    ref32 = R.w4a16_matmul_reference(x32, packed, scales, mins, 64)
    _close(tk.w4a16.w4a16_matmul(x32, packed, scales, mins, 64), ref32, 1e-5)
    x16 = x32.half()
    ref16 = R.w4a16_matmul_reference(x16, packed, scales, mins, 64)
    _close(tk.w4a16.w4a16_matmul(x16, packed, scales, mins, 64), ref16, 3e-3)


def test_int4_packing_order_and_q4_1_roundtrip():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = R.pack_int4(q)
    assert packed.tolist() == [[0x21, 0x0F]]  # column 2i low nibble, 2i+1 high nibble
    assert torch.equal(R.unpack_int4(packed), q)
    w = torch.randn(6, 128, generator=_gen(4))
    packed, scales, mins = R.quantize_w4(w, 32)
    assert packed.shape == (6, 64) and scales.shape == mins.shape == (6, 4)
    err = (R.dequantize_w4(packed, scales, mins, 32) - w).abs().reshape(6, 4, 32)
    assert (err <= scales[..., None] / 2 + 1e-6).all()


# ----------------------------------------------------------------------------------- paged decode

def _paged_case(seed, batch, heads, kv_heads, head_dim, block_size, lens, int8=False, dtype=torch.float32):
    """Caches with more blocks than needed, tables drawn at random (non-consecutive, shuffled) and
    padded past each sequence's end with further random blocks, as a real pool would leave them."""
    g = _gen(seed)
    max_blocks = -(-max(lens) // block_size) + 1
    num_blocks = batch * max_blocks + 5
    shape = (num_blocks, block_size, kv_heads, head_dim)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if int8:
        (k, ks), (v, vs) = R.quantize_kv_int8(k), R.quantize_kv_int8(v)
    else:
        k, v, ks, vs = k.to(dtype), v.to(dtype), None, None
    tables = torch.randperm(num_blocks, generator=g)[:batch * max_blocks].view(batch, max_blocks)
    return q, k, v, tables, torch.tensor(lens), ks, vs


@pytest.mark.parametrize("heads,kv_heads,block_size,lens,splits", [
    (4, 2, 4, [1, 7, 23], 1),        # GQA 2:1
    (6, 2, 5, [1, 16, 40], 3),       # block size not a power of two, split-K with empty partitions
    (3, 3, 3, [17, 33, 2], 2),       # plain multi-head attention
    (8, 1, 16, [50, 3], None),       # multi-query; default split choice
])
def test_paged_decode_matches_reference(tk, heads, kv_heads, block_size, lens, splits):
    case = _paged_case(len(lens) * 31 + block_size, len(lens), heads, kv_heads, 32, block_size, lens)
    out = tk.paged_decode.paged_decode(*case, num_splits=splits, block_n=16)
    _close(out, R.paged_decode_reference(*case), 1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_int8_kv(tk, splits):
    case = _paged_case(9, 3, 4, 2, 16, 4, [2, 9, 30], int8=True)
    out = tk.paged_decode.paged_decode(*case, num_splits=splits, block_n=16)
    _close(out, R.paged_decode_reference(*case), 1e-5)


def test_paged_decode_fp16_and_empty_context(tk):
    case = _paged_case(10, 3, 4, 2, 16, 4, [0, 5, 30], dtype=torch.float16)
    out = tk.paged_decode.paged_decode(*case, num_splits=2, block_n=16)
    ref = R.paged_decode_reference(*case)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no keys: zeros, not NaN
    _close(out, ref, 3e-3)


def test_paged_reference_agrees_with_the_engine_backend():
    """Same layout as minserve's torch backend: write each sequence's new token through its slot
    mapping, attend, and compare with the reference over the grown context."""
    from minserve.attention.metadata import build_attention_metadata
    from minserve.attention.torch_paged import TorchPagedAttention
    g = _gen(11)
    heads, kv_heads, d, bs, ctxs = 6, 2, 16, 4, [3, 0, 9]
    tables = [[7, 2, 9, 0], [5, 1], [3, 8, 4, 6]]
    k_cache = torch.randn(10, bs, kv_heads, d, generator=g)
    v_cache = torch.randn(10, bs, kv_heads, d, generator=g)
    q = torch.randn(3, heads, d, generator=g)
    k_new, v_new = torch.randn(3, kv_heads, d, generator=g), torch.randn(3, kv_heads, d, generator=g)
    meta = build_attention_metadata([1, 1, 1], ctxs, tables, bs)
    engine = TorchPagedAttention(heads, kv_heads, d)(q, k_new, v_new, k_cache, v_cache, meta)
    padded = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    ref = R.paged_decode_reference(q, k_cache, v_cache, padded, torch.tensor(ctxs) + 1)
    torch.testing.assert_close(ref.reshape(3, heads * d), engine, atol=1e-5, rtol=1e-5)


def test_int8_kv_quantize_on_write():
    g = _gen(12)
    cache, scales = R.allocate_kv_int8(4, 4, 2, 8)
    x = torch.randn(3, 2, 8, generator=g)
    x[1, 0] = 0.0  # an all-zero vector: scale 0, codes 0, no NaN
    slots = torch.tensor([13, 2, 6])
    R.write_kv_int8(cache, scales, slots, x)
    flat_c, flat_s = cache.view(-1, 2, 8)[slots], scales.view(-1, 2)[slots]
    torch.testing.assert_close(flat_s, x.abs().amax(-1) / 127)
    assert flat_c.abs().max() == 127 and flat_c[1, 0].eq(0).all()
    assert ((R.dequantize_kv_int8(flat_c, flat_s) - x).abs() <= flat_s[..., None] / 2 + 1e-7).all()
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert cache.view(-1, 2, 8)[untouched].eq(0).all()


# --------------------------------------------------------------------------------- invalid inputs

def _w8_args():
    g = torch.Generator().manual_seed(269)
    codes, scales = R.quantize_w8(torch.randn(8, 32, generator=g))
    return dict(x=torch.randn(2, 32, generator=g), codes=codes, scales=scales, bias=None)


def _w4_args():
    g = torch.Generator().manual_seed(274)
    packed, scales, mins = R.quantize_w4(torch.randn(8, 64, generator=g), 32)
    return dict(x=torch.randn(2, 64, generator=g), packed=packed, scales=scales, mins=mins, group_size=32)


def _pd_args(int8=False):
    q, k, v, tables, lens, ks, vs = _paged_case(13, 2, 4, 2, 16, 4, [3, 9], int8=int8)
    return dict(q=q, k_cache=k, v_cache=v, block_tables=tables, context_lens=lens, k_scale=ks, v_scale=vs)


BAD = [
    ("w8a16", "w8a16_matmul", _w8_args, dict(x=torch.ones(2, 32, dtype=torch.int32)), "x must have dtype"),
    ("w8a16", "w8a16_matmul", _w8_args, dict(codes=torch.zeros(8, 32)), "codes must have dtype"),
    ("w8a16", "w8a16_matmul", _w8_args, dict(codes=torch.zeros(8, 16, dtype=torch.int8)), "codes must have shape"),
    ("w8a16", "w8a16_matmul", _w8_args, dict(scales=torch.ones(7)), "scales must have shape"),
    ("w8a16", "w8a16_matmul", _w8_args, dict(bias=torch.ones(9)), "bias must have shape"),
    ("w8a16", "w8a16_matmul", _w8_args, dict(block_k=24), "block_k must be a power of two"),
    ("w4a16", "w4a16_matmul", _w4_args, dict(group_size=48), "group_size must be one of"),
    ("w4a16", "w4a16_matmul", _w4_args, dict(group_size=128), "multiple of group_size=128"),
    ("w4a16", "w4a16_matmul", _w4_args, dict(packed=torch.zeros(8, 64, dtype=torch.uint8)), "packed must have shape"),
    ("w4a16", "w4a16_matmul", _w4_args, dict(mins=torch.zeros(8, 2, dtype=torch.float64)), "mins must have dtype"),
    ("w4a16", "w4a16_matmul", _w4_args, dict(scales=torch.zeros(8, 3)), "scales must have shape"),
    ("paged_decode", "paged_decode", _pd_args, dict(q=torch.zeros(2, 3, 16)), "not a multiple of k_cache"),
    ("paged_decode", "paged_decode", _pd_args, dict(q=torch.zeros(2, 4, 24)), "k_cache must have shape"),
    ("paged_decode", "paged_decode", _pd_args, dict(v_cache=torch.zeros(3, 4, 2, 16)), "v_cache must have shape"),
    ("paged_decode", "paged_decode", _pd_args, dict(block_tables=torch.zeros(3, 4, dtype=torch.long)),
     "block_tables must have 2 rows"),
    ("paged_decode", "paged_decode", _pd_args, dict(block_tables=torch.zeros(2, 4)), "block_tables must have dtype"),
    ("paged_decode", "paged_decode", _pd_args, dict(context_lens=torch.tensor([3, 99])), "context_lens must lie"),
    ("paged_decode", "paged_decode", _pd_args, dict(context_lens=torch.tensor([3])), "context_lens must have shape"),
    ("paged_decode", "paged_decode", _pd_args, dict(block_tables=torch.full((2, 4), 50)), "block_tables entries"),
    ("paged_decode", "paged_decode", _pd_args, dict(k_scale=torch.ones(11, 4, 2)), "k_cache must have dtype int8"),
    ("paged_decode", "paged_decode", lambda: _pd_args(int8=True), dict(v_scale=None), "v_scale must be a torch.Tensor"),
    ("paged_decode", "paged_decode", _pd_args, dict(num_splits=0), "num_splits must be >= 1"),
]


@pytest.mark.parametrize("module,fn,make,override,message", BAD, ids=[f"{b[1]}:{b[4]}" for b in BAD])
def test_invalid_inputs_name_the_argument(tk, module, fn, make, override, message):
    kwargs = {**make(), **override}
    with pytest.raises((ValueError, TypeError), match=message):
        getattr(getattr(tk, module), fn)(**kwargs)


def test_interpreter_is_on_for_these_tests(tk):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(tk.w8a16._w8a16_kernel).__name__ == "InterpretedFunction"


def test_interpreter_stays_inside_this_module():
    """Run the fixture's set-up and tear-down in a fresh process where triton was imported first
    (as another test might have): afterwards the original, compiled-mode triton is back."""
    code = f"""if True:
        import os, sys, triton, triton.language
        original = sys.modules["triton"]
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import test_triton_kernels as t
        with t.interpreted_kernels() as tk:
            assert type(tk.w8a16._w8a16_kernel).__name__ == "InterpretedFunction"
            assert sys.modules["triton"] is not original
        assert "TRITON_INTERPRET" not in os.environ and sys.modules["triton"] is original
        from minserve.kernels.triton import w8a16
        assert type(w8a16._w8a16_kernel).__name__ == "JITFunction"
        print("ok")
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


# ------------------------------------------------------------------------------- GPU compilation

def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """Lower each kernel to a Hopper cubin with the wheel's ptxas (no GPU, no interpreter)."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", f"{PKG}.compile_check", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout


# ------------------------------------------------------------------------------------ bench_gpu.py

def test_bench_gpu_script_runs_here(tmp_path):
    """Run as documented, `python kernels/bench_gpu.py` (kernels/ first on sys.path, where
    kernels/triton/ must not shadow triton): without a GPU it says so, exits 0 and still writes its
    JSON; --cpu-interpret runs its tiny cases through the whole pipeline (check, time, table, JSON)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    reason = _interpreter_unusable()
    script = Path("kernels") / "bench_gpu.py"
    plain = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "a.json")], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "needs a CUDA GPU" in plain.stdout, plain.stdout + plain.stderr
    assert json.loads((tmp_path / "a.json").read_text())["status"] == "skipped: no CUDA GPU"
    if reason:
        pytest.skip(reason)
    interp = subprocess.run([sys.executable, str(script), "--cpu-interpret", "--out", str(tmp_path / "b.json")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert interp.returncode == 0, interp.stdout + interp.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["status"] == "done" and result["copy_bandwidth_GBps"] > 0
    kernels = {r["kernel"] for r in result["rows"]}
    assert {"w8a16", "w4a16", "torch_linear", "paged_decode", "paged_decode_int8kv"} <= kernels
    assert all(r["status"] == "ok" and r["us"] > 0 and "pct_of_copy" in r for r in result["rows"])
