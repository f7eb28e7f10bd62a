"""Names a package re-exports, imported on first use (PEP 562).

``minserve``, ``minserve.eval``, ``minserve.models``, ``minserve.quant`` and ``minserve.server``
re-export public names from the modules that define them; importing those modules eagerly would
load PyTorch (seconds and hundreds of MB) for every ``minserve --help`` or ``minserve serve
--help``, ``minserve bench`` against a vLLM server, or anything that only reads a dataset path. A package lists ``{name: home module}`` and hands this module's two functions to
Python::

    __getattr__, __dir__ = lazy.exports(globals(), {"LLM": "minserve.engine.llm", ...})

``from minserve import LLM`` then imports ``minserve.engine.llm`` at that moment, as an eager import
would have, and caches the value in the package so later lookups are plain attribute reads.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def exports(namespace: dict[str, Any], homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__`` for the names in ``homes``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value   # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
