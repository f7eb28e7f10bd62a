"""The parts of a workload file: length distributions, shared prefixes, SLOs, the prompt body.

Each part parses its own JSON object and names the file and the field in any error, so a typo in a
workload file is one clear message at load time, not a strange run (:mod:`minserve.bench.workloads`
loads the whole file; ``datasets/README.md`` documents the fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2el_ms": "e2el"}  # -> bench goodput keys
PRIORITY_CLASSES = ("interactive", "batch")     # minserve serve's admission classes, most urgent first


class WorkloadError(ValueError):
    """A workload file that cannot be used: the message names the file and the field."""


def need_field(doc: dict, key: str, where: str):
    if key not in doc:
        raise WorkloadError(f"{where}: missing field {key!r}")
    return doc[key]


@dataclass(frozen=True)
class Lengths:
    """A token-count distribution. ``lognormal``: ``round(median * exp(sigma * z))``, z ~ N(0, 1),
    clipped to [min, max]; ``uniform``: integers in [min, max], both included; ``constant``."""
    dist: str
    min: int
    max: int
    median: float = 0.0
    sigma: float = 0.0

    @classmethod
    def parse(cls, d: dict, where: str) -> "Lengths":
        dist = need_field(d, "dist", where)
        if dist == "constant":
            v = int(need_field(d, "value", where))
            out = cls("constant", v, v)
        elif dist == "uniform":
            out = cls("uniform", int(need_field(d, "min", where)), int(need_field(d, "max", where)))
        elif dist == "lognormal":
            out = cls("lognormal", int(need_field(d, "min", where)), int(need_field(d, "max", where)),
                      float(need_field(d, "median", where)), float(need_field(d, "sigma", where)))
            if not (out.median > 0 and out.sigma >= 0):
                raise WorkloadError(f"{where}: lognormal needs median > 0 and sigma >= 0")
        else:
            raise WorkloadError(f"{where}.dist must be one of lognormal, uniform, constant; got {dist!r}")
        if not 1 <= out.min <= out.max:
            raise WorkloadError(f"{where}: needs 1 <= min <= max, got min {out.min}, max {out.max}")
        return out

    def bounds(self, scale: float) -> tuple[int, int]:
        lo = max(1, round(self.min * scale))
        return lo, max(lo, round(self.max * scale))

    def sample(self, rng: np.random.Generator, scale: float = 1.0) -> int:
        lo, hi = self.bounds(scale)
        if self.dist == "uniform":
            return int(rng.integers(lo, hi + 1))
        if self.dist == "constant":
            return lo
        value = round(self.median * scale * math.exp(self.sigma * rng.standard_normal()))
        return int(min(max(value, lo), hi))


@dataclass(frozen=True)
class SharedPrefix:
    """``count`` distinct prefixes of ``tokens`` tokens (a header from section ``headers``, then
    text of section ``fill``); a share ``reuse_share`` of requests starts with one of them, the
    others with a prefix of the same length made unique (so they cannot hit the prefix cache)."""
    count: int
    tokens: int
    reuse_share: float
    headers: str
    fill: str

    @classmethod
    def parse(cls, d: dict | None, where: str) -> "SharedPrefix | None":
        if not d:
            return None
        out = cls(int(need_field(d, "count", where)), int(need_field(d, "tokens", where)),
                  float(need_field(d, "reuse_share", where)), need_field(d, "headers", where), need_field(d, "fill", where))
        if out.count < 1 or out.tokens < 1 or not 0 <= out.reuse_share <= 1:
            raise WorkloadError(f"{where}: needs count >= 1, tokens >= 1, reuse_share in [0, 1]")
        return out


@dataclass(frozen=True)
class SLO:
    """Per-request objectives in milliseconds (None: not part of this class's objective)."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, d: dict, where: str) -> "SLO":
        unknown = set(d) - set(SLO_KEYS)
        if unknown or not d:
            raise WorkloadError(f"{where}: keys must be some of {sorted(SLO_KEYS)}, got {sorted(d)}")
        if any(not (isinstance(v, (int, float)) and v > 0) for v in d.values()):
            raise WorkloadError(f"{where}: every objective must be a number of ms > 0, got {d}")
        return cls(**{k: float(v) for k, v in d.items()})

    def goodput(self) -> dict[str, float]:
        """In ``minserve bench serve --goodput`` terms: {"ttft": ms, ...}."""
        return {SLO_KEYS[k]: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class Body:
    """The request-specific part of the prompt: ``template`` with ``{passage}`` cut from section
    ``passage`` to hit the drawn length (``passages`` > 1: that many numbered pieces), and the
    other fields picked from a section (``{"pick": name}``) or drawn (``{"int": [lo, hi]}``)."""
    template: str
    passage: str
    fields: dict = field(default_factory=dict)
    passages: int = 1

    @classmethod
    def parse(cls, d: dict, where: str) -> "Body":
        out = cls(need_field(d, "template", where), need_field(d, "passage", where), dict(d.get("fields", {})),
                  int(d.get("passages", 1)))
        if "{passage}" not in out.template or out.passages < 1:
            raise WorkloadError(f"{where}: the template needs a {{passage}} and passages >= 1")
        return out


@dataclass(frozen=True)
class Shape:
    """What the shape stream drew for one request (tokens at the run's length scale)."""
    workload: str
    prefix_index: int | None   # which shared prefix, None when the workload has none
    prefix_reused: bool        # False: a unique prefix of the same length
    prefix_tokens: int
    body_tokens: int
    output_tokens: int
