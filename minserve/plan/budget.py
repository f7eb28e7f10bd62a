"""The serving budget: what fits in memory and a first-order roofline of prefill and decode.

Formulas (P = parameters, W = weight bytes streamed per forward pass, bw = memory bandwidth,
C = matmul rate; every time is max(bytes / bw, FLOPs / C), a lower bound that real kernels
approach but do not reach):

- weights, per matrix of out x in, exactly as minserve stores them (``minserve.quant.sizes.
  linear_bytes``, the function the engine's layers agree with): fp32 4 bytes, bf16/fp16 2 bytes per
  parameter; int8 1 byte + a float32 scale per output row; int4 half a byte + a float32 scale and
  min per group of ``group_size`` inputs (a layer the size does not divide takes the largest allowed
  size that does, as the engine's ``quantization_config={"fallback": True}``; without it the engine
  refuses). Norms, biases and the embedding stay in the activation ``dtype``. The LM head follows
  the engine's policy (``minserve.quant.DEFAULT_LM_HEAD``: int8 for both int8 and int4); a quantized
  head tied to the embedding is untied, so the dense table stays resident but is not streamed.
- memory budget: KV budget = budget - resident weight bytes (``kv_budget_within``, which the
  engine's ``memory_budget`` argument uses too).
- KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element; with
  ``kv_cache_dtype="int8"``, 2 x layers x kv_heads x (head_dim x 1 + 4): int8 codes and a float32
  scale per token and head. One function computes both, for the engine and the planner:
  ``minserve.engine.kv_cache.kv_cache_bytes_per_token``.
- KV blocks = KV budget // (KV bytes per token x block_size); a sequence of L tokens holds
  ceil(L / block_size) blocks, exactly as minserve's engine allocates (engine/kv_cache.py).
- decode step at batch B, every sequence at L tokens: bytes = W + B x L x KV bytes per token
  (the weights are read once for the whole batch, each sequence's KV once for itself);
  FLOPs = 2 x B x matmul P + 4 x B x L x layers x heads x head_dim (QK^T and PV).
- prefill of one L-token prompt: FLOPs = 2 x L x block P + 2 x head P (logits for the last token
  only) + 2 x layers x heads x head_dim x L x (L + 1) (causal QK^T and PV); bytes = W + L x KV
  bytes per token written.

Not counted: activations, the CUDA context and allocator slack (leave headroom in the budget),
prefix-cache sharing (it lets more sequences fit), chunked prefill re-reading the weights, and the
fixed cost of launching kernels and running Python per step, which dominates tiny models.
"""

from __future__ import annotations

from dataclasses import dataclass

from minserve.engine.kv_sizing import kv_budget_within  # noqa: F401  (the engine's formula, named here too)
from minserve.models.registry import ModelConfig
from minserve.quant.names import DEFAULT_LM_HEAD, LM_HEAD_CHOICES
from minserve.quant.sizes import INT4_DEFAULT_GROUP_SIZE, linear_bytes, resolve_group_size

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
_PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_FLOAT_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GROUP_SIZES = (32, 64, 128)


def normalize_precision(precision: str, dtype: str | None, int_dtype: str = "bfloat16") -> tuple[str, str]:
    """(precision, activation dtype); float precisions fix the dtype, int ones default to
    ``int_dtype`` (the planner passes float32 for a CPU: what the engine runs there by default)."""
    p = _PRECISION_ALIASES.get(str(precision).lower(), str(precision).lower())
    if p not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if p in _FLOAT_DTYPE:
        if dtype is not None and dtype != _FLOAT_DTYPE[p]:
            raise ValueError(f"dtype={dtype!r} contradicts precision={p!r} (its dtype is {_FLOAT_DTYPE[p]!r}); "
                             "dtype is only a choice for int8/int4")
        return p, _FLOAT_DTYPE[p]
    return p, dtype or int_dtype


def block_matrices(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every matmul in the transformer blocks (q, k, v, o, gate, up, down per layer)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * cfg.num_layers


def _matrix_bytes(out: int, inp: int, precision: str, act_bytes: int, group_size: int,
                  fallback: bool) -> tuple[int, int]:
    """(weight bytes, scale/min bytes) of one out x in matrix, as the engine stores it."""
    if precision not in ("int8", "int4"):
        return linear_bytes(out, inp, "dense", dtype_bytes=act_bytes)
    g = resolve_group_size(group_size, inp, fallback, f"a [{out} x {inp}] matrix", "group_size") \
        if precision == "int4" else None
    return linear_bytes(out, inp, precision, g, act_bytes)


@dataclass
class WeightBytes:
    block_weights: int   # the matmuls of the transformer blocks (codes, or dense matrices)
    scales: int          # scales and mins of every quantized matmul (the LM head's included)
    other: int           # norms and biases, in the activation dtype
    embedding: int       # the input table when it is its own tensor (untied, or tied to a head
                         # that was quantized); 0 when the LM head *is* the table
    lm_head: int = 0     # the LM head's codes or dense matrix, read whole every step
    a8_tiles: int = 0    # int8 activations on a CPU: each quantized matmul again in the integer
                         # loops' tile order (resident, not streamed: a8_tile_bytes)

    @property
    def per_step(self) -> int:
        """Streamed per forward pass: all but the embedding, of which only a few rows are read."""
        return self.block_weights + self.lm_head + self.scales + self.other

    @property
    def resident(self) -> int:
        return self.per_step + self.embedding + self.a8_tiles


def weight_bytes(cfg: ModelConfig, precision: str = "fp32", dtype: str | None = None,
                 group_size: int = INT4_DEFAULT_GROUP_SIZE, lm_head: str | None = None,
                 fallback: bool = True) -> WeightBytes:
    """Bytes of the model's weights at ``precision`` (see the module docstring for the layout).
    ``lm_head``: "quantize", "keep" or (int4) "int8", as the engine's quantization_config takes it
    (None: the engine's default for the precision, ``minserve.quant.DEFAULT_LM_HEAD``)."""
    precision, dtype = normalize_precision(precision, dtype)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
    quantized = precision in ("int8", "int4")
    lm_head = lm_head or (DEFAULT_LM_HEAD[precision] if quantized else "keep")
    allowed = LM_HEAD_CHOICES[precision] if quantized else ("keep",)
    if lm_head not in allowed:
        raise ValueError(f"lm_head must be one of {', '.join(allowed)} for precision {precision}, got {lm_head!r}")
    act = DTYPE_BYTES[dtype]
    w = s = 0
    for out, inp in block_matrices(cfg):
        wb, sb = _matrix_bytes(out, inp, precision, act, group_size, fallback)
        w, s = w + wb, s + sb
    h, table = cfg.hidden_size, cfg.vocab_size * cfg.hidden_size
    head_precision = {"quantize": precision, "int8": "int8", "keep": "fp32"}[lm_head]
    head, head_scales = _matrix_bytes(cfg.vocab_size, h, head_precision, act, group_size, fallback)
    norms = (2 * cfg.num_layers + 1) * h
    separate_table = not cfg.tie_word_embeddings or head_precision != "fp32"
    return WeightBytes(w, s + head_scales, (_bias_params(cfg) + norms) * act,
                       table * act if separate_table else 0, head)


def a8_tile_bytes(cfg: ModelConfig, precision: str, group_size: int = INT4_DEFAULT_GROUP_SIZE,
                  lm_head: str | None = None, fallback: bool = True) -> int:
    """The second copy an engine with int8 activations keeps on this CPU: every quantized matmul
    whose inputs are quantized (in_features a multiple of 32), the LM head included when it is
    quantized, laid out once in the integer loops' tile order (kernels/quant_a8_tiles.h; the
    engine's ``model_runner._tile_for_a8``). Sized by this machine's C build (0 where it has no
    such loops: no AVX-512 VNNI, no compiler), as the engine's layers are."""
    from minserve.kernels.quant import a8_tiles_bytes
    precision, _ = normalize_precision(precision, None)
    if precision not in ("int8", "int4"):
        raise ValueError(f"int8 activations need precision int8 or int4, got {precision!r}")
    lm_head = lm_head or DEFAULT_LM_HEAD[precision]
    head_precision = {"quantize": precision, "int8": "int8", "keep": None}[lm_head]
    matrices = [(o, i, precision) for o, i in block_matrices(cfg)]
    if head_precision:
        matrices.append((cfg.vocab_size, cfg.hidden_size, head_precision))
    total = 0
    for out, inp, prec in matrices:
        if inp % 32:
            continue   # its inputs stay float: no tiles
        g = resolve_group_size(group_size, inp, fallback, f"a [{out} x {inp}] matrix", "group_size") \
            if prec == "int4" else group_size
        total += a8_tiles_bytes(8 if prec == "int8" else 4, inp, out, g)
    return total


def _bias_params(cfg: ModelConfig) -> int:
    """q/k/v biases (Qwen2); the other projections have none in the Llama family."""
    return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.num_layers if cfg.attention_bias else 0


def param_count(cfg: ModelConfig) -> int:
    """Unique parameters (a tied LM head counted once)."""
    blocks = sum(o * i for o, i in block_matrices(cfg))
    tables = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return blocks + _bias_params(cfg) + (2 * cfg.num_layers + 1) * cfg.hidden_size + tables


@dataclass
class Roofline:
    seconds: float
    bytes: int
    flops: int
    bound: str   # "memory" or "compute": which of the two times is the larger

    @classmethod
    def of(cls, nbytes: int, flops: int, bandwidth: float, rate: float, product_flops: int = 0,
           product_rate: float | None = None) -> "Roofline":
        """``product_rate``: the weight products' own rate (int8 activations' integer loops), for
        ``product_flops`` of the ``flops``; the rest (attention) at ``rate``."""
        tc = flops / rate if product_rate is None else product_flops / product_rate + (flops - product_flops) / rate
        tm = nbytes / bandwidth
        return cls(max(tm, tc), nbytes, flops, "memory" if tm >= tc else "compute")


def decode_step(cfg: ModelConfig, w_step: int, kv_per_token: int, batch: int, context_len: int,
                bandwidth: float, rate: float, product_rate: float | None = None,
                head_at_product_rate: bool = True) -> Roofline:
    """``head_at_product_rate``: with ``product_rate``, whether the LM head is one of those products
    (False: a float head, e.g. int8 activations with ``lm_head="keep"``, runs at ``rate``)."""
    block_p, head_p = sum(o * i for o, i in block_matrices(cfg)), cfg.vocab_size * cfg.hidden_size
    attn = 4 * context_len * cfg.num_layers * cfg.num_heads * cfg.head_dim
    products = batch * 2 * (block_p + (head_p if head_at_product_rate else 0))
    return Roofline.of(w_step + batch * context_len * kv_per_token, batch * (2 * (block_p + head_p) + attn),
                       bandwidth, rate, products, product_rate)


def prefill(cfg: ModelConfig, w_step: int, kv_per_token: int, prompt_len: int,
            bandwidth: float, rate: float, product_rate: float | None = None,
            head_at_product_rate: bool = True) -> Roofline:
    """One prompt's roofline; ``head_at_product_rate`` as in :func:`decode_step`."""
    block_p, head_p = sum(o * i for o, i in block_matrices(cfg)), cfg.vocab_size * cfg.hidden_size
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len * (prompt_len + 1)
    products = 2 * prompt_len * block_p + (2 * head_p if head_at_product_rate else 0)
    return Roofline.of(w_step + prompt_len * kv_per_token, 2 * prompt_len * block_p + 2 * head_p + attn,
                       bandwidth, rate, products, product_rate)
