"""Named hardware for the serving-budget planner: datasheet GPUs and this machine, as measured.

A roofline needs three numbers per device: how much memory it has, how fast it streams that memory,
and how fast it multiplies. For GPUs they come from the vendor's datasheet; for "this" machine they
are measured (:mod:`minserve.plan.probe`), because a CPU's achievable bandwidth is far below any
spec-sheet figure and depends on how many cores the process gets.

Datasheet figures are peaks. Real kernels reach roughly 70-90 % of the bandwidth and less of the
compute, so the planner's times are lower bounds: "it cannot be faster than this".
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int              # device (or host) memory the model and the KV cache share
    bandwidth_bytes_per_s: float   # memory read bandwidth
    bf16_flops_per_s: float        # dense 16-bit matmul rate (bf16/fp16; also int8/int4 weight-only)
    fp32_flops_per_s: float        # fp32 matmul rate (no TF32 on GPUs: that is not fp32 arithmetic)
    source: str                    # where the numbers come from
    device: str = "cuda"           # what the engine runs on there: the datasheets' GPUs, or "cpu"
    # The engine's int8-activation products (W8A8, W4A8) as measured here, operations/s; None where
    # not measured (the datasheets' GPUs: the engine has no such kernels there; no C loops here).
    w8a8_ops_per_s: float | None = None
    w4a8_ops_per_s: float | None = None

    def flops_per_s(self, compute_dtype: str) -> float:
        return self.fp32_flops_per_s if compute_dtype == "float32" else self.bf16_flops_per_s

    def a8_ops_per_s(self, precision: str) -> float | None:
        """The measured rate of int8-activation products for int8 or int4 weights, or None."""
        return {"int8": self.w8a8_ops_per_s, "int4": self.w4a8_ops_per_s}.get(precision)


# NVIDIA quotes memory in "GB" that are in fact binary (an "80GB" part shows 81920 MiB in
# nvidia-smi), so capacities are read as GiB; usable memory is a little lower (driver, ECC).
# Bandwidths are decimal (TB/s = 1e12 B/s). Tensor-core figures: the datasheets print the
# 2:4-sparsity number with a footnote; we use the dense one, half of it.
DATASHEET = {
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column: 80GB HBM2e, 2,039 GB/s,
    # BF16 Tensor Core 312 TFLOPS dense (624 with sparsity), FP32 19.5 TFLOPS.
    "a100": Hardware("A100 80GB SXM", 80 * GiB, 2039e9, 312e12, 19.5e12,
                     "NVIDIA A100 datasheet (80GB SXM), BF16 dense"),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column: 80GB HBM3, 3.35 TB/s,
    # BF16 Tensor Core 1,979 TFLOPS *with sparsity* -> 989.5 dense, FP32 67 TFLOPS.
    "h100": Hardware("H100 SXM", 80 * GiB, 3.35e12, 989.5e12, 67e12,
                     "NVIDIA H100 datasheet (SXM), BF16 dense = sparse 1979 / 2"),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column: 141GB HBM3e, 4.8 TB/s,
    # BF16 Tensor Core 1,979 TFLOPS *with sparsity* -> 989.5 dense (H100's compute), FP32 67 TFLOPS.
    "h200": Hardware("H200 SXM", 141 * GiB, 4.8e12, 989.5e12, 67e12,
                     "NVIDIA H200 datasheet (SXM), BF16 dense = sparse 1979 / 2"),
    # NVIDIA L4 Tensor Core GPU datasheet: 24GB GDDR6, 300 GB/s,
    # BF16 Tensor Core 242 TFLOPS *with sparsity* -> 121 dense, FP32 30.3 TFLOPS.
    "l4": Hardware("L4", 24 * GiB, 300e9, 121e12, 30.3e12,
                   "NVIDIA L4 datasheet, BF16 dense = sparse 242 / 2"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 column: 24GB GDDR6X,
    # 1,008 GB/s, "Peak BF16 Tensor TFLOPS with FP32 Accumulate" 165.2 dense (330.4 sparse;
    # GeForce cards run FP32 accumulation at half rate), FP32 82.6 TFLOPS.
    "rtx4090": Hardware("GeForce RTX 4090", 24 * GiB, 1008e9, 165.2e12, 82.6e12,
                        "NVIDIA Ada whitepaper (RTX 4090), BF16 dense, FP32 accumulate"),
}

# Spellings people type; all map to a key of DATASHEET.
_ALIASES = {"a100-80gb": "a100", "a100-sxm": "a100", "h100-sxm": "h100", "h200-sxm": "h200",
            "4090": "rtx4090", "rtx-4090": "rtx4090"}

THIS = "this"


def known_hardware() -> list[str]:
    """Names ``get_hardware`` accepts: the datasheet entries and "this" (measured here)."""
    return [*DATASHEET, THIS]


def get_hardware(name: str | Hardware, remeasure: bool = False) -> Hardware:
    """A :class:`Hardware` by name; ``"this"`` probes this machine (once, then cached)."""
    if isinstance(name, Hardware):
        return name
    if not isinstance(name, str):
        raise ValueError(f"hardware must be a name ({', '.join(known_hardware())}) or a Hardware, got {name!r}")
    key = name.strip().lower().replace(" ", "").replace("_", "-")
    key = _ALIASES.get(key, key)
    if key == THIS:
        from minserve.plan.probe import this_machine
        return this_machine(remeasure=remeasure)
    if key not in DATASHEET:
        raise ValueError(f"hardware must be one of {', '.join(known_hardware())}, got {name!r}")
    return DATASHEET[key]
