"""Device memory for the KV pool on CUDA: measured after the weights are placed and the largest step
has run once, as vLLM does.

The order matters. Sized from the free memory *before* the weights move to the GPU, the pool would
count the weights as free; sized without running a step, it would leave no room for the step's
activations (hidden states, the MLP's intermediate, attention's gathered K/V and, with
kv_cache_dtype="int8", their dequantized copies, the logits and the sampler's sort), and the first
full step would run out of memory. So the engine (1) notes the
device's memory at start, (2) places the weights, (3) runs a profiling forward pass of
``max_num_batched_tokens`` tokens and records the allocator's peak, and only then (4) sizes the pool
with :func:`device_kv_budget_bytes`, a pure function of those numbers, and allocates it.

What ``gpu_memory_utilization`` means here: the share of the memory *free at start-up* that this
engine may occupy **in all** (weights, activation peak, other CUDA memory it causes, KV pool). vLLM
takes a share of the device's *total* memory; on a GPU of one's own the two differ by what others
use (the CUDA context, a desktop), but on a workshop GPU shared by many sessions a share of the
total would let the first sessions take everything, so minserve keeps "a share of what is free".
An explicit ``kv_cache_memory`` stays an absolute size; it must fit in what is free once the
weights are on the device, with the activation peak set aside.

CPU engines do none of this: their pool is the absolute ``kv_cache_memory`` (1 GiB by default).
Tests drive this module with a fake reader; no GPU is needed to check the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from minserve.config import EngineConfig


class DeviceMemoryReader(Protocol):
    """What the planner reads from a device (torch.cuda's functions for one device; fakes in tests)."""

    def mem_get_info(self) -> tuple[int, int]: ...      # (free, total) bytes, the driver's view
    def memory_allocated(self) -> int: ...               # bytes held by this process's tensors
    def max_memory_allocated(self) -> int: ...           # peak of the above since the last reset
    def reset_peak_memory_stats(self) -> None: ...
    def synchronize(self) -> None: ...
    def empty_cache(self) -> None: ...                   # give cached, unused blocks back


class CudaMemoryReader:
    """:class:`DeviceMemoryReader` for one CUDA device."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def device_memory_reader(device: str) -> DeviceMemoryReader | None:
    """The reader the engine plans with: CUDA devices only (None: the CPU rule, an absolute size)."""
    return CudaMemoryReader(device) if str(device).startswith("cuda") else None


@dataclass(frozen=True)
class DeviceMemory:
    """The numbers the KV planner needs, all in bytes, measured on one device."""

    free_at_start_bytes: int    # free before this engine placed anything (its CUDA context exists)
    total_bytes: int
    free_bytes: int             # free now: weights placed, profiling pass done, its cache released
    weights_bytes: int          # tensors this engine placed: weights and rotary tables
    activation_peak_bytes: int  # the largest step's peak allocation on top of the weights

    @property
    def engine_bytes(self) -> int:
        """What the engine holds now, in the driver's view (weights, allocator rounding, cuBLAS
        workspaces and other memory its first step made CUDA take), never less than the weights."""
        return max(self.weights_bytes, self.free_at_start_bytes - self.free_bytes)

    @property
    def kv_room_bytes(self) -> int:
        """Free now, less the activation peak every step may need again."""
        return self.free_bytes - self.activation_peak_bytes


def measure_device_memory(reader: DeviceMemoryReader, start: tuple[int, int, int],
                          run_largest_step: Callable[[], None]) -> DeviceMemory:
    """Call after the weights are placed: run the profiling step and take the numbers.

    ``start`` is ``(free, total, allocated)`` read before the weights were placed
    (:func:`snapshot`). Allocations are counted from there, so another engine in the same process
    (a notebook running two) is not counted as this one's weights."""
    free0, total, allocated0 = start
    reader.synchronize()
    weights = reader.memory_allocated() - allocated0
    reader.reset_peak_memory_stats()
    base = reader.memory_allocated()
    run_largest_step()
    reader.synchronize()
    peak = max(0, reader.max_memory_allocated() - base)
    reader.empty_cache()  # the profile's blocks go back, so free_bytes sees the weights alone
    free_now, _ = reader.mem_get_info()
    return DeviceMemory(free0, total, free_now, max(0, weights), peak)


def snapshot(reader: DeviceMemoryReader) -> tuple[int, int, int]:
    """(free, total, allocated) before the engine places anything on the device."""
    free, total = reader.mem_get_info()
    return free, total, reader.memory_allocated()


def _gib(n: int) -> str:
    return f"{n} bytes = {n / 2**30:.2f} GiB"


def device_kv_budget_bytes(cfg: EngineConfig, mem: DeviceMemory) -> int:
    """Bytes for the KV pool on a device with a memory reader (CUDA). Pure arithmetic.

    * ``kv_cache_memory`` given: that size, if it fits in ``mem.kv_room_bytes`` (free after the
      weights, less the activation peak); else a ValueError naming it.
    * else: ``floor(gpu_memory_utilization * free_at_start) - engine_bytes - activation_peak``.
      It never exceeds ``kv_room_bytes``: engine_bytes >= free_at_start - free and the share is at
      most free_at_start. Memory another process takes while this engine starts counts as this
      engine's (conservative: the pool gets smaller, never too large).
      A ValueError naming gpu_memory_utilization when nothing is left.
    """
    room = mem.kv_room_bytes
    after = (f"{_gib(mem.free_bytes)} free on {cfg.device} after the weights ({_gib(mem.weights_bytes)}) "
             f"were placed, less the activation peak of the largest step "
             f"(max_num_batched_tokens={cfg.max_num_batched_tokens}: {_gib(mem.activation_peak_bytes)})")
    if cfg.kv_cache_memory is not None:
        want = cfg.kv_cache_memory_bytes
        if want > room:
            raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory!r} ({want} bytes) must be <= the free "
                             f"memory left for the KV cache: {_gib(max(room, 0))} ({after}); lower "
                             "kv_cache_memory or max_num_batched_tokens, or free the GPU")
        return want
    share = int(cfg.gpu_memory_utilization * mem.free_at_start_bytes)
    budget = share - mem.engine_bytes - mem.activation_peak_bytes
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} of the {_gib(mem.free_at_start_bytes)} "
                         f"free at start ({_gib(share)}) leaves no KV cache once the engine's "
                         f"{_gib(mem.engine_bytes)} (weights and CUDA workspaces) and the activation peak "
                         f"({_gib(mem.activation_peak_bytes)}, max_num_batched_tokens="
                         f"{cfg.max_num_batched_tokens}) are taken; raise gpu_memory_utilization (<= 1), "
                         "or set kv_cache_memory")
    return budget


def check_kv_blocks_fit(cfg: EngineConfig, mem: DeviceMemory, pool_bytes: int) -> None:
    """An explicit ``num_kv_blocks`` is taken as given, but must fit like kv_cache_memory must."""
    if pool_bytes > mem.kv_room_bytes:
        raise ValueError(f"num_kv_blocks={cfg.num_kv_blocks} ({pool_bytes} bytes of KV cache) must fit in "
                         f"{_gib(max(mem.kv_room_bytes, 0))} ({_gib(mem.free_bytes)} free on {cfg.device} after "
                         f"the weights, less the activation peak {_gib(mem.activation_peak_bytes)}); "
                         "lower num_kv_blocks or max_num_batched_tokens, or free the GPU")
