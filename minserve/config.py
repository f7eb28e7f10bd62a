"""Engine configuration: one place for defaults, limits and their error messages.

The names follow vLLM's engine arguments (``max_num_seqs``, ``max_num_batched_tokens``,
``block_size``, ``gpu_memory_utilization``, ``enable_prefix_caching``, ...), so a notebook cell
written for minserve keeps working when it is pointed at vLLM.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from minserve.paths import cache_dir  # noqa: F401  (its home is minserve/paths.py)
from minserve.spec.config import parse_speculative_config

if TYPE_CHECKING:
    import torch

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# The built-in scheduling policies; others are registered (minserve.register_scheduling_policy) or
# named "package.module:Class" (engine/scheduling_policy.py).
SCHEDULING_POLICIES = ("fcfs", "priority")

# vLLM's kv_cache_dtype values that minserve implements: "auto" stores K/V in the model dtype;
# "int8" stores int8 codes plus a float32 scale per (token, kv head) (engine/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "int8")

# PyTorch's names (torch.set_float32_matmul_precision) that a float32 engine implements.
FP32_MATMUL_PRECISIONS = ("highest", "high")

# The KV pool of a CPU engine when neither num_kv_blocks nor kv_cache_memory is given.
DEFAULT_CPU_KV_CACHE_MEMORY = "1GiB"


def parse_bytes(value: int | str, field: str = "kv_cache_memory") -> int:
    """``"1GiB"`` -> 1073741824. Accepts ints (bytes) and strings with a decimal or binary unit."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a byte count or a size like '1GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{field} must be a size like '512MiB' or '1GiB' "
                             f"(units: {', '.join(u for u in _SIZE_UNITS if u)}), got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{field} must be a byte count or a size like '1GiB', got {value!r}")
    if n <= 0:
        raise ValueError(f"{field} must be > 0 bytes, got {value!r}")
    return n


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


@dataclass
class EngineConfig:
    """Everything an :class:`~minserve.engine.llm_engine.LLMEngine` needs besides the weights.

    KV cache size, in order of precedence: ``num_kv_blocks`` if given; else ``kv_cache_memory``
    if given, as an absolute size on any device (a workshop gives each participant a fixed share
    of one GPU this way; vLLM's ``kv_cache_memory_bytes`` also overrides its utilization); else,
    on CUDA, what is left of ``gpu_memory_utilization`` x the device memory *free at start-up*
    once the weights and the largest step's activation peak are taken (a shared GPU must not be
    grabbed whole, hence the low default; vLLM's share is of the *total*), and on CPU
    ``DEFAULT_CPU_KV_CACHE_MEMORY``. On CUDA the pool is planned after the weights are placed and
    a profiling step has run (engine/memory.py); explicit sizes must fit beside them.
    ``kv_cache_memory_bytes`` is the parsed size, or the CPU default when none was given.
    """

    model: str = "smollm2-135m"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = None  # None: see the precedence above
    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    # PyTorch's float32 matmul precision for a float32 engine's products of 16 rows or more
    # (prefill, mixed and batched decode steps): "highest" (exact float32 products, token-exact
    # against transformers) or "high" (each float32 operand as the sum of two bf16 halves, three bf16
    # products on AMX tiles summed in float32: ~16 mantissa bits; kernels/bf16_gemm.c). None:
    # torch.get_float32_matmul_precision() when the engine is built ("high" -> "high", else
    # "highest"). "high" does anything only on a CPU with AMX. Part of the prefix-cache key.
    fp32_matmul_precision: str | None = None
    device: str | None = None
    seed: int = 0
    enable_chunked_prefill: bool = True
    disable_log_stats: bool = False  # vLLM's switch: no Prometheus metrics (timelines are kept)
    # minserve's own switch (vLLM has no CPU equivalent): run decode-only steps through the fused
    # C kernel (kernels/decode.py). None = when it can (CPU, float32, a C compiler);
    # True = always, failing loudly if it cannot build; False = never (the PyTorch path only).
    fused_decode: bool | None = None
    # vLLM's VLLM_BATCH_INVARIANT, as an argument: a request's tokens and log-probabilities do not
    # depend on what else the engine runs (its neighbours, where its prompt is cut into chunks,
    # prefix-cache hits, preemption). CPU and float32 only (any weight format); every step in the
    # fused C step with the flash attention kernel (fused_decode=False: every step on the PyTorch
    # path instead). engine/batch_invariance.py says why and what it costs.
    batch_invariant: bool = False
    # minserve's own: how much history a long-running engine keeps for requests_frame() and
    # steps_frame(). Finished requests are kept as small records (counts and times, ~0.5 KiB plus
    # 8 bytes per output token), the oldest dropped first; memory stays flat however long it serves.
    max_request_records: int = 10_000
    max_step_records: int = 100_000
    # minserve's own: on CPU, pick each decode step's thread count from measured step times, so a
    # core taken by another process costs a share of the speed, not nearly all of it (OpenMP
    # threads otherwise wait at every barrier for a partner that is not running). engine/threads.py.
    adaptive_threads: bool = True
    # vLLM's scheduling_policy: "fcfs" (first come, first served) or "priority" (lower
    # Request.priority first; the lowest-priority running request is preempted first; a waiting
    # request may preempt strictly lower-priority running ones). engine/scheduler.py. Also any
    # registered name, a "package.module:Class" or a SchedulingPolicy subclass
    # (engine/scheduling_policy.py).
    scheduling_policy: str = "fcfs"
    # vLLM's quantization: None (the model's dtype), "int8", "int4" or "int4-awq", applied to the
    # loaded weights at start-up (minserve/quant/schemes.py). quantization_config: that format's
    # settings, a dict or its JSON text (the CLI), e.g. {"group_size": 64, "lm_head": "keep"}.
    # Both are part of the prefix-cache key.
    quantization: str | None = None
    quantization_config: dict | str | None = None
    # minserve's own: one memory budget for weights *and* KV cache (bytes or "1GiB"): the KV pool
    # gets what the resident weights leave, so a smaller format buys KV blocks. Resolved once the
    # weights are built, into kv_cache_memory (engine/model_runner.py); excludes num_kv_blocks and
    # kv_cache_memory.
    memory_budget: int | str | None = None
    # vLLM's kv_cache_dtype: "auto" (the model dtype) or "int8" (symmetric, a float32 scale per
    # token slot and kv head: ~4x the tokens of fp32 in the same memory, less the scales' share;
    # engine/kv_cache.py). Part of the prefix-cache key.
    kv_cache_dtype: str = "auto"

    # vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m} or {"method": "draft_model", "model": "self",
    # "num_speculative_tokens": k} (or its JSON text); minserve adds
    # "adaptive" (default true): stop proposing where measured steps say it does not pay.
    # Parsed into a minserve.spec.config.SpeculativeConfig. minserve/spec/.
    speculative_config: dict | str | None = None
    # vLLM's logits_processors: custom batch-level logits processors, classes or their qualified
    # names ("package.module:Class"), built once per engine (engine/logits_processor.py). Those
    # installed under the entry-point group "minserve.logits_processors" are loaded as well.
    logits_processors: list | None = None

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        _check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        _check_int("block_size", self.block_size, 1, 256)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        self.kv_cache_memory_bytes = parse_bytes(DEFAULT_CPU_KV_CACHE_MEMORY if self.kv_cache_memory is None
                                                 else self.kv_cache_memory)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(
                self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of 'float32', 'bfloat16', 'float16', got {self.dtype!r}")
        import torch   # here, not at the top: the CLI reads this module's choices without PyTorch
        if self.fp32_matmul_precision is None:
            self.fp32_matmul_precision = "high" if torch.get_float32_matmul_precision() == "high" else "highest"
        if self.fp32_matmul_precision not in FP32_MATMUL_PRECISIONS:
            raise ValueError(f"fp32_matmul_precision must be one of {list(FP32_MATMUL_PRECISIONS)}, "
                             f"got {self.fp32_matmul_precision!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _check_int("seed", self.seed, 0)
        _check_int("max_request_records", self.max_request_records, 0, 10_000_000)
        _check_int("max_step_records", self.max_step_records, 1, 10_000_000)
        if not isinstance(self.adaptive_threads, bool):
            raise ValueError(f"adaptive_threads must be True or False, got {self.adaptive_threads!r}")
        from minserve.engine.scheduling_policy import resolve_scheduling_policy
        resolve_scheduling_policy(self.scheduling_policy)  # names the registered ones when unknown
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.fused_decode not in (None, True, False):
            raise ValueError(f"fused_decode must be None (auto), True or False, got {self.fused_decode!r}")
        self._check_quantization()
        from minserve.engine.batch_invariance import check_config
        check_config(self)
        from minserve.engine.logits_processor import resolve_logits_processors
        resolve_logits_processors(self.logits_processors)  # a name that does not import fails here

    def _check_quantization(self) -> None:
        """Parse quantization_config and build the scheme (a bad format, key or value fails before
        any loading); check memory_budget against the other KV sizes."""
        from minserve.quant.schemes import make_scheme  # lazy: quant imports the model layers
        qc = self.quantization_config
        if isinstance(qc, str):
            try:
                qc = json.loads(qc)
            except json.JSONDecodeError as e:
                raise ValueError(f"quantization_config must be a dict or its JSON text, got {qc!r} ({e})") from e
        if qc is not None and not isinstance(qc, dict):
            raise ValueError(f"quantization_config must be a dict or its JSON text, got {qc!r}")
        if qc and self.quantization is None:
            raise ValueError(f"quantization_config={qc!r} needs a format: quantization='int4' (or int8, int4-awq)")
        self.quantization_config = qc
        self.quant_scheme = None if self.quantization is None else make_scheme(self.quantization, qc)
        if getattr(self.quant_scheme, "activations", "float") == "int8" and self.device != "cpu":
            raise ValueError(f"quantization_config['activations']='int8' has kernels for the CPU only "
                             f"(device={self.device!r}); leave it 'float' on a GPU")
        self.memory_budget_bytes = None
        if self.memory_budget is not None:
            self.memory_budget_bytes = parse_bytes(self.memory_budget, "memory_budget")
            given = [n for n in ("num_kv_blocks", "kv_cache_memory") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"memory_budget sizes the KV cache as the budget less the weights; "
                                 f"do not also give {' or '.join(given)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch
        return getattr(torch, self.dtype)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from ``LLM(model, **engine_args)``, naming any argument we do not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)
