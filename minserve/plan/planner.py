"""``plan()``: a model, a device and a memory budget in; a serving envelope out.

The envelope answers the questions to settle before a load test: does the model fit, how many
sequences of a given context length fit beside it (in whole KV blocks, as the engine allocates),
and how fast prefill and decode could be at best on that hardware. The formulas are in
:mod:`minserve.plan.budget`; the tests hold them to the engine's own allocation and weight count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from minserve.config import parse_bytes
from minserve.engine.kv_cache import kv_cache_bytes_per_token
from minserve.models.registry import ModelConfig
from minserve.plan import budget
from minserve.plan.hardware import Hardware, get_hardware


@dataclass
class Plan:
    model: str
    hardware: str
    precision: str
    dtype: str                    # activations, KV cache, scales and the unquantized tensors
    group_size: int               # int4 only
    block_size: int
    context_len: int
    params: int
    weight_bytes: int             # resident in memory (the embedding table included)
    weight_bytes_per_step: int    # streamed by one forward pass (= the runner's weight_bytes())
    scale_bytes: int              # of weight_bytes: quantization scales and zero points
    kv_bytes_per_token: int
    memory_budget_bytes: int
    kv_budget_bytes: int
    num_kv_blocks: int
    blocks_per_seq: int
    max_num_seqs: int             # sequences of context_len tokens that fit at once
    bandwidth_bytes_per_s: float
    flops_per_s: float
    prefill_s: float              # one prompt of context_len tokens (TTFT without queueing)
    prefill_bound: str
    decode_step_s: float          # batch 1 at context_len (TPOT of a lone stream)
    decode_bound: str
    decode_step_s_full: float | None  # max_num_seqs sequences at context_len
    decode_bound_full: str | None
    notes: list[str] = field(default_factory=list)
    kv_cache_dtype: str = "auto"  # the engine argument: "auto" (KV in dtype) or "int8"
    lm_head: str = "keep"         # int8/int4: the LM head's format ("quantize", "int8", "keep")
    activations: str = "float"    # int8/int4 on the CPU: "int8" quantizes the inputs too (W8A8, W4A8)
    a8_tile_bytes: int = 0        # of weight_bytes: the tiles int8 activations keep (budget.a8_tile_bytes)
    a8_ops_per_s: float | None = None  # int8 activations: the products' measured rate (attention at flops_per_s)

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def decode_tok_s(self) -> float:
        return 1 / self.decode_step_s

    @property
    def decode_tok_s_full(self) -> float | None:
        return None if self.decode_step_s_full is None else self.max_num_seqs / self.decode_step_s_full

    def rows(self) -> list[tuple[str, str, str]]:
        """(quantity, value, how it is computed), for the printed table and the DataFrame."""
        g, mb = 2**30, 2**20
        full = "-" if self.decode_step_s_full is None else \
            f"{_time(self.decode_step_s_full)}, {self.decode_tok_s_full:,.0f} tok/s ({self.decode_bound_full})"
        return [
            ("model", f"{self.model} ({self.params / 1e6:,.1f} M params)", ""),
            ("hardware", self.hardware, f"{self.bandwidth_bytes_per_s / 1e9:,.1f} GB/s, "
                                        f"{self.flops_per_s / 1e12:,.2f} TFLOP/s ({self.dtype})"
                                        + (f", int8-activation products {self.a8_ops_per_s / 1e12:,.2f} TOP/s"
                                           if self.a8_ops_per_s else "")),
            ("precision", self.precision + (f", group {self.group_size}" if self.precision == "int4" else "")
             + (f", LM head {_HEAD_NAMES.get(self.lm_head, self.precision)}" if self.precision in ("int8", "int4")
                else ""),
             f"activations in {'int8 blocks of 32 at the products, else ' if self.activations == 'int8' else ''}"
             f"{self.dtype}, KV in "
             f"{self.dtype if self.kv_cache_dtype == 'auto' else self.kv_cache_dtype}"),
            ("weights", f"{self.weight_bytes / mb:,.1f} MiB", f"{self.scale_bytes / mb:,.2f} MiB of it scales/mins"
             + (f", {self.a8_tile_bytes / mb:,.1f} MiB tiles for int8 activations" if self.a8_tile_bytes else "")),
            ("weights read per step", f"{self.weight_bytes_per_step / mb:,.1f} MiB", "all but the embedding table"),
            ("KV per token", f"{self.kv_bytes_per_token:,} B",
             "2 x layers x kv_heads x head_dim x bytes" if self.kv_cache_dtype == "auto" else
             "2 x layers x kv_heads x (head_dim x 1 + a 4-byte scale)"),
            ("memory budget", f"{self.memory_budget_bytes / g:,.2f} GiB", ""),
            ("KV budget", f"{self.kv_budget_bytes / g:,.2f} GiB", "budget - weights, or kv_cache_memory"),
            ("KV blocks", f"{self.num_kv_blocks:,} x {self.block_size} tokens",
             "KV budget // (KV per token x block_size)"),
            (f"max seqs at {self.context_len:,} tokens", f"{self.max_num_seqs:,}",
             f"KV blocks // ceil({self.context_len} / {self.block_size}) = KV blocks // {self.blocks_per_seq}"),
            ("prefill (1 prompt)", f"{_time(self.prefill_s)} ({self.prefill_bound})",
             "max(bytes / bandwidth, FLOPs / rate)" if not self.a8_ops_per_s else
             "max(bytes / bandwidth, products / int8-activation rate + attention / rate)"),
            ("decode, batch 1", f"{_time(self.decode_step_s)}, {self.decode_tok_s:,.0f} tok/s "
                                f"({self.decode_bound})", "weights + 1 x context x KV per token"),
            (f"decode, batch {self.max_num_seqs:,}", full, "weights once + B x context x KV per token"),
        ] + [("note", n, "") for n in self.notes]

    def table(self) -> str:
        return format_table(("quantity", "value", "how"), self.rows())

    def frame(self):
        """The table as a pandas DataFrame (one row per quantity), for notebooks."""
        import pandas as pd
        return pd.DataFrame(self.rows(), columns=["quantity", "value", "how"]).set_index("quantity")


_HEAD_NAMES = {"int8": "int8", "keep": "dense"}  # "quantize": the precision itself


def _time(s: float) -> str:
    return f"{s * 1e6:,.1f} us" if s < 1e-3 else f"{s * 1e3:,.2f} ms" if s < 1 else f"{s:,.2f} s"


def format_table(headers: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [tuple(map(str, headers))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def model_config(model: str | Path | ModelConfig) -> tuple[str, ModelConfig]:
    """(name, config) for an alias, a Hugging Face directory or a ModelConfig (an alias is
    converted into the cache on first use, as ``LLM`` would)."""
    if isinstance(model, ModelConfig):
        return "model", model
    from minserve.models.loader import _read_config, resolve_model_dir
    return str(model), ModelConfig.from_hf(_read_config(resolve_model_dir(str(model))))


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def plan(model: str | Path | ModelConfig = "smollm2-135m", hardware: str | Hardware = "this",
         memory_budget: int | str | None = None, context_len: int | None = None, precision: str = "fp32",
         dtype: str | None = None, group_size: int = budget.INT4_DEFAULT_GROUP_SIZE, block_size: int = 16,
         kv_cache_memory: int | str | None = None, kv_cache_dtype: str = "auto",
         lm_head: str | None = None, activations: str = "float") -> Plan:
    """The serving envelope of ``model`` on ``hardware`` (a name from ``known_hardware()``,
    ``"this"`` for this machine as measured, or a :class:`Hardware`).

    ``memory_budget`` (bytes or ``"80GiB"``; default: the hardware's memory) holds the weights and
    the KV cache; ``kv_cache_memory`` instead fixes the KV budget itself, as the engine's argument
    of that name does. ``precision`` is fp32, bf16, fp16, int8 or int4; ``dtype`` the activation
    dtype of int8/int4 (default: float32 on a CPU, what the engine runs there; bfloat16 on a GPU);
    ``group_size`` that of int4 (default 32, the engine's; a layer it does not divide is planned at
    the largest size that does, with a note: the engine needs
    ``quantization_config={"fallback": True}`` for that); ``lm_head`` the engine's LM head
    policy: "quantize", "int8" (int4 only) or "keep" (None: its default, an int8 head;
    minserve/quant/schemes.py).
    ``context_len`` defaults to the model's context length,
    at most 4096. ``kv_cache_dtype`` is the engine argument: "auto" (KV in ``dtype``) or "int8"
    (engine/kv_cache.py's bytes per token, the same function the engine sizes its pool with).
    ``activations``: the int8/int4 engines' ``quantization_config["activations"]``: "float", or
    "int8" (CPU only, as the engine; the weights then count the tiles its integer loops keep,
    ``budget.a8_tile_bytes``, and the weight products run at the probe's measured rate of the
    integer loops, attention at the float rate; without that measurement, at the 16-bit rate).
    The defaults (this machine, fp32) are what minserve runs here; for a GPU pass
    e.g. ``hardware="h100", precision="bf16"``. See :mod:`minserve.plan.budget` for the formulas."""
    name, cfg = model_config(model)
    hw = get_hardware(hardware)
    # int8/int4 activations: float32 on a CPU, as the engine runs them there by default (its K/V
    # then takes 4 bytes an element, not bf16's 2: the sequences that fit halve); bf16 on a GPU.
    precision, dtype = budget.normalize_precision(precision, dtype,
                                                  "float32" if hw.device == "cpu" else "bfloat16")
    _check_int("block_size", block_size, 1, 256)
    if context_len is None:
        context_len = min(4096, cfg.max_position_embeddings)
    _check_int("context_len", context_len, 1, cfg.max_position_embeddings)
    w = budget.weight_bytes(cfg, precision, dtype, group_size, lm_head)
    if activations not in ("float", "int8"):
        raise ValueError(f"activations must be one of float, int8, got {activations!r}")
    if activations == "int8":
        if hw.device != "cpu":
            raise ValueError(f"activations='int8' has kernels for the CPU only; {hw.name} has device={hw.device!r}")
        w.a8_tiles = budget.a8_tile_bytes(cfg, precision, group_size, lm_head)
    memory = hw.memory_bytes if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
    kv_per_token = kv_cache_bytes_per_token(cfg, kv_cache_dtype, dtype)  # the engine's own formula
    notes = _group_notes(cfg, precision, group_size, lm_head)
    memory_notes_from = len(notes)   # the notes so far say nothing about memory
    if kv_cache_memory is not None:
        kv_budget = parse_bytes(kv_cache_memory, "kv_cache_memory")
        if w.resident + kv_budget > memory:
            notes.append(f"weights + kv_cache_memory exceed the memory budget by "
                         f"{(w.resident + kv_budget - memory) / 2**30:.2f} GiB")
    else:
        try:
            kv_budget = budget.kv_budget_within(memory, w.resident)  # the engine's memory_budget formula
        except ValueError:
            kv_budget = 0
            notes.append(f"the weights alone exceed the memory budget by {(w.resident - memory) / 2**30:.2f} GiB")
    blocks = kv_budget // (kv_per_token * block_size)
    per_seq = math.ceil(context_len / block_size)
    seqs = blocks // per_seq
    if seqs == 0 and len(notes) == memory_notes_from:   # no note said the budget is exceeded
        notes.append(f"not one sequence of {context_len} tokens fits in the KV budget")
    product_rate = hw.a8_ops_per_s(precision) if activations == "int8" else None
    if activations == "int8" and product_rate is None:
        notes.append("times at the 16-bit matmul rate: int8 activations' products run at the rate of the "
                     "integer loops, which the probe measures only where they are built")
    rate, bw = hw.flops_per_s(dtype), hw.bandwidth_bytes_per_s
    head = lm_head or budget.DEFAULT_LM_HEAD.get(precision, "keep")
    roof = dict(bandwidth=bw, rate=rate, product_rate=product_rate, head_at_product_rate=head != "keep")
    pre = budget.prefill(cfg, w.per_step, kv_per_token, context_len, **roof)
    one = budget.decode_step(cfg, w.per_step, kv_per_token, 1, context_len, **roof)
    full = budget.decode_step(cfg, w.per_step, kv_per_token, seqs, context_len, **roof) if seqs else None
    return Plan(name, hw.name, precision, dtype, group_size, block_size, context_len,
                budget.param_count(cfg), w.resident, w.per_step, w.scales, kv_per_token, memory, kv_budget,
                blocks, per_seq, seqs, bw, rate, pre.seconds, pre.bound, one.seconds, one.bound,
                None if full is None else full.seconds, None if full is None else full.bound, notes,
                kv_cache_dtype, head, activations,
                w.a8_tiles, product_rate)


def _group_notes(cfg: ModelConfig, precision: str, group_size: int, lm_head: str | None) -> list[str]:
    """Say where int4's group size does not divide a layer (planned with the engine's fallback)."""
    if precision != "int4":
        return []
    widths = {i for _, i in budget.block_matrices(cfg)}
    if (lm_head or budget.DEFAULT_LM_HEAD["int4"]) == "quantize":
        widths.add(cfg.hidden_size)
    odd = sorted(i for i in widths if i % group_size)
    if not odd:
        return []
    used = {i: budget.resolve_group_size(group_size, i, True, f"in_features {i}", "group_size") for i in odd}
    return [f"g{group_size} does not divide in_features {', '.join(map(str, odd))}: "
            f"{', '.join(f'g{g}' for g in used.values())} there (engine: needs fallback=True)"]


def plans_frame(plans: list[Plan]):
    """Several plans side by side (one row each, numeric columns) as a pandas DataFrame."""
    import pandas as pd
    from dataclasses import asdict
    rows = [{**asdict(p), "kv_tokens": p.kv_tokens, "decode_tok_s": p.decode_tok_s,
             "decode_tok_s_full": p.decode_tok_s_full} for p in plans]
    return pd.DataFrame(rows)
