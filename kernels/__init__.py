"""Kernels: hand-written compute for the hot paths PyTorch's generic operators serve poorly.

- ``decode``: the fused CPU decode step (C, compiled on first use by ``build``), used by the model
  runner for steps where every sequence adds one token.

This directory is the package ``minserve.kernels`` (pyproject.toml maps it). When a process runs
with the repository's root on ``sys.path`` (``python -m ...`` or ``python -c`` from the checkout),
it is also importable as a top-level ``kernels``, the name of Hugging Face's kernel-hub package,
which transformers (5.25 and later) imports whenever it is installed. Imported under that name,
this file hands the name over to the installed package, or fails as a missing package would.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (minserve's kernels/ is minserve.kernels)",
                                  name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    # The import system returns whatever sys.modules holds under the name once this file has run.
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
