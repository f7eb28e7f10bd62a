"""KV pool sizing on CUDA (engine/memory.py), without a GPU: the arithmetic with made-up numbers, the
measurement with a fake device-memory reader, and the engine's order (weights placed, largest step
profiled, then the pool planned and allocated) through the reader seam on CPU. CPU engines keep the
absolute kv_cache_memory exactly as before."""

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.config import EngineConfig
from minserve.engine import llm_engine, memory, model_runner
from minserve.engine.kv_cache import plan_kv_cache
from minserve.engine.memory import DeviceMemory, device_kv_budget_bytes, measure_device_memory
from minserve.models.llama import LlamaForCausalLM
from minserve.models.registry import ModelConfig
from minserve.models.tiny import TINY_CONFIG

GiB, MiB = 2**30, 2**20
TINY = ModelConfig.from_hf(TINY_CONFIG)
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny-llama in fp32: 2 x layers x kv_heads x head_dim x 4 bytes
BLOCK = PER_TOKEN * 16


def cuda_cfg(**kw) -> EngineConfig:
    return EngineConfig(device="cuda", **kw)


# ---- the arithmetic -------------------------------------------------------------------------

# 10 GiB free at start; weights 1 GiB; the engine took 1.25 GiB in the driver's view (allocator
# rounding, cuBLAS workspace); the largest step peaks 0.5 GiB above the weights.
MEM = DeviceMemory(free_at_start_bytes=10 * GiB, total_bytes=80 * GiB, free_bytes=10 * GiB - 5 * GiB // 4,
                   weights_bytes=GiB, activation_peak_bytes=GiB // 2)


def test_share_of_free_memory_less_weights_and_activation_peak():
    assert MEM.engine_bytes == 5 * GiB // 4 and MEM.kv_room_bytes == 10 * GiB - 7 * GiB // 4
    assert device_kv_budget_bytes(cuda_cfg(gpu_memory_utilization=0.5), MEM) == 5 * GiB - 5 * GiB // 4 - GiB // 2
    assert device_kv_budget_bytes(cuda_cfg(gpu_memory_utilization=1.0), MEM) == MEM.kv_room_bytes
    # The share is of the memory free at start, not the total (vLLM's meaning): 80 GiB plays no part.
    assert device_kv_budget_bytes(cuda_cfg(gpu_memory_utilization=0.5),
                                  DeviceMemory(10 * GiB, 24 * GiB, 10 * GiB - 5 * GiB // 4, GiB, GiB // 2)) \
        == 5 * GiB - 7 * GiB // 4
    # Engine bytes are never counted below the weights (a driver reading that lags the allocator).
    lag = DeviceMemory(10 * GiB, 80 * GiB, 10 * GiB, GiB, 0)
    assert lag.engine_bytes == GiB and device_kv_budget_bytes(cuda_cfg(gpu_memory_utilization=0.5), lag) == 4 * GiB


def test_blocks_from_the_budget_and_num_kv_blocks_still_wins():
    spec = plan_kv_cache(TINY, cuda_cfg(gpu_memory_utilization=0.5), MEM)
    assert spec.num_blocks == (5 * GiB - 5 * GiB // 4 - GiB // 2) // BLOCK
    assert plan_kv_cache(TINY, cuda_cfg(num_kv_blocks=7, kv_cache_memory="1GiB"), MEM).num_blocks == 7


def test_no_room_left_names_gpu_memory_utilization():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.1 of the .* leaves no KV cache .*"
                                         r"max_num_batched_tokens=512.*raise gpu_memory_utilization"):
        device_kv_budget_bytes(cuda_cfg(gpu_memory_utilization=0.1), MEM)  # 1 GiB share < 1.75 GiB


def test_kv_cache_memory_is_absolute_and_must_fit_after_weights_and_activations():
    assert device_kv_budget_bytes(cuda_cfg(kv_cache_memory="2GiB"), MEM) == 2 * GiB  # not a share
    room = MEM.kv_room_bytes
    assert device_kv_budget_bytes(cuda_cfg(kv_cache_memory=room), MEM) == room  # exactly fits
    with pytest.raises(ValueError, match=r"kv_cache_memory=\S+ \(\d+ bytes\) must be <= the free memory left "
                                         r"for the KV cache: .*after the weights .*activation peak .*"
                                         r"max_num_batched_tokens=512.*lower kv_cache_memory"):
        device_kv_budget_bytes(cuda_cfg(kv_cache_memory=room + 1), MEM)
    # 9 GiB would fit in what was free at start, but not beside the weights and the peak.
    with pytest.raises(ValueError, match=r"kv_cache_memory='9GiB'"):
        plan_kv_cache(TINY, cuda_cfg(kv_cache_memory="9GiB"), MEM)


def test_num_kv_blocks_must_fit_too():
    fits = MEM.kv_room_bytes // BLOCK
    assert plan_kv_cache(TINY, cuda_cfg(num_kv_blocks=fits), MEM).num_blocks == fits
    with pytest.raises(ValueError, match=rf"num_kv_blocks={fits + 1} .* must fit"):
        plan_kv_cache(TINY, cuda_cfg(num_kv_blocks=fits + 1), MEM)


def test_planning_without_a_measurement_reads_free_memory(monkeypatch):
    """Outside an engine (no weights placed), CUDA planning is the share of what is free now."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 80 * GiB))
    assert plan_kv_cache(TINY, cuda_cfg(gpu_memory_utilization=0.5)).num_blocks == 5 * GiB // BLOCK


def test_cpu_is_absolute_and_has_no_reader():
    assert memory.device_memory_reader("cpu") is None
    assert isinstance(memory.device_memory_reader("cuda:1"), memory.CudaMemoryReader)
    assert plan_kv_cache(TINY, EngineConfig(device="cpu")).num_blocks == GiB // BLOCK
    assert plan_kv_cache(TINY, EngineConfig(device="cpu", kv_cache_memory="3MiB")).num_blocks == 3 * MiB // BLOCK


# ---- the measurement ------------------------------------------------------------------------

class FakeReader:
    """A device: the driver's free bytes, the allocator's bytes and peak, and a log of calls."""

    def __init__(self, free=10 * GiB, total=80 * GiB, allocated=0, overhead=0):
        self.free, self.total, self.allocated, self.peak = free, total, allocated, allocated
        self._base = (free, allocated)  # what was free while `allocated` bytes were already held
        self.overhead = overhead  # non-tensor memory the first step makes CUDA take (workspaces)
        self.events: list[str] = []

    def alloc(self, n):
        self.allocated += n
        self.free -= n
        self.peak = max(self.peak, self.allocated)

    def release(self, n):  # freed tensors stay cached by the allocator until empty_cache
        self.allocated -= n

    def mem_get_info(self):
        self.events.append("mem_get_info")
        return self.free, self.total

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        self.events.append("peak")
        return self.peak

    def reset_peak_memory_stats(self):
        self.events.append("reset_peak")
        self.peak = self.allocated

    def synchronize(self):
        pass

    def empty_cache(self):
        self.events.append("empty_cache")
        self.free = self._base[0] - (self.allocated - self._base[1]) - self.overhead


def test_measure_counts_from_the_start_and_takes_the_step_peak():
    reader = FakeReader(allocated=3 * GiB)  # another engine in this process already holds 3 GiB
    start = memory.snapshot(reader)
    reader.alloc(GiB)  # the weights

    def step():
        reader.events.append("step")
        reader.overhead = 64 * MiB
        reader.alloc(GiB // 2)
        reader.release(GiB // 2)

    m = measure_device_memory(reader, start, step)
    assert m == DeviceMemory(10 * GiB, 80 * GiB, 9 * GiB - 64 * MiB, GiB, GiB // 2)
    assert m.engine_bytes == GiB + 64 * MiB  # the workspace counts against this engine
    assert reader.events == ["mem_get_info", "reset_peak", "step", "peak", "empty_cache", "mem_get_info"]


# ---- the engine's order, through the reader seam on CPU ---------------------------------------

ACT = 8 * MiB  # the activation peak the fake device reports for the profiling step


@pytest.fixture
def fake_device(monkeypatch):
    """The engine plans as on CUDA (a reader is handed to the runner) while computing on CPU.
    Placing the model 'allocates' its bytes on the fake device; forward passes are logged."""
    reader = FakeReader()
    monkeypatch.setattr(llm_engine, "device_memory_reader", lambda device: reader)
    to, forward = LlamaForCausalLM.to, LlamaForCausalLM.forward

    def place(self, *a, **kw):
        out = to(self, *a, **kw)
        n = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in self.parameters()}.values())
        reader.weights = n
        reader.alloc(n)
        reader.events.append("weights placed")
        return out

    def logged_forward(self, input_ids, positions, kv_caches, meta, rows):
        reader.events.append(f"forward {input_ids.shape[0]} tokens, {len(rows)} seqs")
        reader.alloc(ACT)  # the scratch cache and the activations, gone after the step
        reader.release(ACT)
        return forward(self, input_ids, positions, kv_caches, meta, rows)

    plan, alloc = llm_engine.plan_kv_cache, model_runner.allocate_kv_tensors

    def logged_plan(model, cfg, mem=None):
        reader.events.append("plan")
        reader.planned_with = mem
        return plan(model, cfg, mem)

    def logged_alloc(*a):
        reader.events.append("allocate KV")
        return alloc(*a)

    monkeypatch.setattr(LlamaForCausalLM, "to", place)
    monkeypatch.setattr(LlamaForCausalLM, "forward", logged_forward)
    monkeypatch.setattr(llm_engine, "plan_kv_cache", logged_plan)
    monkeypatch.setattr(model_runner, "allocate_kv_tensors", logged_alloc)
    return reader


def test_engine_plans_after_the_weights_and_the_profiling_step(fake_device):
    # A sixteenth of the fake 10 GiB free (exact in binary): the same plan as half of it, but the KV
    # tensors the engine then really allocates on this CPU are 640 MiB, not 5 GiB (10 s of zeroing).
    llm = LLM("tiny-llama", device="cpu", gpu_memory_utilization=1 / 16, max_num_seqs=16,
              max_num_batched_tokens=512)
    eng = llm.llm_engine
    steps = [e for e in fake_device.events if e not in ("mem_get_info", "peak", "empty_cache")]
    assert steps == ["weights placed", "reset_peak",
                     "forward 512 tokens, 16 seqs",   # the widest batch
                     "forward 512 tokens, 1 seqs",    # the longest sequence
                     "plan", "allocate KV"]
    m = fake_device.planned_with
    assert m is eng.runner.device_memory
    assert m.weights_bytes == fake_device.weights > 0 and m.activation_peak_bytes == ACT
    assert eng.kv_spec.num_blocks == (10 * GiB // 16 - fake_device.weights - ACT) // BLOCK
    assert len(eng.runner.kv_caches) == TINY.num_layers
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4))  # then it serves normally
    assert len(out[0].outputs[0].token_ids) == 4


def test_engine_kv_cache_memory_too_large_fails_before_allocating(fake_device):
    with pytest.raises(ValueError, match=r"kv_cache_memory='10GiB' .* must be <= the free memory left"):
        LLM("tiny-llama", device="cpu", kv_cache_memory="10GiB")
    assert "allocate KV" not in fake_device.events and "weights placed" in fake_device.events
    assert LLM("tiny-llama", device="cpu", kv_cache_memory="3MiB").llm_engine.kv_spec.num_blocks == 3 * MiB // BLOCK


def test_profiling_changes_no_output(monkeypatch):
    """The profiling step uses its own sampler and a scratch cache: same tokens with and without."""
    prompts = ["The quick brown fox", "Hello"]
    params = SamplingParams(temperature=1.0, max_tokens=12)
    plain = [o.outputs[0].token_ids for o in LLM("tiny-llama", device="cpu", kv_cache_memory="3MiB",
                                                  max_num_batched_tokens=64).generate(prompts, params)]
    reader = FakeReader()
    monkeypatch.setattr(llm_engine, "device_memory_reader", lambda device: reader)
    llm = LLM("tiny-llama", device="cpu", kv_cache_memory="3MiB", max_num_batched_tokens=64)
    assert llm.llm_engine.runner.device_memory is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


def test_cpu_engine_is_unchanged():
    eng = LLM("tiny-llama", device="cpu", kv_cache_memory="3MiB").llm_engine
    assert eng.runner.device_memory is None
    assert eng.kv_spec.num_blocks == 3 * MiB // BLOCK
    eng = LLM("tiny-llama", device="cpu", num_kv_blocks=4).llm_engine
    # max_model_len is cut to the pool (64 tokens) and the rotary tables to max_model_len, as before.
    assert eng.max_model_len == 64 and eng.runner.model.rotary.cos.shape[0] == 64
    assert [t.shape[0] for t in eng.runner.kv_caches[0]] == [4, 4]
