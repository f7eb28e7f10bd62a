"""``quantization="int4-awq"``: activation-aware weight quantization (Lin et al., 2023, AWQ).

The idea: a few input channels of each linear layer carry much larger activations than the rest,
and the weights that meet them matter most. Multiplying such a weight column by ``s > 1`` before
rounding gives it more of the int4 grid, and dividing the input by the same ``s`` keeps the
product: ``x W^T = (x / s)(W s)^T``. Only the rounding changes, in the salient channels' favour.

Recipe, as AutoAWQ runs it, on our layers:

1. Calibrate: run the dense model on a small set of text (``datasets/calibration/awq.jsonl``,
   written for this project) and record, at the input of every linear layer, the per-channel mean
   ``|x|`` (all tokens) and a sample of input rows (for the error below).
2. For each layer, in model order, try ``s = mean|x| ** alpha`` for alpha on a grid over [0, 1]
   (normalized so ``sqrt(max(s) * min(s)) = 1``) and keep the one whose int4 layer output
   ``(X / s) Q(W s)^T`` is closest (squared error) to the dense ``X W^T``. alpha = 0 is ``s = 1``,
   plain int4: the search can only match or beat it on the calibration activations.
3. Fold ``1 / s`` into the op before the layer, so the model has no extra op and every kernel
   (our C kernels, Triton, the fused decode step) reads plain int4 layers and norms:
   q/k/v and gate/up -> the RMSNorm weight before them; down -> the ``up`` rows of gate/up
   (``silu(gate) * up / s``); o -> the ``v`` rows of q/k/v (attention output is a mix of v rows).
   With grouped-query attention several query heads read one v head, so o's scales are tied
   across each group (one scale per kv-head channel); the LM head (when the policy quantizes it)
   -> the final RMSNorm. All folds are exact in real arithmetic: the dense model is unchanged.

The SmolLM2 twist (docs/engine/quantization.md): its fp32 weights are dequantized Q4_1 blocks, so plain int4 g32
reproduces them exactly and any ``s != 1`` can only add error: the search picks alpha = 0 there
(and stops after it). AWQ has loss to recover with larger groups: with g64 it cuts the mean KL from
fp32 from 0.318 to 0.147 (perplexity +34 % -> +15 %; ``minserve eval``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from minserve.models.layers import Linear
from minserve.quant.schemes import DEFAULT_LM_HEAD, Int4Scheme
from minserve.quant.sizes import INT4_DEFAULT_GROUP_SIZE

log = logging.getLogger("minserve")

SEARCH_ROWS = 256  # calibration rows per layer used to score a candidate scale (activations: all)
# Output rows (weight rows) scored per candidate: the scales are per *input* channel, shared by
# every row, so an even sample of a 49152-row LM head ranks the candidates as the whole would.
SEARCH_WEIGHT_ROWS = 8192


def default_calibration_path() -> Path:
    """``datasets/calibration/awq.jsonl`` (in a wheel, ``minserve/datasets/calibration/``)."""
    from minserve.paths import dataset_path
    return dataset_path("calibration", "awq.jsonl")


def load_calibration(source: str | Path | list[str] | None = None) -> list[str]:
    """Texts from a list of strings, a ``.jsonl`` of ``{"text"}`` rows, or a plain text file
    (paragraphs split on blank lines); by default the set that ships with the project."""
    if isinstance(source, (list, tuple)):
        texts = [str(t) for t in source]
    else:
        path = Path(source) if source is not None else default_calibration_path()
        if not path.is_file():
            raise ValueError(f"quantization_config['calibration']: {path} not found (the default set ships "
                             "in datasets/calibration/; pass a path or a list of texts)")
        raw = path.read_text(encoding="utf-8")
        texts = ([json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
                 if path.suffix == ".jsonl" else [p for p in raw.split("\n\n")])
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("quantization_config['calibration'] holds no text")
    return texts


@dataclass
class ActivationStats:
    mean_abs: torch.Tensor   # [in]: mean |x| per input channel over every calibration token
    rows: torch.Tensor       # [n, in]: a sample of input rows, to score candidate scales


@dataclass(frozen=True)
class LayerSearch:
    alpha: float
    plain_error: float   # relative squared output error of plain int4 (s = 1)
    awq_error: float     # ... with the chosen scales (<= plain_error)


@torch.inference_mode()
def record_inputs(model: nn.Module, batches: list[torch.Tensor], names: list[str],
                  max_rows: int = SEARCH_ROWS) -> dict[str, ActivationStats]:
    """Run the model on each batch of token ids (one sequence each) and collect
    :class:`ActivationStats` at the input of each named module (``lm_head``: every row's)."""
    sums, counts, rows = {}, {}, {n: [] for n in names}
    modules = {n: model.get_submodule(n) for n in names}

    def recorder(name, forward):
        def wrapped(x):
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            sums[name] = sums.get(name, 0) + x2.abs().sum(0)
            counts[name] = counts.get(name, 0) + x2.shape[0]
            rows[name].append(x2.cpu())
            # The logits of calibration text are never read: skip the largest matmul of the pass.
            return x[..., :0] if name == "lm_head" else forward(x)
        return wrapped

    for n, m in modules.items():  # the model calls .forward directly: hook the instance attribute
        m.forward = recorder(n, m.forward)
    try:
        for ids in batches:
            _forward(model, ids, all_rows="lm_head" in modules)
    finally:
        for m in modules.values():
            del m.forward
    out = {}
    for n in names:
        x = torch.cat(rows[n])
        pick = torch.linspace(0, x.shape[0] - 1, min(max_rows, x.shape[0])).round().long()
        out[n] = ActivationStats(sums[n] / counts[n], x[pick].contiguous())
    return out


def _forward(model: nn.Module, ids: torch.Tensor, all_rows: bool) -> torch.Tensor:
    """One sequence through a scratch paged KV cache (the engine's attention path); the LM head
    sees every row (``all_rows``: its inputs are recorded) or only the last."""
    from minserve.attention import build_attention_metadata
    cfg, bs, t = model.config, 16, ids.shape[0]
    p = next(model.parameters())
    blocks = -(-t // bs)
    kv = [tuple(torch.zeros(blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype=p.dtype, device=p.device)
                for _ in range(2)) for _ in range(cfg.num_layers)]
    meta = build_attention_metadata([t], [0], [list(range(blocks))], bs, p.device)
    positions = torch.arange(t, device=p.device)
    return model(ids.to(p.device), positions, kv, meta, positions if all_rows else positions[-1:])


def fake_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``dequantize_int4(quantize_int4(w))`` without packing the codes: the same operations in the
    same order as formats.py (so bit for bit the weights a layer would hold), at half the cost,
    which matters when every layer is quantized once per grid point."""
    out, inp = w.shape
    groups = w.float().reshape(out, inp // group_size, group_size)
    mins = groups.amin(dim=2, keepdim=True)
    spread = groups.amax(dim=2, keepdim=True) - mins
    scales = torch.where(spread > 0, spread / 15.0, torch.ones_like(spread))
    q = torch.round((groups - mins) / scales).clamp_(0, 15)
    return (q * scales + mins).reshape(out, inp)


def candidate_scales(mean_abs: torch.Tensor, alpha: float, tie: tuple[int, int] | None = None) -> torch.Tensor:
    """AutoAWQ's ``s = mean|x| ** alpha``, normalized by sqrt(max * min). ``tie = (group, head_dim)``:
    the channels are query heads of ``head_dim``, and each run of ``group`` heads (those reading one
    kv head, GQA) shares one set of scales, their mean."""
    s = mean_abs.float().clamp(min=1e-8).pow(alpha).clamp(min=1e-4)
    if tie is not None:
        group, head_dim = tie
        s = s.reshape(-1, group, head_dim).mean(dim=1, keepdim=True).expand(-1, group, -1).reshape(-1)
    return s / (s.max() * s.min()).sqrt()


def search_scale(stats: ActivationStats, w: torch.Tensor, group_size: int, n_grid: int,
                 tie: tuple[int, int] | None = None) -> tuple[torch.Tensor, LayerSearch]:
    """The scales of the grid point with the least output error on the sampled rows."""
    x = stats.rows.to(w.device, torch.float32)
    w = w.float()
    if w.shape[0] > SEARCH_WEIGHT_ROWS:
        w = w[torch.linspace(0, w.shape[0] - 1, SEARCH_WEIGHT_ROWS, device=w.device).round().long()]
    ref = x @ w.T
    norm = float(ref.pow(2).sum()) or 1.0
    best, errors = None, []
    for alpha in [i / (n_grid - 1) for i in range(n_grid)]:
        s = candidate_scales(stats.mean_abs.to(w.device), alpha, tie)
        err = float(((x / s) @ fake_int4(w * s, group_size).T - ref).pow(2).sum()) / norm
        errors.append(err)
        if best is None or err < best[2]:
            best = (alpha, s, err)
        if err == 0.0:  # plain int4 reproduces the layer (Q4_1-born weights at g32): nothing to gain
            break
    return best[1], LayerSearch(best[0], errors[0], best[2])


class AWQScheme(Int4Scheme):
    """int4 storage after the AWQ search (module docstring). ``report`` holds each layer's search."""

    name = "int4-awq"

    def __init__(self, group_size: int = INT4_DEFAULT_GROUP_SIZE, fallback: bool = False,
                 lm_head: str = DEFAULT_LM_HEAD["int4-awq"], activations: str = "float",
                 calibration=None, max_calibration_tokens: int = 512, n_grid: int = 11):
        super().__init__(group_size, fallback, lm_head, activations)
        for key, v, lo in (("max_calibration_tokens", max_calibration_tokens, 16), ("n_grid", n_grid, 2)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"quantization_config[{key!r}] must be an integer >= {lo}, got {v!r}")
        self.calibration, self.max_tokens, self.n_grid = calibration, max_calibration_tokens, n_grid
        self.report: dict[str, LayerSearch] = {}

    def label(self) -> str:
        src = "default" if self.calibration is None else \
            hashlib.sha256(json.dumps(self.calibration, default=str).encode()).hexdigest()[:12]
        return f"{super().label()} calib={src}:{self.max_tokens} grid={self.n_grid}"

    def prepare(self, model: nn.Module, tokenizer) -> None:
        """Calibrate, search every layer's scales and fold them (the model stays dense here)."""
        if tokenizer is None:
            raise ValueError("int4-awq needs the model's tokenizer to read its calibration text")
        batches = calibration_batches(tokenizer, load_calibration(self.calibration), self.max_tokens)
        plan = self._fold_plan(model)
        stats = record_inputs(model, batches, [name for name, *_ in plan])
        for name, layer, fold, tie in plan:
            g = self.group_size_of(name, layer)
            s, self.report[name] = search_scale(stats[name], layer.weight.detach(), g, self.n_grid, tie)
            _scale_columns(layer, s)
            fold(s)
        plain = sum(r.plain_error for r in self.report.values())
        awq = sum(r.awq_error for r in self.report.values())
        log.info("int4-awq: %d layers calibrated on %d tokens; summed relative output error %.4g "
                 "(plain int4 %.4g)", len(plan), sum(len(b) for b in batches), awq, plain)

    def _fold_plan(self, model: nn.Module) -> list[tuple]:
        """(layer name, layer, fold(s) for the op before it, tie) in model order."""
        cfg, plan = model.config, []
        group = cfg.num_heads // cfg.num_kv_heads
        for i, layer in enumerate(model.layers):
            attn, mlp, p = layer.self_attn, layer.mlp, f"layers.{i}."
            v0 = attn.q_size + attn.kv_size
            tie = (group, attn.head_dim)
            plan += [(p + "self_attn.qkv_proj", attn.qkv_proj, _norm_fold(layer.input_layernorm), None),
                     (p + "self_attn.o_proj", attn.o_proj, _rows_fold(attn.qkv_proj, v0, attn.kv_size, tie), tie),
                     (p + "mlp.gate_up_proj", mlp.gate_up_proj, _norm_fold(layer.post_attention_layernorm), None),
                     (p + "mlp.down_proj", mlp.down_proj, _rows_fold(mlp.gate_up_proj, mlp.inter, mlp.inter), None)]
        if self.head == "quantize":  # an int4 head; an int8 one (the default) is not searched
            plan.append(("lm_head", model.lm_head, _norm_fold(model.norm), None))
        return plan


def calibration_batches(tokenizer, texts: list[str], max_tokens: int) -> list[torch.Tensor]:
    """Each text as one sequence of token ids, cut so all of them hold at most ``max_tokens``."""
    out, left = [], max_tokens
    for text in texts:
        ids = tokenizer.encode(text)[:left]
        if ids:
            out.append(torch.tensor(ids, dtype=torch.long))
            left -= len(ids)
        if left <= 0:
            break
    return out


def _scale_columns(layer: Linear, s: torch.Tensor) -> None:
    # A new Parameter, never an in-place write: a tied LM head shares its tensor with the embedding
    # (which must stay as it is), and checkpoint tensors may be adopted by several modules.
    layer.weight = nn.Parameter(layer.weight.detach() * s.to(layer.weight), requires_grad=False)


def _norm_fold(norm: nn.Module):
    def fold(s: torch.Tensor) -> None:
        norm.weight = nn.Parameter(norm.weight.detach() / s.to(norm.weight), requires_grad=False)
    return fold


def _rows_fold(linear: Linear, first: int, count: int, tie: tuple[int, int] | None = None):
    """Divide output rows [first, first + count) (and their bias) by ``s``. With ``tie = (group,
    head_dim)``, ``s`` is over the *query* heads' channels and the rows are the kv heads': one row
    per kv channel, whose scale every query head of its group shares."""
    def fold(s: torch.Tensor) -> None:
        if tie is not None:
            group, head_dim = tie
            s = s.reshape(-1, group, head_dim)[:, 0].reshape(-1)
        w = linear.weight.detach().clone()
        w[first:first + count] /= s.to(w)[:, None]
        linear.weight = nn.Parameter(w, requires_grad=False)
        if linear.bias is not None:
            b = linear.bias.detach().clone()
            b[first:first + count] /= s.to(b)
            linear.bias = nn.Parameter(b, requires_grad=False)
    return fold


def summed_errors(report: dict[str, LayerSearch]) -> tuple[float, float]:
    """(plain int4, AWQ) relative output errors summed over the layers of a search report."""
    return (math.fsum(r.plain_error for r in report.values()), math.fsum(r.awq_error for r in report.values()))
