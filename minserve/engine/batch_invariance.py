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

- the weight products are the int8-activation loops (``quantization_config={"activations":
  "int8"}``, kernels/quant_a8*.h), whose per-row arithmetic is fixed whatever the row count (float
  products through oneDNN are not: hence int8 activations are required);
- SwiGLU and RoPE run in C at every row count (kernels/token_ops.py), RMSNorm in PyTorch per row;
- attention of every row, prompt chunk or decode row, goes through one kernel whose rows do not
  depend on the call (``ms_prefill_attention_paged`` in kernels/prefill_attention.c);
- every step runs on the PyTorch path (``fused_decode`` off).

What it costs is the fused step: W4A8 decode at 65-68 against 157-187 tok/s at batch 1 and 529-546
against 876-950 at batch 16 (``benchmarks/bench_batch_invariance.py --cost``, 2026-12-07; short
contexts: a decode row's attention in the flash kernel costs more than in the decode kernel as the
context grows). Speculative decoding keeps the property: proposals come from the request's own
tokens, seeded draws do not depend on how many were proposed, and verification rows are rows like
the others (tests/test_batch_invariance.py).
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
        raise ValueError(f"{why} dtype='float32', got {config.dtype!r}")
    if getattr(config.quant_scheme, "activations", "float") != "int8":
        raise ValueError(f"{why} quantization='int8' or 'int4' with quantization_config="
                         "{'activations': 'int8'}: float products go through oneDNN or MKL, whose "
                         "rounding depends on how many rows a step has")
    if config.fused_decode:
        raise ValueError(f"{why} every step on the PyTorch path; leave fused_decode unset (or False)")
    config.fused_decode = False


def check_model(head_dim: int) -> None:
    """Whether this machine can run the batch-invariant attention for heads of ``head_dim``."""
    from minserve.kernels.prefill_attention import paged_available
    if head_dim % 64:
        raise ValueError(f"batch_invariant=True needs a head size that is a multiple of 64, got {head_dim}")
    if not paged_available():
        raise ValueError("batch_invariant=True needs the C attention kernel, which did not build here "
                         "(a C compiler with OpenMP; see `minserve doctor`)")
