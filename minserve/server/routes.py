"""Named routes: more than one engine configuration behind one server, and the policy between them.

A route is a name and the engine arguments of one :class:`~minserve.config.EngineConfig` (every
route serves the same model, so one tokenizer prepares every request; they differ in precision,
context length, scheduler or decoding). One route is the default, the approved baseline. The
policy, declared before the server starts (a routes file, or ``--route`` flags), says

- ``canary``: which route is the candidate, the bounded share of traffic it gets, which classes
  and tenants are eligible, and the rollback criteria (canary.py) it must keep;
- ``downgrade``: per priority class, the cheaper routes a request may go to when the baseline
  predicts it would miss its deadline, instead of being rejected (router.py);
- ``explicit_route``: who may name a route with the ``x-minserve-route`` header: ``"admin"``
  (admin API keys only, the default: a tenant must not pick the canary, nor dodge it) or
  ``"anyone"`` (a test bench with no keys).

Routes file (JSON)::

    {"model": "tiny-llama", "default": "stable",
     "routes": {"stable": {}, "int4": {"quantization": "int4"}},
     "canary": {"route": "int4", "share": 0.1, "classes": ["batch"], "seed": 0,
                "criteria": {"min_samples": 20, "max_e2e_p90_ratio": 1.5}},
     "downgrade": {"batch": ["int4"]},
     "explicit_route": "admin"}

Every error names the field and what it may be (``routes.int4.quantizaton: unknown engine
argument; allowed: ...``): a canary that cannot start must say why before any model loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from minserve.config import EngineConfig
from minserve.server.admission import PRIORITY_CLASSES

ROUTE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")  # short: it is a label and a header
ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name != "model")
EXPLICIT_POLICIES = ("admin", "anyone")
TOP_FIELDS = ("model", "default", "routes", "canary", "downgrade", "explicit_route")
CANARY_FIELDS = ("route", "share", "classes", "tenants", "seed", "criteria")


@dataclass(frozen=True)
class CanaryCriteria:
    """Rollback criteria, fixed before the canary starts (canary.py applies them). A ratio is the
    candidate's quantile over the baseline's on the same recent window; None turns a check off."""

    min_samples: int = 20                    # candidate (and baseline) finished requests needed
    window: int = 200                        # recent requests per route the checks look at
    max_ttft_p90_ratio: float | None = 2.0
    max_tpot_p50_ratio: float | None = 1.5
    max_e2e_p90_ratio: float | None = 2.0
    max_failure_rate: float | None = 0.05    # model errors, dependency failures, deadlines missed
    max_bad_answer_increase: float | None = 0.2  # empty or cut-at-max_tokens answers, vs baseline

    def __post_init__(self) -> None:
        for name in ("min_samples", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"canary.criteria.{name}: must be an int >= 1, got {v!r}")
        if self.window < self.min_samples:
            raise ValueError(f"canary.criteria.window: must be >= min_samples ({self.min_samples}), "
                             f"got {self.window}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.startswith("max_") and v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                    raise ValueError(f"canary.criteria.{f.name}: must be a number >= 0 or null, got {v!r}")


@dataclass(frozen=True)
class CanaryPolicy:
    route: str
    share: float = 0.0                       # of eligible requests, in [0, 1]
    classes: tuple[str, ...] = PRIORITY_CLASSES
    tenants: tuple[str, ...] | None = None   # None: every tenant is eligible
    seed: int = 0                            # the share's draws: reproducible runs
    criteria: CanaryCriteria = field(default_factory=CanaryCriteria)


@dataclass(frozen=True)
class RoutesConfig:
    model: str
    routes: dict[str, dict]                  # name -> engine arguments (EngineConfig fields)
    default: str
    canary: CanaryPolicy | None = None
    downgrade: dict[str, tuple[str, ...]] = field(default_factory=dict)  # class -> cheaper routes
    explicit_route: str = "admin"

    def __post_init__(self) -> None:
        if not self.routes:
            raise ValueError("routes: declare at least one route")
        for name in self.routes:
            check_route_name(name, "routes")
        if self.default not in self.routes:
            raise ValueError(f"default: {_bounded(self.default)} is not a route; allowed: {sorted(self.routes)}")
        if self.explicit_route not in EXPLICIT_POLICIES:
            raise ValueError(f"explicit_route: must be one of {list(EXPLICIT_POLICIES)}, "
                             f"got {_bounded(self.explicit_route)}")
        if self.canary is not None:
            self._check_canary(self.canary)
        for cls, names in self.downgrade.items():
            if cls not in PRIORITY_CLASSES:
                raise ValueError(f"downgrade: {_bounded(cls)} is not a priority class; allowed: "
                                 f"{list(PRIORITY_CLASSES)}")
            for name in names:
                if name not in self.routes or name == self.default:
                    raise ValueError(f"downgrade.{cls}: {_bounded(name)} must be a route other than the "
                                     f"default; allowed: {sorted(set(self.routes) - {self.default})}")

    def _check_canary(self, c: CanaryPolicy) -> None:
        if c.route not in self.routes or c.route == self.default:
            raise ValueError(f"canary.route: {_bounded(c.route)} must be a route other than the default; "
                             f"allowed: {sorted(set(self.routes) - {self.default})}")
        if isinstance(c.share, bool) or not isinstance(c.share, (int, float)) or not 0 <= c.share <= 1:
            raise ValueError(f"canary.share: must be a number in [0, 1], got {c.share!r}")
        bad = [x for x in c.classes if x not in PRIORITY_CLASSES]
        if bad or not c.classes:
            raise ValueError(f"canary.classes: must be a non-empty list of {list(PRIORITY_CLASSES)}, "
                             f"got {list(c.classes)!r}"[:300])


def _bounded(value, n: int = 64) -> str:
    """A user's value in an error message, cut short: a 10 MB route name must not be echoed."""
    text = repr(value)
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"


def check_route_name(name, where: str) -> str:
    if not isinstance(name, str) or not ROUTE_NAME.fullmatch(name):
        raise ValueError(f"{where}: route name {_bounded(name)} must be 1-32 characters of letters, "
                         "digits, '_', '.', '-', starting with a letter or digit")
    return name


def _engine_args(name: str, args) -> dict:
    if not isinstance(args, dict):
        raise ValueError(f"routes.{name}: must be an object of engine arguments, got {_bounded(args)}")
    unknown = sorted(set(args) - set(ENGINE_FIELDS))
    if unknown:
        raise ValueError(f"routes.{name}.{unknown[0][:64]}: unknown engine argument; allowed: "
                         f"{list(ENGINE_FIELDS)}")
    return dict(args)


def _only(d: dict, allowed: tuple[str, ...], where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: must be a JSON object, got {_bounded(d)}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ValueError(f"{where}.{str(unknown[0])[:64]}: unknown field; allowed: {list(allowed)}")


def canary_criteria(d) -> CanaryCriteria:
    """CanaryCriteria from a JSON object (the routes file's, or POST /routes/canary/start's)."""
    _only(d, tuple(f.name for f in fields(CanaryCriteria)), "canary.criteria")
    return CanaryCriteria(**d)


def _canary(d: dict) -> CanaryPolicy:
    _only(d, CANARY_FIELDS, "canary")
    if "route" not in d:
        raise ValueError("canary.route: required (the candidate route's name)")
    tenants = d.get("tenants")
    if tenants is not None and (not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants)):
        raise ValueError(f"canary.tenants: must be a list of tenant names or null, got {_bounded(tenants)}")
    classes = d.get("classes", list(PRIORITY_CLASSES))
    if not isinstance(classes, list):
        raise ValueError(f"canary.classes: must be a list of {list(PRIORITY_CLASSES)}, got {_bounded(classes)}")
    seed = d.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"canary.seed: must be an integer, got {_bounded(seed)}")
    return CanaryPolicy(d["route"], d.get("share", 0.0), tuple(classes),
                        None if tenants is None else tuple(tenants), seed,
                        canary_criteria(d.get("criteria", {})))


def routes_config(d: dict, model: str | None = None) -> RoutesConfig:
    """A RoutesConfig from the routes file's JSON object (``model`` overrides the file's)."""
    _only(d, TOP_FIELDS, "routes file")
    routes = d.get("routes")
    if not isinstance(routes, dict) or not routes:
        raise ValueError("routes: must be a non-empty object mapping route names to engine arguments")
    engine = {check_route_name(name, "routes"): _engine_args(name, args) for name, args in routes.items()}
    downgrade = d.get("downgrade", {})
    _only(downgrade, PRIORITY_CLASSES, "downgrade")
    for cls, names in downgrade.items():
        if not isinstance(names, list):
            raise ValueError(f"downgrade.{cls}: must be a list of route names, got {_bounded(names)}")
    model = model or d.get("model") or EngineConfig.model
    return RoutesConfig(model, engine, d.get("default", next(iter(engine))),
                        _canary(d["canary"]) if "canary" in d else None,
                        {c: tuple(v) for c, v in downgrade.items()}, d.get("explicit_route", "admin"))


def load_routes_file(path: str | Path, model: str | None = None) -> RoutesConfig:
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--routes: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--routes: {path} is not JSON: {e}") from None
    return routes_config(d, model)


def parse_route_flag(text: str) -> tuple[str, dict]:
    """``--route NAME`` or ``--route NAME:KEY=VALUE,...``: values are JSON when they parse (numbers,
    true/false, null), else strings; keys may be spelt with dashes as on the command line."""
    name, _, rest = text.partition(":")
    check_route_name(name, "--route")
    args = {}
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"--route {name}: {_bounded(item)} must be KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        args[key.strip().replace("-", "_")] = value
    return name, _engine_args(name, args)
