"""The fused CPU step: every layer of a batch of query rows in one call into C.

:class:`FusedDecoder` binds a :class:`~minserve.models.llama.LlamaForCausalLM` and its paged KV
cache to ``ms_decode_step`` in ``decode.c`` (beside this file) once (pointers to every weight and
cache tensor), then runs each step with a single ctypes call instead of ~35 PyTorch operations per
layer. It computes what ``LlamaForCausalLM.forward`` computes, in the same order of operations
except for the summation order inside dot products, so greedy outputs stay token-exact against
transformers (tests/test_fused_decode.py and tests/test_fused_verify.py check it against PyTorch).

A step is a list of *rows*: one token each, with its own position and block-table row. A decode
step has one row per sequence; speculative verification gives a sequence k + 1 rows at
consecutive positions sharing its table (:func:`rows_block_tables` builds those tables). Each
layer writes every row's K/V before any row attends, so row j sees its own sequence's earlier rows.

Weights are bound through :meth:`Linear.descriptor` (minserve/models/weights.py), one format per
matrix: dense float32, int8 (one scale per output row) or int4 (groups of 32, 64 or 128 with a
scale and a min each), in minserve/quant/formats.py's layouts; each Linear of each layer and the LM
head may differ. A quantized descriptor may say ``activations="int8"``: its input rows are then
quantized in blocks of 32 and multiplied with integer dot products (kernels/quant_a8.h), as the
layer's own forward does (minserve/quant/activations.py). The kernel refuses anything else with the module's name (:func:`unsupported_reason`),
so it never reads int8 codes or bf16 halves as float32. The KV cache is float32 ``(key, value)``
per layer, or ``kv_cache_dtype="int8"``'s ``(key codes, value codes, key scales, value scales)``,
written and read in place (quantized on write exactly as kernels/triton/reference.py does).
bfloat16 weights (``dtype="bfloat16"``) are widened to float32 as they stream in; a step of several
rows multiplies them on AMX tiles where the CPU has them (kernels/amx_bf16.h; ``MINSERVE_AMX=off``
turns them off), else on AVX-512 BF16 dot products with each input rounded to bf16 (decode.c's
dp_block; ``MINSERVE_BF16_DOT=off`` turns them off), else in the widening vector loop. float16 and
GPUs keep using the PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from minserve.kernels.build import KernelUnavailable, env_choice, load
from minserve.kernels.decode_flash import FlashPlan, FlashSequences, flash_reason
from minserve.kernels.formats import DENSE

_f32p = ctypes.POINTER(ctypes.c_float)
_i64p = ctypes.POINTER(ctypes.c_int64)
_i8p = ctypes.POINTER(ctypes.c_int8)
_u8p = ctypes.POINTER(ctypes.c_uint8)
_bf16p = ctypes.POINTER(ctypes.c_uint16)   # bfloat16 as its bits
_I64 = ctypes.c_int64
_DTYPES = {_f32p: torch.float32, _i64p: torch.int64, _i8p: torch.int8, _u8p: torch.uint8,
           _bf16p: torch.bfloat16}
_KERNEL = ("the fused decode kernel implements dense float32 or bfloat16, int8 (one scale per "
           "output row) and int4 (groups of 32, 64 or 128) only")
INT4_GROUP_SIZES = (32, 64, 128)   # the int4 group sizes decode.c compiles a loop for
A8_BLOCK = 32                      # quant_a8.h: input columns per int8 activation scale
# decode.c's enums: a matrix's format, and the KV cache's.
WEIGHT_F32, WEIGHT_INT8, WEIGHT_INT4, WEIGHT_BF16 = 0, 1, 2, 3
KV_F32, KV_INT8, KV_BF16 = 0, 1, 2
STEP_PARTS = ("weights", "lm_head", "attention", "step")   # decode.c's PART_*, in order
_PROFILE_CLOCKS = {None: 0, "wall": 1, "cpu": 2}             # decode.c's PROFILE_*


class _Weight(ctypes.Structure):   # decode.c's Weight: one matrix in its own format
    _fields_ = [("format", _I64), ("data", ctypes.c_void_p), ("scales", _f32p), ("mins", _f32p),
                ("bias", _f32p), ("group_size", _I64), ("act_int8", _I64),
                ("split_hi", _bf16p), ("split_lo", _bf16p), ("a8_tiles", ctypes.c_void_p)]


class _LayerPtrs(ctypes.Structure):
    _fields_ = ([(n, _f32p) for n in ("input_norm", "post_norm")]
                + [(n, _Weight) for n in ("qkv", "o_proj", "gate_up", "down")]
                + [(n, ctypes.c_void_p) for n in ("k_cache", "v_cache")]
                + [(n, _f32p) for n in ("k_scales", "v_scales")])


class _ModelPtrs(ctypes.Structure):
    _fields_ = ([(n, _I64) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate", "vocab", "block_size", "kv_format", "embed_bf16")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("embed", ctypes.c_void_p)]
                + [(n, _f32p) for n in ("final_norm", "cos", "sin_signed")]
                + [("lm_head", _Weight), ("layers", ctypes.POINTER(_LayerPtrs))])


class _Scratch(ctypes.Structure):
    _fields_ = ([(n, _f32p) for n in ("h", "x", "qkv", "attn", "gate_up", "act", "xs", "scores")]
                + [("scores_stride", _I64), ("flash", ctypes.POINTER(FlashPlan))])


def amx_wanted() -> bool:
    """``MINSERVE_AMX``: "auto" (default: AMX tiles for bf16 weights where the CPU has them) or
    "off"; anything else is an error."""
    return env_choice("MINSERVE_AMX", ("auto", "off")) == "auto"


def bf16_dot_wanted() -> bool:
    """``MINSERVE_BF16_DOT``: "auto" (default: AVX-512 BF16 dot products, each input rounded to bf16,
    for bf16 weights times two or more rows where the CPU has them and no tiles are in use) or "off"
    (the widening loop: float32 inputs); anything else is an error."""
    return env_choice("MINSERVE_BF16_DOT", ("auto", "off")) == "auto"


def _ptr(t: torch.Tensor | None, kind=_f32p):
    if t is None:
        return kind()
    # The last line of defence: C reads whatever the pointer points at as `kind`.
    want = _DTYPES[kind]
    if t.dtype != want or not t.is_contiguous() or t.device.type != "cpu":
        raise TypeError(f"binding a {t.dtype} tensor (contiguous: {t.is_contiguous()}, {t.device}) "
                        f"as contiguous CPU {want}")
    return ctypes.cast(t.data_ptr(), kind)


def _void(t: torch.Tensor, kind) -> ctypes.c_void_p:
    """An untyped pointer for a field whose type the struct's format names, checked as ``kind``."""
    return ctypes.cast(_ptr(t, kind), ctypes.c_void_p)


def rows_block_tables(query_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
    """The ``block_tables`` argument of a step: [sum(query_lens), n] int64, each sequence's table
    (padded with block 0 to the longest; padding is never read, a row attends only up to its
    position) repeated once per query row of that sequence."""
    if len(query_lens) != len(block_tables) or not query_lens or min(query_lens) < 1:
        raise ValueError(f"query_lens must be >= 1, one per block table, got {list(query_lens)} "
                         f"for {len(block_tables)} tables")
    n = max(1, max(len(t) for t in block_tables))
    padded = torch.tensor([list(t) + [0] * (n - len(t)) for t in block_tables], dtype=torch.int64)
    if max(query_lens) == 1:   # a decode step: one row per table, nothing to repeat
        return padded
    return padded.repeat_interleave(torch.tensor(query_lens), dim=0)


# ---- binding: every tensor the kernel reads, checked against the model config -------------------

def _tensor(name: str, t: torch.Tensor | None, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """``t`` if it is a contiguous CPU tensor of ``dtype`` and ``shape`` (None: any size), else refuse."""
    if t is None:
        raise KernelUnavailable(f"{name} is missing")
    if t.device.type != "cpu":
        raise KernelUnavailable(f"{name} is on {t.device.type}; the fused decode kernel is CPU-only")
    if t.dtype != dtype:
        raise KernelUnavailable(f"{name}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                                f"the fused decode kernel reads it as {str(dtype).removeprefix('torch.')}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = [s if s is not None else "*" for s in shape]
        raise KernelUnavailable(f"{name} has shape {list(t.shape)}, the model config implies {want}")
    if not t.is_contiguous():
        raise KernelUnavailable(f"{name} is not contiguous")
    return t


def _f32(name: str, t: torch.Tensor | None, shape: tuple) -> torch.Tensor:
    return _tensor(name, t, torch.float32, shape)


def _f32_of(name: str, t: torch.Tensor | None, shape: tuple) -> torch.Tensor:
    """A small vector (a norm's weight, a bias) as float32: a bfloat16 model's is widened into a
    copy the decoder keeps (exact). The step computes in float32 whatever the weights' format."""
    if t is not None and t.dtype == torch.bfloat16:
        t = _tensor(name, t, torch.bfloat16, shape).float()
    return _f32(name, t, shape)


def _dense(name: str, d, out: int, inp: int):
    if d.dtype not in (torch.float32, torch.bfloat16):
        raise KernelUnavailable(f"{name}: {d.describe()}; {_KERNEL}")
    if d.scales is not None or d.zero_points is not None:
        raise KernelUnavailable(f"{name}: a dense descriptor with scales or zero points; {_KERNEL}")
    if d.dtype == torch.bfloat16:
        return WEIGHT_BF16, (_tensor(f"{name}.weight", d.data, torch.bfloat16, (out, inp)), _bf16p), None, None, 0
    return WEIGHT_F32, (_f32(f"{name}.weight", d.data, (out, inp)), _f32p), None, None, 0


def _int8(name: str, d, out: int, inp: int):
    if d.zero_points is not None or d.group_size is not None:  # formats.py: symmetric, per row
        raise KernelUnavailable(f"{name}: {d.describe()} with zero points or a group size; {_KERNEL}")
    return (WEIGHT_INT8, (_tensor(f"{name}.codes", d.data, torch.int8, (out, inp)), _i8p),
            _f32(f"{name}.scales", d.scales, (out,)), None, 0)


def _int4(name: str, d, out: int, inp: int):
    g = d.group_size
    if g not in INT4_GROUP_SIZES or inp % g:
        raise KernelUnavailable(f"{name}: {d.describe()}: group size {g!r} is not one of "
                                f"{INT4_GROUP_SIZES} dividing in_features {inp}; {_KERNEL}")
    groups = (out, inp // g)
    return (WEIGHT_INT4, (_tensor(f"{name}.codes", d.data, torch.uint8, (out, inp // 2)), _u8p),
            _f32(f"{name}.scales", d.scales, groups), _f32(f"{name}.mins", d.zero_points, groups), g)


_FORMATS = {DENSE: _dense, "int8": _int8, "int4": _int4}


def _weight(name: str, module, out: int, inp: int, bias_ok: bool = False):
    """(the C Weight, the tensors it points into) for a linear layer's descriptor, else refuse.
    A descriptor with ``activations="int8"`` takes its input rows quantized (decode.c's matmul,
    minserve/quant/activations.py), as the layer's own forward does."""
    if not hasattr(module, "descriptor"):
        raise KernelUnavailable(f"{name}: {type(module).__name__} has no descriptor(); the fused "
                                "decode kernel binds weights only through descriptors")
    d = module.descriptor()
    if d.format not in _FORMATS:
        raise KernelUnavailable(f"{name}: {d.describe()}; {_KERNEL}")
    if (d.out_features, d.in_features) != (out, inp):
        raise KernelUnavailable(f"{name}: {d.describe()}, the model config implies [{out} x {inp}]")
    if d.bias is not None and not bias_ok:  # the kernel adds a bias only after q/k/v
        raise KernelUnavailable(f"{name} has a bias, which the fused decode kernel does not apply")
    bias = None if d.bias is None else _f32_of(f"{name}.bias", d.bias, (out,))
    fmt, (data, kind), scales, mins, group = _FORMATS[d.format](name, d, out, inp)
    act_int8 = d.activations == "int8"
    if act_int8 and (fmt in (WEIGHT_F32, WEIGHT_BF16) or inp % A8_BLOCK):
        raise KernelUnavailable(f"{name}: {d.describe()}: int8 activations need a quantized matrix "
                                f"whose in_features divide into blocks of {A8_BLOCK}")
    halves = _split_halves(name, d, out, inp) if fmt == WEIGHT_F32 else [None, None]
    tiles = _a8_tiles(name, d, fmt, out, inp) if act_int8 else None
    w = _Weight(fmt, _void(data, kind), _ptr(scales), _ptr(mins), _ptr(bias), group, act_int8,
                *[_ptr(h, _bf16p) for h in halves], None if tiles is None else tiles.data_ptr())
    return w, [t for t in (data, scales, mins, bias, *halves, tiles) if t is not None]


def _a8_tiles(name: str, d, fmt: int, out: int, inp: int) -> torch.Tensor | None:
    """A quantized descriptor's tiles for int8 activations (quant_a8_tiles.h's order), checked
    against the size quant.c computes for its shape; None when it has none."""
    if d.a8_tiles is None:
        return None
    from minserve.kernels.quant import check_tiles
    try:
        check_tiles(d.a8_tiles, 4 if fmt == WEIGHT_INT4 else 8, inp, out, d.group_size or 0)
    except ValueError as e:
        raise KernelUnavailable(f"{name}.a8_tiles: {e}") from None
    return d.a8_tiles


def _split_halves(name: str, d, out: int, inp: int) -> list[torch.Tensor | None]:
    """A float32 descriptor's bf16 halves (an engine at fp32_matmul_precision "high"), which the
    step multiplies on AMX tiles at two rows or more; [None, None] when it has none."""
    if d.bf16_halves is None:
        return [None, None]
    return [_tensor(f"{name}.bf16_halves[{i}]", h, torch.bfloat16, (out, inp)) for i, h in enumerate(d.bf16_halves)]


def _kv_layout(kv_caches, cfg) -> tuple[int, tuple[int, int, int, int]]:
    """(KV_F32, KV_BF16 or KV_INT8, the cache shape) from layer 0; every layer is then checked
    against it."""
    if len(kv_caches) != cfg.num_layers:
        raise KernelUnavailable(f"{len(kv_caches)} KV caches for {cfg.num_layers} layers")
    n = len(kv_caches[0])
    if n not in (2, 4):
        raise KernelUnavailable(f"kv_caches[0] holds {n} tensors; the fused decode kernel reads "
                                "(key, value) float32 or bfloat16, or (key, value, key_scales, "
                                "value_scales) int8")
    k0 = kv_caches[0][0]
    if k0.dim() != 4:
        raise KernelUnavailable(f"kv_caches[0].key has shape {list(k0.shape)}, expected "
                                "[blocks, block_size, kv_heads, head_dim]")
    fmt = KV_INT8 if n == 4 else KV_BF16 if k0.dtype == torch.bfloat16 else KV_F32
    return fmt, (k0.shape[0], k0.shape[1], cfg.num_kv_heads, cfg.head_dim)


def _bind_kv(i: int, kv, kv_format: int, shape) -> list[torch.Tensor]:
    """Layer i's [key, value] (float32 or bfloat16) or [key codes, value codes, key scales,
    value scales]."""
    names = [f"kv_caches[{i}].{n}" for n in ("key", "value", "key_scales", "value_scales")]
    if len(kv) != (4 if kv_format == KV_INT8 else 2):
        raise KernelUnavailable(f"kv_caches[{i}] holds {len(kv)} tensors, kv_caches[0] "
                                f"{4 if kv_format == KV_INT8 else 2}: every layer needs the same layout")
    if kv_format in (KV_F32, KV_BF16):
        dtype = torch.float32 if kv_format == KV_F32 else torch.bfloat16
        return [_tensor(names[0], kv[0], dtype, shape), _tensor(names[1], kv[1], dtype, shape)]
    return ([_tensor(n, t, torch.int8, shape) for n, t in zip(names, kv[:2])]
            + [_f32(n, t, shape[:3]) for n, t in zip(names[2:], kv[2:])])


def _bind_layer(i: int, layer, kv, cfg, kv_layout) -> tuple[_LayerPtrs, list[torch.Tensor]]:
    E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, Hkv, p = cfg.num_heads, cfg.num_kv_heads, f"layers.{i}."
    attn, mlp = layer.self_attn, layer.mlp
    weights = {"qkv": _weight(p + "self_attn.qkv_proj", attn.qkv_proj, (H + 2 * Hkv) * D, E, bias_ok=True),
               "o_proj": _weight(p + "self_attn.o_proj", attn.o_proj, E, H * D),
               "gate_up": _weight(p + "mlp.gate_up_proj", mlp.gate_up_proj, 2 * I, E),
               "down": _weight(p + "mlp.down_proj", mlp.down_proj, E, I)}
    norms = [_f32_of(p + "input_layernorm.weight", layer.input_layernorm.weight, (E,)),
             _f32_of(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight, (E,))]
    kv_format, shape = kv_layout
    cache = _bind_kv(i, kv, kv_format, shape)
    codes = {KV_INT8: _i8p, KV_BF16: _bf16p}.get(kv_format, _f32p)
    scales = [_ptr(t) for t in cache[2:]] or [_f32p(), _f32p()]
    ptrs = _LayerPtrs(_ptr(norms[0]), _ptr(norms[1]), *[w for w, _ in weights.values()],
                      _void(cache[0], codes), _void(cache[1], codes), *scales)
    return ptrs, norms + cache + [t for _, kept in weights.values() for t in kept]


def _bind(model, kv_caches) -> tuple[_ModelPtrs, object, list]:
    """Pointers to everything the kernel reads, after checking each tensor; raises KernelUnavailable
    with the reason (naming the module) when the model or cache is not what the kernel implements."""
    cfg = model.config
    E, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    w = model.embed_tokens.weight
    if w is not None and w.dtype not in (torch.float32, torch.bfloat16):
        raise KernelUnavailable(f"embed_tokens.weight: {str(w.dtype).removeprefix('torch.')} "
                                f"{list(w.shape)}, the fused decode kernel reads float32 or bfloat16")
    embed_bf16 = w is not None and w.dtype == torch.bfloat16
    embed = _tensor("embed_tokens.weight", w, torch.bfloat16 if embed_bf16 else torch.float32, (V, E))
    if D % 2 or D > 1024:  # rope() rotates half-split pairs in a 1024-float stack buffer
        raise KernelUnavailable(f"head_dim {D} is odd or > 1024")
    lm_head, head_tensors = _weight("lm_head", model.lm_head, V, E)
    final_norm = _f32_of("norm.weight", model.norm.weight, (E,))
    cos = _f32("rotary.cos", model.rotary.cos, (None, D))
    sin = _f32("rotary.sin_signed", model.rotary.sin_signed, tuple(cos.shape))
    kv_layout = _kv_layout(kv_caches, cfg)
    layers, keep = [], [model, kv_caches, embed, final_norm, cos, sin, *head_tensors]
    for i, (layer, kv) in enumerate(zip(model.layers, kv_caches)):
        ptrs, bound = _bind_layer(i, layer, kv, cfg, kv_layout)
        layers.append(ptrs)
        keep += bound
    array = (_LayerPtrs * cfg.num_layers)(*layers)
    ptrs = _ModelPtrs(cfg.num_layers, E, cfg.num_heads, cfg.num_kv_heads, D, cfg.intermediate_size,
                      V, kv_layout[1][1], kv_layout[0], int(embed_bf16), cfg.rms_norm_eps, D ** -0.5,
                      _void(embed, _bf16p if embed_bf16 else _f32p), _ptr(final_norm), _ptr(cos), _ptr(sin), lm_head, array)
    return ptrs, array, keep


def unsupported_reason(model, kv_caches) -> str | None:
    """Why the fused kernel cannot run this model over this KV cache, or None when it can."""
    w = model.embed_tokens.weight
    if w.device.type != "cpu":
        return f"the model is on {w.device.type}, the fused decode kernel is CPU-only"
    try:
        _bind(model, kv_caches)
    except KernelUnavailable as e:
        return str(e)
    return None


class FusedDecoder:
    """Runs steps of query rows (decodes, or k + 1 rows per sequence to verify) of a Llama model in C.

    ``max_rows``: the most rows (tokens) one step may hold; the scratch buffers are sized for it.
    ``max_batch`` is the older, decode-only spelling (one row per sequence): with it,
    :meth:`supports` accepts only steps whose every query length is 1, as it always did.
    ``flash``: attend through the paged flash kernel, the batch-invariant mode's
    (kernels/decode_flash.py); each call then takes the step's :class:`FlashSequences`.
    """

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, ...]],
                 max_rows: int | None = None, *, max_batch: int | None = None, flash: bool = False):
        if (max_rows is None) == (max_batch is None):
            raise TypeError("FusedDecoder takes max_rows (or the older max_batch), exactly one")
        limit = max_rows if max_rows is not None else max_batch
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_rows must be an int >= 1, got {limit!r}")
        self._model, self._layers, self._keep = _bind(model, kv_caches)  # raises with the reason
        # The C side holds raw pointers: _keep holds every bound tensor. Replacing a weight tensor
        # later (model.to(), quantizing in place) needs a new FusedDecoder.
        self._lib = load("decode")
        self.library_name = self._lib._name
        self._lib.ms_decode_step.restype = _I64
        # bf16 weights times several rows on AMX tiles where the CPU has them (amx_bf16.h), else on
        # AVX-512 BF16 dot products (decode.c's dp_block); MINSERVE_AMX=off / MINSERVE_BF16_DOT=off
        # turn each off. Process-wide switches, as the library is one.
        self.uses_amx = bool(self._lib.ms_amx(ctypes.c_int(amx_wanted())))
        self.uses_bf16_dot = bool(self._lib.ms_bf16_dot(ctypes.c_int(bf16_dot_wanted()))) and not self.uses_amx
        self.last_team_size = 0   # OpenMP threads that ran the last step (the kernel reports it)
        self.max_rows, self._decode_only = limit, max_rows is None
        self._blocks, self._positions = kv_caches[0][0].shape[0], model.rotary.cos.shape[0]
        cfg = model.config
        e, qkv = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        attn, inter = cfg.num_heads * cfg.head_dim, cfg.intermediate_size
        # xs: an int4 matrix's input in its nibble order, or int8 activations (decode.c's matmul),
        # as wide as any input, plus one float per row.
        sizes = dict(h=e, x=e, qkv=qkv, attn=attn, gate_up=2 * inter, act=inter, xs=max(e, attn, inter) + 1)
        self._buffers = {n: torch.empty(limit, size) for n, size in sizes.items()}
        self._scores = torch.empty(0)
        self._scratch = _Scratch(*[_ptr(self._buffers[n]) for n in sizes], _ptr(self._scores), 0)
        self.flash = flash
        if flash:
            self._bind_flash(cfg, kv_caches, limit)

    def _bind_flash(self, cfg, kv_caches, rows: int) -> None:
        reason = flash_reason(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_caches[0][0].dtype)
        if reason is not None:
            raise KernelUnavailable(reason)
        attend = load("prefill_attention").ms_prefill_attention_paged
        width = cfg.num_heads * cfg.head_dim
        self._flash_buffers = {n: torch.empty(rows, width) for n in ("q", "out")}
        self._hidden = torch.empty(0)   # final_hidden: allocated by the first step that asks for it
        self._plan = FlashPlan(attend=ctypes.cast(attend, ctypes.c_void_p).value,
                               q=_ptr(self._flash_buffers["q"]), out=_ptr(self._flash_buffers["out"]))
        self._scratch.flash = ctypes.pointer(self._plan)

    @property
    def max_batch(self) -> int:  # the older name: rows were sequences when every step was a decode
        return self.max_rows

    def supports(self, query_lens: list[int]) -> bool:
        """Whether one step of sequences with these query lengths fits (rows = their sum)."""
        if not query_lens or min(query_lens) < 1 or (self._decode_only and max(query_lens) > 1):
            return False
        return sum(query_lens) <= self.max_rows

    def _ensure_scores(self, rows: int, context: int) -> None:
        # Softmax scratch, one row per (query row, head). It grows with the longest context and
        # the most rows seen, not with the model's maximum length (which may be 128k tokens)
        # times max_rows: a verification step's k + 1 rows need not cost k + 1 times the memory.
        stride = self._scratch.scores_stride
        if stride < context:
            stride = max(context, 2 * stride, 256)
        need = rows * self._model.num_heads * stride
        if stride == self._scratch.scores_stride and self._scores.numel() >= need:
            return
        old_rows = self._scores.numel() // max(1, self._model.num_heads * self._scratch.scores_stride)
        self._scores = torch.empty(max(rows, old_rows) * self._model.num_heads * stride)
        self._scratch.scores, self._scratch.scores_stride = _ptr(self._scores), stride

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                 logits_indices: torch.Tensor, num_threads: int = 0,
                 sequences: FlashSequences | None = None, final_hidden: bool = False) -> torch.Tensor:
        """Rows: tokens [T] at positions [T], block tables [T, n] (one per row, int64) ->
        logits [len(logits_indices), vocab] of the rows ``logits_indices``.

        Rows of one sequence share its table and sit at consecutive positions (see
        :func:`rows_block_tables`); row j at position p attends keys 0..p.
        ``num_threads``: the OpenMP team size of the step's parallel regions (0: PyTorch's current
        thread count); the engine lowers it when other processes take cores (engine/threads.py).
        With ``flash``: ``sequences`` describes the step's sequences for the flash kernel, and
        ``final_hidden`` returns (logits, every row after the final norm [T, hidden]) for
        :meth:`lm_head` (prompt logprobs).
        """
        # Named locals: the C call reads raw pointers, so every tensor must outlive it.
        ids, pos = input_ids.contiguous(), positions.contiguous()
        tables, rows = block_tables.contiguous(), logits_indices.contiguous()
        last_position = self._check(ids, pos, tables, rows)
        if self.flash:
            if sequences is None:
                raise ValueError("a flash FusedDecoder's step needs its FlashSequences")
            sequences.check(ids.shape[0], self._blocks)
            sequences.point(self._plan)
            if final_hidden and self._hidden.numel() == 0:
                self._hidden = torch.empty(self.max_rows, self._model.hidden)
            self._plan.final_hidden = _ptr(self._hidden) if final_hidden else _f32p()
        else:
            self._ensure_scores(ids.shape[0], last_position + 1)
        logits = torch.empty(rows.shape[0], self._model.vocab)
        team = self._lib.ms_decode_step(
            ctypes.byref(self._model), ctypes.byref(self._scratch), _I64(ids.shape[0]),
            _ptr(ids, _i64p), _ptr(pos, _i64p), _ptr(tables, _i64p), _I64(tables.shape[1]),
            _ptr(rows, _i64p), _I64(rows.shape[0]), _ptr(logits), _I64(max(0, int(num_threads))))
        if team == -2:
            raise RuntimeError("ms_decode_step: the flash attention kernel declined a group of sequences")
        if team < 0:  # decode.c's own format check; _bind checked the same before, so a bug here
            raise RuntimeError("ms_decode_step refused the bound weights or KV cache formats")
        self.last_team_size = team
        return (logits, self._hidden[:ids.shape[0]]) if self.flash and final_hidden else logits

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of rows already through the final norm ([rows, hidden] float32, e.g. a flash
        step's ``final_hidden``), by the step's own LM head product (its loops, whose sum for one
        row does not depend on the row count): the same bits as the step's logit rows."""
        x = hidden.contiguous()
        if x.dim() != 2 or x.shape[1] != self._model.hidden or x.dtype != torch.float32:
            raise ValueError(f"hidden rows must be float32 [rows, {self._model.hidden}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        y = torch.empty(x.shape[0], self._model.vocab)
        xs = torch.empty(x.shape[0], x.shape[1] + 1)   # int4's input order or int8 activations
        if x.shape[0]:
            self._lib.ms_weight_matmul(ctypes.byref(self._model.lm_head), _ptr(x), _ptr(xs), _ptr(y),
                                       _I64(x.shape[0]), _I64(x.shape[1]), _I64(self._model.vocab), 0)
        return y

    def step_profile(self, clock: str | None) -> dict[str, float]:
        """Seconds spent per part (``STEP_PARTS``: block weight matmuls, LM head, attention, the
        whole step) by the steps run since the last call, summed; then profile the next steps on
        ``clock``: "wall", "cpu" (the calling thread's CPU time: on a shared host it leaves out
        the time other processes held the core; the whole cost only at ``num_threads=1``) or None
        (off). The sums are per process (decode.c's ms_step_profile): one decoder at a time."""
        if clock not in _PROFILE_CLOCKS:
            raise ValueError(f"clock must be one of {list(_PROFILE_CLOCKS)}, got {clock!r}")
        sums = (ctypes.c_double * len(STEP_PARTS))()
        self._lib.ms_step_profile(ctypes.c_int(_PROFILE_CLOCKS[clock]), sums)
        return dict(zip(STEP_PARTS, sums))

    def _check(self, ids, pos, tables, rows) -> int:
        """Refuse any index C would trust blindly; returns the largest position (scores scratch)."""
        # C trusts every index it is given; a bad one would read or write outside the buffers.
        if any(t.dtype != torch.int64 for t in (ids, pos, tables, rows)):
            raise ValueError("token ids, positions, block tables and logit rows must be int64")
        n = ids.shape[0] if ids.dim() == 1 else -1
        if (not 1 <= n <= self.max_rows or pos.shape != (n,) or tables.dim() != 2
                or tables.shape[0] != n or tables.shape[1] < 1):
            raise ValueError(f"batch of rows must be in [1, {self.max_rows}] with one position and one "
                             f"block table per row, got {tuple(ids.shape)}, {tuple(pos.shape)}, "
                             f"{tuple(tables.shape)}")
        # One aminmax per tensor (each small reduction costs a dispatch, paid every step).
        (id_lo, id_hi), (pos_lo, pos_hi), (t_lo, t_hi) = (
            [int(v) for v in torch.aminmax(t)] for t in (ids, pos, tables))
        if id_lo < 0 or id_hi >= self._model.vocab:
            raise ValueError(f"token ids must be in [0, {self._model.vocab})")
        limit = min(tables.shape[1] * self._model.block_size, self._positions)
        if pos_lo < 0 or pos_hi >= limit:
            raise ValueError(f"positions must be in [0, {limit}), got {pos.tolist()}")
        if t_lo < 0 or t_hi >= self._blocks:
            raise ValueError(f"block ids must be in [0, {self._blocks})")
        # The final norm writes one scratch row per logit row: at most n of them.
        if rows.dim() != 1 or rows.shape[0] > n or (
                rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n)):
            raise ValueError(f"logit rows must be at most {n} indices in [0, {n}), got {rows.tolist()}")
        return pos_hi


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for float32 ``x`` [rows, in] on the CPU through decode.c's dense loops,
    whose sum for one row does not depend on how many rows the call has (oneDNN and MKL pick their
    blocking by the row count: a row's last bits move with its neighbours). Near oneDNN's rate at
    prefill sizes, faster at a few rows (benchmarks in minserve/engine/batch_invariance.py). The
    batch-invariant mode's float32 products (models/layers.py)."""
    lib = load("decode")   # KernelUnavailable propagates: the engine checked at start-up
    x2 = x.reshape(-1, weight.shape[1]).float().contiguous()
    y = torch.empty(x2.shape[0], weight.shape[0])
    if x2.shape[0]:
        lib.ms_matmul(_ptr(weight), _ptr(bias), _ptr(x2), _ptr(y), _I64(x2.shape[0]), _I64(weight.shape[1]),
                      _I64(weight.shape[0]), 0)
    return y.reshape(*x.shape[:-1], weight.shape[0])
