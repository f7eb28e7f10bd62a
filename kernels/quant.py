"""int8 / int4 weight-only linear layers on the CPU, from the C kernels in ``quant.c``.

``int8_linear`` and ``int4_linear`` compute ``F.linear(x, dequantize(weight), bias)`` for the
layouts of :mod:`minserve.quant.formats` without materialising the float weight matrix at decode
sizes: the C loops dequantize in registers as they stream the codes (quant.c says how). From
``PREFILL_MIN_ROWS`` input rows on, the weight is dequantized a cache-sized tile at a time into a
float32 buffer instead and each tile goes through a library GEMM (oneDNN's), whose register
blocking beats a row-streaming loop once there are enough rows to amortise the dequantization;
in bfloat16 where the CPU multiplies it natively (:func:`prefill_tile_dtype`).

The C side trusts every pointer and size; everything is checked here first. Without a working C
compiler the same functions fall back to the torch reference (dequantize + ``F.linear``), with one
logged warning: slow, never a failure.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch
import torch.nn.functional as F

from minserve.kernels.build import KernelUnavailable, load
from minserve.models import gemm

log = logging.getLogger("minserve")

# From this many input rows on, "auto" takes the dequantize-a-tile + torch path. Measured with
# benchmarks/bench_quant_kernels.py --prefill --threads 1 on the 2-core AMD EPYC (AVX-512), one
# thread because two-thread timings on this shared host were ruled by the scheduler; median ms,
# fp32 F.linear / int4 g32 fused C loop / int4 g32 dequant + torch (int8 alike):
#   B          64                 128                256                 512
#   576x1536   1.23 / 1.41 / 1.71  2.48 / 2.89 / 3.14  8.53 / 13.5 / 9.88  13.2 / 16.7 / 15.5
#   1536x576   1.29 / 1.50 / 1.51  2.51 / 3.11 / 3.27  8.89 / 10.2 / 9.44  13.9 / 16.9 / 15.5
#   49152x576  96.2 / 72.1 / 69.1  156 / 138 / 129     300 / 330 / 279     561 / 642 / 409
# Up to ~128 rows the two are within this host's noise (±10 %) and the fused loop runs one
# parallel region per call instead of two per tile; from 256 rows the tiles win by 5-35 %.
# (At batch 16 the fused loop is 1.3-1.5x faster than the tiles.)
PREFILL_MIN_ROWS = 256
# float32 rows per tile: written by the dequantizer, read back by the GEMM. 8 MiB holds every one of
# SmolLM2's matrices but the LM head in one tile, whose product is then the output (no copy of
# column slices). On the AVX2 EPYC (2026-12-05, a 1024-token int4 prefill, alternating with fp32,
# ms): 2 MiB tiles 4454-4553 against fp32's 4148-4150 (0.91-0.93x); 8 MiB 4373-4641 against
# 4162-4341 (0.94-0.95x): the dequantization left, ~170 ms, is what separates them.
TILE_BYTES = 8 * 1024 * 1024
BF16_TILE_BYTES = 2 * 1024 * 1024   # bf16 tiles (measured on AMX hosts at this size): kept in L2
PATHS = ("auto", "fused", "dequant")
TILE_DTYPES = ("bfloat16", "float32")


@functools.lru_cache(maxsize=None)
def prefill_tile_dtype() -> torch.dtype:
    """What the prefill tiles are multiplied in: bfloat16 where the CPU has bf16 dot products.

    A float32 tile costs the same matmul as an fp32 model plus the dequantization, so int8 and
    int4 prefill could never beat fp32 (benchmarks/bench_roofline.py: 0.85x). In bfloat16 the
    product runs at the bf16 rate, about 4x MKL's fp32 here, and a 1024-token prefill took int8
    722 ms, int4 859 ms, fp32 906 ms in one run of benchmarks/bench_roofline.py (1.26x and 1.05x
    fp32's speed; 0.85-0.88x before). The rounding adds to the format's own:
    `minserve eval` kept every verdict (int4 perplexity +0.06 % instead of -0.05 %, its KL
    0.0013 and int8's 0.0050 unchanged). Decode sizes never take the tiles (PREFILL_MIN_ROWS).
    ``MINSERVE_PREFILL_TILE_DTYPE=float32`` (or ``bfloat16``) overrides the choice; a CPU without
    native bf16 (no AVX-512 BF16, no AMX) keeps float32, where bf16 would be emulated."""
    wanted = os.environ.get("MINSERVE_PREFILL_TILE_DTYPE", "").strip().lower()
    if wanted and wanted not in TILE_DTYPES:
        raise ValueError(f"MINSERVE_PREFILL_TILE_DTYPE must be one of {', '.join(TILE_DTYPES)}, "
                         f"got {wanted!r}")
    if not wanted:
        wanted = "bfloat16" if gemm.native_bf16() else "float32"
    return getattr(torch, wanted)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {   # name: (restype, argtypes), as declared in quant.c
    "ms_int8_linear": (_I, [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I]),
    "ms_int4_linear": (_I, [_P, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I]),
    "ms_int8_dequantize": (None, [_P, _P, _P, _I, _I, _I, _I]),
    "ms_int4_dequantize": (None, [_P, _P, _P, _I, _P, _I, _I, _I, _I]),
    "ms_int4_order_columns": (None, [_P, _P, _I]),
    "ms_quant_isa": (ctypes.c_char_p, []),
    "ms_a8_isa": (ctypes.c_char_p, []),
    "ms_quantize_a8": (None, [_P, _I, _I, _I, _P, _P, _P, _P]),
    "ms_linear_a8": (_I, [_I, _P, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P]),
    "ms_a8_tiles_bytes": (_I, [_I, _I, _I, _I]),
    "ms_a8_tile": (_I, [_I, _P, _P, _P, _I, _I, _I, _P, _I]),
}


def with_signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare quant.c's function types on ``lib`` (any build of quant.c); returns ``lib``."""
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def _lib() -> ctypes.CDLL | None:
    try:
        return with_signatures(load("quant"))
    except KernelUnavailable as e:
        log.warning("quantized C kernels unavailable, using dequantize + F.linear (slow): %s", e)
        return None


def kernel_isa() -> str | None:
    """Which code path quant.c compiled for this CPU ("avx512", "avx2", "portable"), or None."""
    lib = _lib()
    return lib.ms_quant_isa().decode() if lib is not None else None


def a8_isa() -> str | None:
    """Which int8-activation loops quant.c compiled ("avx512-vnni", "avx2" or "portable"), or None."""
    lib = _lib()
    return lib.ms_a8_isa().decode() if lib is not None else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _check_tensor(t, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')} {list(shape)}, "
                         f"got {str(t.dtype).removeprefix('torch.')} {list(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device.type}: the quantized C kernels are CPU-only")
    if not t.is_contiguous():   # copying a weight on every call would hide its whole cost
        raise ValueError(f"{name} must be contiguous (call .contiguous() once when binding the weight)")


def _check_input(x, bias, out: int, in_features: int, num_threads: int, path: str) -> torch.Tensor:
    """Checks the call's other arguments; returns x as a contiguous float32 [rows, in] matrix."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != in_features:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [..., {in_features}] (in_features of the weight), got {shape}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {x.dtype} on {x.device.type}")
    if bias is not None:
        _check_tensor(bias, "bias", torch.float32, (out,))
    if not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(f"num_threads must be an int >= 0 (0: PyTorch's thread count), got {num_threads!r}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return x.reshape(-1, in_features).contiguous()


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, num_threads: int = 0,
                path: str = "auto") -> torch.Tensor:
    """``x [..., in] @ (codes * scales[:, None]).T + bias`` -> float32 ``[..., out]``.

    codes int8 ``[out, in]``, scales float32 ``[out]`` (formats.quantize_int8). ``num_threads``:
    OpenMP team size (0: PyTorch's). ``path``: "fused" (C, dequantized in registers), "dequant"
    (dequantized tiles + a GEMM, :func:`prefill_tile_dtype`) or "auto" (fused below
    PREFILL_MIN_ROWS input rows).
    """
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise ValueError("int8 codes must be a 2-D int8 tensor [out_features, in_features]")
    out, in_features = codes.shape
    _check_tensor(codes, "int8 codes", torch.int8, (out, in_features))
    _check_tensor(scales, "int8 scales", torch.float32, (out,))
    x2 = _check_input(x, bias, out, in_features, num_threads, path)
    lib, rows = _lib(), x2.shape[0]
    if lib is None:
        from minserve.quant.formats import dequantize_int8
        y = F.linear(x2, dequantize_int8(codes, scales), bias)
    elif _use_tiles(path, rows):
        def dequantize(r0: int, r1: int, tile: torch.Tensor) -> None:
            lib.ms_int8_dequantize(codes.data_ptr(), scales.data_ptr(), tile.data_ptr(), r0, r1,
                                   in_features, num_threads)
        y = _tiled_linear(x2, dequantize, bias, out, in_features)
    else:
        y = torch.empty(rows, out)
        if rows:
            lib.ms_int8_linear(codes.data_ptr(), scales.data_ptr(), _ptr(bias), x2.data_ptr(),
                               y.data_ptr(), rows, in_features, out, 0, num_threads)
    return y.reshape(*x.shape[:-1], out)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, num_threads: int = 0,
                path: str = "auto") -> torch.Tensor:
    """``x [..., in] @ dequantize_int4(packed, scales, mins, group_size).T + bias`` -> ``[..., out]``.

    packed uint8 ``[out, in/2]`` (column 2i low nibble), scales and mins float32
    ``[out, in/group_size]`` (formats.quantize_int4). ``num_threads`` and ``path`` as int8_linear.
    """
    from minserve.quant.formats import check_group_size, dequantize_int4
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2:
        raise ValueError("packed int4 codes must be a 2-D uint8 tensor [out_features, in_features / 2]")
    out, in_features = packed.shape[0], 2 * packed.shape[1]
    check_group_size(group_size, in_features, out)
    groups = (out, in_features // group_size)
    _check_tensor(packed, "packed int4 codes", torch.uint8, (out, in_features // 2))
    _check_tensor(scales, "int4 scales", torch.float32, groups)
    _check_tensor(mins, "int4 mins", torch.float32, groups)
    x2 = _check_input(x, bias, out, in_features, num_threads, path)
    lib, rows = _lib(), x2.shape[0]
    if lib is None:
        return F.linear(x2, dequantize_int4(packed, scales, mins, group_size), bias).reshape(*x.shape[:-1], out)
    # quant.c produces int4 weights with each 32-column block's even columns first, then its odd
    # ones (the nibble order); x is put in that order once and meets them there.
    xs = torch.empty_like(x2)
    if _use_tiles(path, rows):
        lib.ms_int4_order_columns(x2.data_ptr(), xs.data_ptr(), xs.numel())
        def dequantize(r0: int, r1: int, tile: torch.Tensor) -> None:
            lib.ms_int4_dequantize(packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), group_size,
                                   tile.data_ptr(), r0, r1, in_features, num_threads)
        y = _tiled_linear(xs, dequantize, bias, out, in_features)
    else:
        y = torch.empty(rows, out)
        if rows and lib.ms_int4_linear(packed.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                                       group_size, _ptr(bias), x2.data_ptr(), xs.data_ptr(),
                                       y.data_ptr(), rows, in_features, out, 0, num_threads) < 0:
            raise RuntimeError(f"ms_int4_linear refused group_size {group_size}, in_features {in_features}")
    return y.reshape(*x.shape[:-1], out)


def _use_tiles(path: str, rows: int) -> bool:
    return path == "dequant" or (path == "auto" and rows >= PREFILL_MIN_ROWS)


def _tiled_linear(x: torch.Tensor, dequantize, bias: torch.Tensor | None, out: int,
                  in_features: int) -> torch.Tensor:
    """Prefill: dequantize TILE_BYTES of weight rows at a time, multiply each tile with a GEMM
    (in :func:`prefill_tile_dtype`).

    The tile is read back by the matmul right after it is written, so the whole float matrix
    (113 MB for SmolLM2's 49152 x 576 LM head) never exists at once.
    """
    dtype = prefill_tile_dtype()
    if dtype is torch.float32:
        return gemm.tiled_linear(x, dequantize, bias, out, in_features, tile_bytes=TILE_BYTES)
    # bfloat16: x converted once; each tile dequantized in float32, then rounded (see prefill_tile_dtype)
    tile_rows = max(16, min(TILE_BYTES, BF16_TILE_BYTES) // (4 * in_features))
    y = torch.empty(x.shape[0], out)
    tile = torch.empty(min(tile_rows, out), in_features)
    xl, tile_l = x.to(dtype), torch.empty(tile.shape, dtype=dtype)
    for r0 in range(0, out, tile_rows):
        r1 = min(r0 + tile_rows, out)
        w = tile[: r1 - r0]
        dequantize(r0, r1, w)
        wl = tile_l[: r1 - r0]
        wl.copy_(w)
        y[:, r0:r1] = F.linear(xl, wl)
        if bias is not None:
            y[:, r0:r1] += bias[r0:r1]
    return y

def a8_tiles(bits: int, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
             group_size: int, num_threads: int = 0) -> torch.Tensor | None:
    """A quantized weight (as :func:`linear_a8` takes it) laid out once in the tile order of the
    int8-activation loops (kernels/quant_a8_tiles.h), for :func:`linear_a8`'s ``tiles``: the same
    bytes again, which every call then reads as they lie instead of transposing them. None where
    those loops are not built (no AVX-512 VNNI, no C compiler) or the shape does not divide."""
    lib = _lib()
    if lib is None or codes.device.type != "cpu":
        return None
    out, in_features = _a8_shape(bits, codes, scales, mins, group_size)
    nbytes = a8_tiles_bytes(bits, in_features, out, group_size)
    if nbytes <= 0:
        return None
    tiles = torch.empty(nbytes, dtype=torch.uint8)   # CPU tensors start 64-byte aligned
    if lib.ms_a8_tile(bits, codes.data_ptr(), scales.data_ptr(), _ptr(mins), group_size, in_features, out,
                      tiles.data_ptr(), num_threads) != 0:
        return None
    return tiles


def a8_tiles_bytes(bits: int, in_features: int, out: int, group_size: int) -> int:
    """Bytes of :func:`a8_tiles` for an [out, in_features] weight (bits 8, or 4 in groups of
    ``group_size``): 0 where this machine's build has no such loops or the shape does not divide
    into them. The C build's own count, which the planner uses too (minserve/plan/budget.py)."""
    lib = _lib()
    return 0 if lib is None else max(0, int(lib.ms_a8_tiles_bytes(bits, in_features, out, group_size)))


def _a8_shape(bits: int, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              group_size: int) -> tuple[int, int]:
    """(out, in_features) of an int8 or int4 weight, its tensors checked against them."""
    if bits == 8:
        out, in_features = codes.shape
        _check_tensor(codes, "int8 codes", torch.int8, (out, in_features))
        _check_tensor(scales, "int8 scales", torch.float32, (out,))
    elif bits == 4:
        out, in_features = codes.shape[0], 2 * codes.shape[1]
        from minserve.quant.formats import check_group_size
        check_group_size(group_size, in_features, out)
        _check_tensor(codes, "packed int4 codes", torch.uint8, (out, in_features // 2))
        for t, name in ((scales, "int4 scales"), (mins, "int4 mins")):
            _check_tensor(t, name, torch.float32, (out, in_features // group_size))
    else:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return out, in_features


def check_tiles(tiles: torch.Tensor, bits: int, in_features: int, out: int, group_size: int) -> None:
    """ValueError unless ``tiles`` is what :func:`a8_tiles` makes for a weight of this shape."""
    want = a8_tiles_bytes(bits, in_features, out, group_size)
    if (tiles.dtype is not torch.uint8 or tiles.dim() != 1 or tiles.numel() != want or not tiles.is_contiguous()
            or tiles.data_ptr() % 64):
        raise ValueError(f"tiles must be a8_tiles()'s uint8 tensor of {want} bytes (64-byte aligned) for this "
                         f"weight, got {tiles.dtype} {tuple(tiles.shape)}")


def linear_a8(x: torch.Tensor, bits: int, codes: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
              num_threads: int = 0, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """The int8-activation product (W8A8 for ``bits=8``, W4A8 for ``bits=4``) of
    minserve/quant/activations.py, in C (kernels/quant_a8.h): ``x [..., in]`` -> ``[..., out]``.

    Weights as :func:`int8_linear` / :func:`int4_linear` take them (``mins`` and ``group_size``
    for int4 only); ``in_features`` must be a multiple of 32. One path for every row count: the
    integer loops are what make this format fast, at prefill too. ``tiles``: the same weight as
    :func:`a8_tiles` laid it out (the same bits, faster). Without the C kernels, the
    torch reference answers (slow, same arithmetic).
    """
    from minserve.quant import activations as ref
    out, in_features = _a8_shape(bits, codes, scales, mins, group_size)
    if in_features % ref.BLOCK:
        raise ValueError(f"int8 activations need in_features divisible by {ref.BLOCK}, got {in_features}")
    if tiles is not None and _lib() is not None:
        check_tiles(tiles, bits, in_features, out, group_size)
    x2 = _check_input(x, bias, out, in_features, num_threads, "auto")
    lib, rows = _lib(), x2.shape[0]
    if lib is None:
        y = (ref.int8_linear_a8(x2, codes, scales, bias) if bits == 8
             else ref.int4_linear_a8(x2, codes, scales, mins, group_size, bias))
        return y.reshape(*x.shape[:-1], out)
    y = torch.empty(rows, out)
    if rows:
        scratch = torch.empty(rows * in_features + rows)
        lib.ms_linear_a8(bits, codes.data_ptr(), scales.data_ptr(), _ptr(mins), group_size if bits == 4 else 0,
                         _ptr(bias), x2.data_ptr(), scratch.data_ptr(), y.data_ptr(), rows, in_features,
                         out, 0, num_threads, _ptr(tiles))
    return y.reshape(*x.shape[:-1], out)
