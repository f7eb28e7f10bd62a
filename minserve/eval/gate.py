"""The release gate: every weight format measured against fp32 on the shipped data, with thresholds.

A format is named as ``minserve eval --quantization`` takes it: ``fp32`` (or ``none``: no
quantization, the reference), a ``quantization=`` value of the engine (``int8``, ``int4``,
``int4-awq``, ...), optionally followed by ``:key=value`` engine arguments for that row, e.g.
``int4:group_size=128`` or ``fp32:kv_cache_dtype=int8`` (an int8 KV cache over fp32 weights).

Documented thresholds, relative to the fp32 reference measured in the same run (a release gates on
these; ``minserve eval`` exits non-zero when a row misses one):

=============  ==================  ============  =============================
rows           perplexity          mean KL       exact match
=============  ==================  ============  =============================
``int8``       at most +1 %        <= 0.01 nat   at most 3 points below fp32
``int4*``      at most +5 %        <= 0.05 nat   at most 6 points below fp32
KV-only rows   at most +1 %        <= 0.01 nat   at most 3 points below fp32
=============  ==================  ============  =============================

``int4*`` means any other format (``int4`` with any group size, ``int4-awq``): 4-bit weights lose
more, and the row is compared with the loosest documented line rather than passed unchecked.
KV-only rows are fp32 weights with other engine arguments (e.g. an int8 KV cache). Greedy
agreement is reported, not gated by default: one near-tie ends it, whatever the format's quality.
Command-line options override any threshold and add absolute floors (``--min-exact-match``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from minserve.eval.data import Question

if TYPE_CHECKING:   # imported where measured: `minserve eval --help` does not load PyTorch
    from minserve.eval import metrics

REFERENCE_NAMES = ("fp32", "none")


@dataclass(frozen=True)
class Thresholds:
    max_ppl_increase: float | None = None     # relative to fp32: 0.01 = +1 %
    max_mean_kl: float | None = None          # nats per token
    max_em_drop: float | None = None          # accuracy below fp32's: 0.03 = 3 points
    min_exact_match: float | None = None      # absolute accuracy floor (the reference too)
    min_greedy_agreement: float | None = None  # mean first-difference position / length


INT8 = Thresholds(max_ppl_increase=0.01, max_mean_kl=0.01, max_em_drop=0.03)
INT4 = Thresholds(max_ppl_increase=0.05, max_mean_kl=0.05, max_em_drop=0.06)
THRESHOLDS = {"int8": INT8, "int4": INT4, "int4-awq": INT4}


@dataclass(frozen=True)
class FormatSpec:
    label: str                 # as given, e.g. "int4:group_size=128"
    quantization: str | None   # None: fp32 weights
    engine_args: dict = field(default_factory=dict)

    @property
    def is_reference(self) -> bool:
        return self.quantization is None and not self.engine_args


def parse_format(text: str) -> FormatSpec:
    """``NAME[:key=value...]`` -> the engine arguments of that row (values: int, float or str)."""
    name, *pairs = text.strip().split(":")
    if not name:
        raise ValueError(f"empty format in {text!r}")
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"format {text!r}: expected key=value after ':', got {pair!r}")
        args[key] = _value(value)
    quant = None if name.lower() in REFERENCE_NAMES else name
    # A format's own settings (int4:group_size=64) go where the engine takes them: quantization_config.
    from minserve.quant.names import CONFIG_KEYS
    qc = {k: v for k, v in args.items() if k in CONFIG_KEYS.get(quant, ())}
    if qc:
        args = {**{k: v for k, v in args.items() if k not in qc}, "quantization_config": qc}
    return FormatSpec(text.strip(), quant, args)


def _value(text: str):
    if text.lower() in ("true", "false"):   # fused_decode=false, fallback=true
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def thresholds_for(spec: FormatSpec, overrides: Thresholds | None = None) -> Thresholds:
    """The documented thresholds of a row, with every threshold set in ``overrides`` replacing
    the default. The reference gets only absolute floors (relative ones are trivially met)."""
    if spec.is_reference:
        base = Thresholds()
    elif spec.quantization is None:
        base = INT8  # fp32 weights with another KV cache or setting
    else:
        base = THRESHOLDS.get(spec.quantization, INT4)
    if overrides is None:
        return base
    changes = {k: v for k, v in vars(overrides).items() if v is not None}
    if spec.is_reference:
        changes = {k: v for k, v in changes.items() if k in ("min_exact_match", "min_greedy_agreement")}
    return replace(base, **changes)


@dataclass
class FormatResult:
    spec: FormatSpec
    weight_bytes: int | None = None
    perplexity: float | None = None
    mean_kl: float | None = None
    agreement: metrics.Agreement | None = None
    exact_match: metrics.ExactMatch | None = None
    lm_eval: dict = field(default_factory=dict)   # task/metric -> value, when lm-eval ran
    greedy: list[list[int]] | None = field(default=None, repr=False)  # the agreement outputs
    error: str | None = None                       # the format could not be built or run
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.error is None and not self.failures


def check(result: FormatResult, ref: FormatResult, th: Thresholds) -> list[str]:
    """Which thresholds the row misses, in words."""
    if result.error is not None:
        return [f"not evaluated: {result.error}"]
    out = []
    ppl_up = result.perplexity / ref.perplexity - 1
    if th.max_ppl_increase is not None and ppl_up > th.max_ppl_increase:
        out.append(f"perplexity +{ppl_up:.2%} > +{th.max_ppl_increase:.2%}")
    if th.max_mean_kl is not None and result.mean_kl > th.max_mean_kl:
        out.append(f"mean KL {result.mean_kl:.4f} > {th.max_mean_kl}")
    drop = ref.exact_match.accuracy - result.exact_match.accuracy
    if th.max_em_drop is not None and drop > th.max_em_drop + 1e-12:
        out.append(f"exact match {drop:.1%} below fp32 > {th.max_em_drop:.1%}")
    if th.min_exact_match is not None and result.exact_match.accuracy < th.min_exact_match:
        out.append(f"exact match {result.exact_match.accuracy:.1%} < {th.min_exact_match:.1%}")
    agree = result.agreement.mean_fraction
    if th.min_greedy_agreement is not None and agree < th.min_greedy_agreement:
        out.append(f"greedy agreement {agree:.1%} < {th.min_greedy_agreement:.1%}")
    return out


@dataclass
class EvalData:
    texts: list[str]
    questions: list[Question]
    agreement_lengths: tuple[int, ...] = (16, 48)
    agreement_tokens: int = 32


def measure(spec: FormatSpec, llm, data: EvalData, ref_llm=None, ref_greedy=None) -> FormatResult:
    """Every metric of one engine; KL and agreement against the reference engine's (0 / full
    for the reference itself)."""
    from minserve.eval import metrics
    r = FormatResult(spec)
    r.weight_bytes = llm.llm_engine.runner.weight_bytes()
    r.perplexity = metrics.perplexity(llm, data.texts).value
    prompts = metrics.agreement_prompts(llm.get_tokenizer(), data.texts, data.agreement_lengths)
    greedy = metrics.greedy_tokens(llm, prompts, data.agreement_tokens)
    r.agreement = metrics.greedy_agreement(ref_greedy if ref_greedy is not None else greedy, greedy)
    r.mean_kl = 0.0 if ref_llm is None else metrics.mean_kl(ref_llm, llm, data.texts)
    r.exact_match = metrics.exact_match(llm, data.questions)
    r.greedy = greedy
    return r


def run_gate(model: str, specs: list[FormatSpec], data: EvalData, engine_args: dict,
             overrides: Thresholds | None = None, lm_eval_fn=None) -> list[FormatResult]:
    """Evaluate fp32 first (always: it is the reference), then every other row, one engine at a
    time beside the reference's; ``lm_eval_fn(llm) -> dict`` adds lm-eval's numbers to a row."""
    from minserve import LLM
    rows = [s for s in specs if not s.is_reference]
    ref_spec = next((s for s in specs if s.is_reference), FormatSpec("fp32", None))
    ref_llm = LLM(model, **engine_args)
    ref = measure(ref_spec, ref_llm, data)
    ref.lm_eval = lm_eval_fn(ref_llm) if lm_eval_fn else {}
    results = [ref]
    for spec in rows:
        try:
            # A row's own arguments win over the shared ones (fp32:max_num_seqs=8 beside --max-num-seqs).
            llm = LLM(model, **{**engine_args, **spec.engine_args,
                                **({"quantization": spec.quantization} if spec.quantization else {})})
        except (ValueError, TypeError) as e:  # a format this engine does not know (yet)
            results.append(FormatResult(spec, error=f"{type(e).__name__}: {e}"))
            continue
        r = measure(spec, llm, data, ref_llm, ref.greedy)
        r.lm_eval = lm_eval_fn(llm) if lm_eval_fn else {}
        results.append(r)
        del llm
        gc.collect()  # one quantized engine at a time beside the reference
    for r in results:
        r.failures = check(r, ref, thresholds_for(r.spec, overrides))
    return results

