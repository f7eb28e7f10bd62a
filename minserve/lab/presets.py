"""How big a lab's workloads are, and where they run.

Every lab sizes its experiments through one preset, picked by the environment variable
``MINSERVE_LAB_PRESET``:

- ``quick`` (the default): small enough for CI, Binder and a 2-core laptop CPU — each lab runs top
  to bottom in a few minutes with SmolLM2-135M;
- ``full``: the sizes the lab was designed for, meant for a GPU box (or a patient CPU);
- ``smoke``: the fewest points and requests that still run every cell, for checking that a lab
  works against a target before a session (``make test`` runs the labs against vLLM and against
  ``minserve serve`` this way, after it ran each one in ``quick`` in process). Not for learning:
  with so few points a lesson may come out unshown. A lab that gives no smoke size uses its quick
  one.

A lab states its sizes where it uses them, one value per preset, e.g.
``P.pick(quick=[32, 256, 1024], full=[64, 1024, 8192])``: the reader sees both, and the preset
chooses; ``smoke=`` is given only where it saves time. The device follows the engine's own rule
(CUDA when available, else CPU).

``MINSERVE_LAB_CI=1`` (set by ``make test``) marks an unattended run: answer checks that nobody
answered verify the reference solution against this run's measurements instead (see
:mod:`minserve.lab.checks`), and live figures skip their intermediate frames.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

PRESET_ENV = "MINSERVE_LAB_PRESET"
CI_ENV = "MINSERVE_LAB_CI"
PRESETS = ("quick", "full", "smoke")


def is_ci() -> bool:
    """True when ``MINSERVE_LAB_CI`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(CI_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def default_device() -> str:
    """The engine's rule: ``"cuda"`` when PyTorch sees a GPU, else ``"cpu"``."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Preset:
    """Sizes shared by every lab; lab-specific sizes come from :meth:`pick`."""

    name: str
    model: str = "smollm2-135m"
    device: str = "cpu"
    # Engine arguments every lab starts from (a lab overrides what it studies).
    engine_args: dict[str, Any] = field(default_factory=dict)
    live_interval_s: float = 0.5   # how often a live figure redraws

    def pick(self, *, quick: Any, full: Any, smoke: Any = None) -> Any:
        """The value for this preset: ``P.pick(quick=8, full=64)``; ``smoke`` defaults to ``quick``."""
        if self.name == "full":
            return full
        return smoke if self.name == "smoke" and smoke is not None else quick

    def engine_kwargs(self, **overrides) -> dict[str, Any]:
        """``engine_args`` with ``overrides`` on top (None values are dropped)."""
        args = {**self.engine_args, "device": self.device}
        args.update({k: v for k, v in overrides.items() if v is not None})
        return args

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.engine_kwargs().items())
        return f"preset {self.name!r}: model {self.model} on {self.device} ({args})"


def get_preset(name: str | None = None) -> Preset:
    """The preset named ``name``, or by ``MINSERVE_LAB_PRESET`` (default ``quick``)."""
    name = (name or os.environ.get(PRESET_ENV) or "quick").strip().lower()
    if name not in PRESETS:
        raise ValueError(f"{PRESET_ENV} must be one of {', '.join(PRESETS)}, got {name!r}")
    device = default_device()
    if name in ("quick", "smoke"):
        # 256 blocks x 16 tokens = 4096 tokens of KV: plenty for the quick workloads, and small
        # (SmolLM2-135M: ~0.7 MiB per block in fp32, so ~190 MiB) on a laptop.
        engine_args = dict(max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=256)
    else:
        engine_args = dict(max_num_seqs=64, max_num_batched_tokens=2048)
        if device == "cpu":
            engine_args["kv_cache_memory"] = "2GiB"
    return Preset(name=name, device=device, engine_args=engine_args)
