"""kernels/ceiling.c: the instruction-rate kernels behind benchmarks/bench_roofline.py.

The rates themselves are timings and stay out of the tests; what is tested is that each kernel
does the arithmetic its operation count claims (so a rate computed from it is honest): the
checksum equals the same recurrence computed here, on every thread of the team.
"""

from __future__ import annotations

import ctypes
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_roofline  # noqa: E402
from bench_roofline import KINDS, _ceiling_lib  # noqa: E402

ACC = 12


@pytest.fixture(scope="module")
def lib():
    from minserve.kernels.build import KernelUnavailable
    try:
        return _ceiling_lib()
    except KernelUnavailable as e:
        pytest.skip(f"no C kernels here: {e}")


def _fma_chain(iters: int, a: float, b: float) -> float:
    """sum over the ACC chains of acc_k <- fma(acc_k, a, b), acc_k starting at k, in float32."""
    acc = np.arange(ACC, dtype=np.float32)
    a32, b32 = np.float32(a), np.float32(b)
    for _ in range(iters):   # float64 holds the float32 product exactly: one rounding, as an FMA
        acc = (acc.astype(np.float64) * a32 + b32).astype(np.float32)
    return float(acc.sum(dtype=np.float64))


def test_fp32_kernel_runs_the_recurrence_it_counts(lib):
    lanes = lib.ms_ceiling_ops_per_iter(KINDS["fp32_fma"]) // (2 * ACC)
    if lanes < 0:
        pytest.skip("no FMA vector unit on this CPU")
    assert lanes in (8, 16)          # AVX2 or AVX-512
    iters = 2000
    got = lib.ms_ceiling_fp32(iters)
    want = lib.ms_ceiling_threads() * lanes * _fma_chain(iters, 0.999999, 1e-7)
    assert got == pytest.approx(want, rel=1e-5)


def _maddubs_chain(iters: int) -> int:
    """sum over the ACC chains of acc_k <- vpmaddubsw(acc_k as bytes, 2), acc_k starting as bytes k."""
    total = 0
    for k in range(ACC):
        acc = np.full(32, k, dtype=np.uint8)
        for _ in range(iters):   # unsigned byte pairs times 2, summed into little-endian int16s
            acc = ((acc[0::2].astype(np.int16) + acc[1::2]) * 2).view(np.uint8)
        total += int(acc.view(np.int16).sum())
    return total


def test_int8_kernel_counts_its_products(lib):
    per_iter = lib.ms_ceiling_ops_per_iter(KINDS["int8_dot"])
    if per_iter < 0:
        pytest.skip("neither AVX-512 VNNI nor AVX2 on this CPU")
    if per_iter == ACC * 16 * 4:   # AVX2: 16 int16 lanes x 2 products, the sums fed back as bytes
        iters = 50
        assert lib.ms_ceiling_int8(iters) == lib.ms_ceiling_threads() * _maddubs_chain(iters)
        return
    assert per_iter == ACC * 16 * 8
    # Each dpbusd adds 4 products of 1 * -1 to every 32-bit lane: acc_k = k - 4 * iters.
    iters = 1000
    want = lib.ms_ceiling_threads() * 16 * sum(k - 4 * iters for k in range(ACC))
    assert lib.ms_ceiling_int8(iters) == want


def test_bf16_kernel_counts_two_products_per_lane(lib):
    if lib.ms_ceiling_ops_per_iter(KINDS["bf16_dot"]) < 0:
        pytest.skip("no AVX-512 BF16 on this CPU")
    # Each dpbf16ps adds 2 products of bf16(1e-3)^2 to every lane, in float32.
    import torch
    iters = 1000
    x = float(torch.tensor(1e-3).bfloat16().float())     # 1e-3 rounded to bf16, as the kernel has it
    pp = np.float32(x * x)                               # exact in float32 (8-bit mantissas)
    acc = np.arange(ACC, dtype=np.float32)
    for _ in range(iters):                               # two products added per lane, in float32
        acc = (acc + pp).astype(np.float32)
        acc = (acc + pp).astype(np.float32)
    scale = lib.ms_ceiling_threads() * 16
    base = scale * sum(range(ACC))
    got = lib.ms_ceiling_bf16(iters)
    assert math.isfinite(got)
    assert got - base == pytest.approx(scale * float(acc.sum(dtype=np.float64)) - base, rel=0.02)


def test_tile_kernel_counts_its_products(lib):
    """Four accumulator tiles, each output + 32 products of 1.0 x 2^-5 a round: exactly 1."""
    per_iter = lib.ms_ceiling_ops_per_iter(KINDS["bf16_tiles"])
    if per_iter < 0:
        assert lib.ms_ceiling_tiles(10) == 0.0
        pytest.skip("no AMX tiles in this build, on this CPU or from Linux")
    assert per_iter == 4 * 16 * 16 * 32 * 2
    iters = 1000
    assert lib.ms_ceiling_tiles(iters) == lib.ms_ceiling_threads() * 4 * 16 * 16 * iters


def test_unavailable_kinds_say_so_instead_of_a_rate(lib):
    assert lib.ms_ceiling_ops_per_iter(99) == -1
    assert isinstance(ctypes.c_int64(lib.ms_ceiling_ops_per_iter(0)).value, int)


def test_read_kernel_sums_every_float_of_its_slices(lib):
    import torch
    n = 16 * ACC * 2 * 1000                      # divides evenly between 1 or 2 threads
    buf = torch.arange(n, dtype=torch.float32) % 7
    assert lib.ms_ceiling_read(buf.data_ptr(), n) == pytest.approx(float(buf.sum()), rel=1e-6)


def test_the_host_probe_times_one_thread_then_the_team_and_restores_torch(lib, monkeypatch):
    import torch
    teams = []
    inner = bench_roofline.instruction_rate
    monkeypatch.setattr(bench_roofline, "instruction_rate",
                        lambda lib_, kind, *a, **k: teams.append((kind, lib_.ms_ceiling_threads()))
                        or inner(lib_, kind, *a, **k))
    threads = torch.get_num_threads()
    probe = bench_roofline.host_probe(seconds=0.01)
    assert torch.get_num_threads() == threads
    assert teams == [("fp32_fma", 1), ("fp32_fma", threads), ("bf16_tiles", threads)]
    assert probe["fma_1t"] > 0 and probe["fma"] > 0
    assert (probe["tiles"] is None) == (lib.ms_ceiling_ops_per_iter(KINDS["bf16_tiles"]) < 0)
