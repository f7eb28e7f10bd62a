"""The dense matrix product behind every :class:`~minserve.models.layers.Linear` on a CPU.

``F.linear`` on float32 CPU tensors goes to the BLAS PyTorch was built with (MKL in the x86
wheels). On the AMD EPYC this project runs on, MKL's sgemm reaches about 40 % of the fp32 FMA
ceiling, while oneDNN, also inside every x86 PyTorch build and reachable as
``torch.ops.mkldnn._linear_pointwise``, works on the plain weight tensor (no second copy in another
layout) and reaches about 90 % of it. One run of benchmarks/bench_roofline.py (FMA ceiling 526
GFLOP/s; MKL / oneDNN in GFLOP/s): 1024 rows x the model's matrices 211-216 / 474-484 (2.2-2.3x),
16 rows 127-133 / 232-257 (1.7-2.0x), the LM head (49152 x 576) at 1 row 8.1 / 22.2 and at 16
rows 65 / 177 (2.7x). Decode steps run in the fused C kernel, so here the one-row case is the
last token of a prefill going through the LM head: oneDNN takes that too.

The result is the same float32 product summed in another order: it differs from MKL's by float32
rounding (about 1e-6 relative), which the token-exact tests against transformers tolerate as
they tolerate any kernel's rounding.

Which one wins depends on the CPU's maker: MKL picks its fast code paths on Intel CPUs only. On the
Intel Xeon host (AVX-512, AMX; 2026-12-03), benchmarks/bench_roofline.py's kernel table gave at
1024 rows MKL 276-294 and oneDNN 264-267 GFLOP/s over the model's matrices (MKL 1.04-1.11x), and at
16 rows 84-116 against 81-87: there the default is MKL.

``MINSERVE_GEMM=torch`` forces ``F.linear`` everywhere (to compare, or where oneDNN misbehaves);
``onednn`` uses oneDNN for every 2-D float32 CPU input; ``auto`` (the default) takes oneDNN except on
an Intel CPU. A PyTorch without oneDNN (an ARM or a minimal build) falls back to ``F.linear`` by
itself.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from minserve.kernels.build import cpu_info

log = logging.getLogger("minserve")

BACKENDS = ("auto", "onednn", "torch")


@functools.lru_cache(maxsize=None)
def backend() -> str:
    """``onednn`` or ``torch``: what float32 CPU products use in this process (decided once)."""
    wanted = os.environ.get("MINSERVE_GEMM", "auto").strip().lower() or "auto"
    if wanted not in BACKENDS:
        raise ValueError(f"MINSERVE_GEMM must be one of {', '.join(BACKENDS)}, got {wanted!r}")
    if wanted == "auto":
        wanted = "torch" if cpu_info("vendor_id") == "GenuineIntel" else "onednn"
    if wanted == "torch":
        return "torch"
    try:
        x, w = torch.ones(2, 8), torch.ones(4, 8)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        if not torch.equal(y, F.linear(x, w)):
            raise RuntimeError("oneDNN's product disagrees with F.linear on a 2x8 by 8x4 check")
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        log.info("float32 matmuls use F.linear (oneDNN's linear unavailable: %s)", e)
        return "torch"
    return "onednn"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: oneDNN for 2-D float32 CPU inputs with a contiguous weight,
    ``F.linear`` for everything else (other dtypes and devices, empty inputs)."""
    if (x.dtype is torch.float32 and weight.dtype is torch.float32 and x.device.type == "cpu"
            and x.dim() == 2 and x.shape[0] > 0 and weight.is_contiguous()
            and backend() == "onednn"):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
