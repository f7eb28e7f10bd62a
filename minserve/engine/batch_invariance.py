"""Batch-invariant runs: a request's tokens and log-probabilities do not depend on its neighbours.

What a step computes for one token can depend on everything else in the step, in the last bits:
a matrix product's kernel and summation order are chosen by how many rows the step has (oneDNN,
MKL), attention picks a kernel by how many queries a chunk has, and the fused decode step runs the
same formulas as the PyTorch path with other roundings. Which of these a token meets depends on the
other requests: how many decode beside it, where the token budget cuts its prompt into chunks, what
the prefix cache held, whether it was preempted and recomputed. Seeded sampling then draws other
tokens from the same seed once those bits move a probability across a draw (with int8 activations
they move a lot: a value that lands on the other side of a rounding boundary changes its code).

``EngineConfig(batch_invariant=True)`` (``--batch-invariant``; vLLM's ``VLLM_BATCH_INVARIANT``)
removes every such dependence on the CPU:

- every step, prompt chunks, decode and verify rows and prompt logprobs alike, runs in one
  executor: the fused C step (kernels/decode.c; engine/fused_step.py's InvariantFusedExecutor),
  whose products, norms, RoPE and SwiGLU are computed row by row in loops whose sum for one row is
  fixed whatever the row count and the thread count (oneDNN and MKL block by the row count: a row's
  last bits moved with its neighbours, 1.8e-5 nats);
- attention of every row goes through one kernel whose rows do not depend on the call
  (``ms_prefill_attention_paged`` in kernels/prefill_attention_paged.h), called from the fused step
  (kernels/decode_flash.py), not the decode kernel: a token is computed as a decode row and again
  as a prompt row when its sequence is preempted and recomputed, and the two must agree;
- where the fused step cannot run (``fused_decode=False``, a model class it does not compute, no C
  compiler for it), every step runs on the PyTorch path instead, with the same kernel for attention,
  float32 weights in decode.c's dense loops (``ms_matmul``), int8/int4 weights in quant.c's loops
  at every row count (not the dequantized tiles of long chunks), SwiGLU and RoPE in C
  (kernels/token_ops.py) and RMSNorm per row. Each path is invariant; the two differ in the last
  bits from each other, so one engine uses one.

What it costs (``benchmarks/bench_batch_invariance.py --cost``, SmolLM2, two threads, 2026-12-08):
prefill nothing for float32 and int8 activations (the row-invariant loops run near oneDNN's rate on
long chunks), half for int4 weights with float inputs (no dequantized tiles); decode at short
contexts little (within the default's range or ~0.8-0.9x), more as contexts grow (a decode row's
attention in the flash kernel; docs/engine/sampling.md has the tables). On the PyTorch path decode
runs at 0.3-0.6x of the default at batch 1.
N-gram speculation keeps the property: proposals come from the request's own tokens, seeded draws
do not depend on how many were proposed, and verification rows are rows like the others
(tests/test_batch_invariance.py). A draft model does not (its proposals are sampled from one
generator that every request draws from), so the mode refuses it.
"""

from __future__ import annotations


def check_config(config) -> None:
    """Validate ``batch_invariant`` against the rest of ``config`` (an EngineConfig whose device and
    quantization are resolved); turn the fused step off for it. ValueError names what conflicts."""
    if not isinstance(config.batch_invariant, bool):
        raise ValueError(f"batch_invariant must be True or False, got {config.batch_invariant!r}")
    if not config.batch_invariant:
        return
    why = "batch_invariant=True needs"
    if config.device != "cpu":
        raise ValueError(f"{why} the CPU kernels (device={config.device!r})")
    if config.dtype != "float32":
        raise ValueError(f"{why} dtype='float32', got {config.dtype!r}: half-precision products "
                         "run on oneDNN or the AMX tiles, blocked by the row count")
    if config.fp32_matmul_precision != "highest":
        raise ValueError(f"{why} fp32_matmul_precision='highest': 'high' multiplies on the AMX "
                         "tiles from 16 rows on")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError(f"{why} n-gram speculation or none: a draft model samples its proposals from "
                         "one generator shared by every request, so a sampled request's tokens would "
                         "depend on the others")


def make_row_invariant(model) -> int:
    """Send every weight product of ``model`` through loops whose sum for one row does not depend
    on the others: float32 weights through decode.c's dense loops, int8/int4 weights with float
    inputs through quant.c's at every row count (not the dequantized tiles), int8 activations'
    loops as they are. Returns how many layers were switched."""
    from minserve.models.layers import Linear
    from minserve.quant.schemes import _QuantLinear
    layers = [m for m in model.modules() if isinstance(m, (Linear, _QuantLinear))]
    for layer in layers:
        layer.row_invariant = True
    return len(layers)


def check_model(model_config) -> None:
    """Whether this machine can run the batch-invariant attention for this model (a ModelConfig:
    its head size and query heads per kv head, the C attention kernel's limits)."""
    from minserve.kernels.decode_flash import MAX_GROUP
    from minserve.kernels.prefill_attention import paged_available
    head_dim, group = model_config.head_dim, model_config.num_heads // model_config.num_kv_heads
    if head_dim % 64:
        raise ValueError(f"batch_invariant=True needs a head size that is a multiple of 64, got {head_dim}")
    if group > MAX_GROUP:
        raise ValueError(f"batch_invariant=True needs at most {MAX_GROUP} query heads per kv head, got {group}")
    if not paged_available():
        raise ValueError("batch_invariant=True needs the C attention kernel: MINSERVE_PREFILL_ATTENTION=sdpa "
                         "turns it off, or it did not build here (a C compiler with OpenMP; see "
                         "`minserve doctor`)")
