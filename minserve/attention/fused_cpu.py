"""Moved: the fused C step is a step executor now, ``FusedCpuExecutor`` in engine/fused_step.py
(it runs the whole model, so it was never an attention backend). The old names still resolve here
for code that imports them; looked up on first use, so this module imports nothing from the
engine layer above it."""


def __getattr__(name: str):
    if name in ("FusedCpuBackend", "FusedCpuExecutor", "FusedStepMetadata"):
        from minserve.engine import fused_step
        return getattr(fused_step, "FusedCpuExecutor" if name == "FusedCpuBackend" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
