"""Find extension code by name: ``"package.module:Class"``, ``"package.module.Class"``, or entry points.

minserve's extension points (logits processors, scheduling policies, model classes) accept the
class itself or its qualified name, so a flag on the command line (``minserve serve
--logits-processors mypkg.rules:BanTokens``) and a string in a config name code that is imported
only when an engine needs it. Both spellings vLLM accepts are accepted here: the colon form names
the module unambiguously; the dotted form is tried as ``module.attr`` from its last dot.
"""

from __future__ import annotations

import importlib
import importlib.metadata


def is_qualified_name(name: object) -> bool:
    """True for strings shaped like ``pkg.mod:Class`` or ``pkg.mod.Class`` (not bare names)."""
    return isinstance(name, str) and (":" in name or "." in name) and not name.startswith((".", ":"))


def import_qualified(name: str, field: str):
    """The object ``name`` points at; ValueError naming ``field`` when it cannot be imported."""
    if not is_qualified_name(name):
        raise ValueError(f"{field} must be a class or a qualified name like 'package.module:Class', got {name!r}")
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{field} must be 'package.module:Class', got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{field}: cannot import module {module_name!r} of {name!r} ({e})") from e
    obj = module
    for part in attr.split("."):  # "mod:Outer.Inner" reaches a nested class
        if not hasattr(obj, part):
            raise ValueError(f"{field}: module {module_name!r} has no attribute {attr!r} (from {name!r})")
        obj = getattr(obj, part)
    return obj


def load_class(spec, base: type, field: str) -> type:
    """``spec`` (a class, or its qualified name) as a subclass of ``base``, or ValueError."""
    cls = import_qualified(spec, field) if isinstance(spec, str) else spec
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{field}: {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def entry_point_classes(group: str, base: type) -> list[type]:
    """Every class installed under the entry-point ``group`` (e.g. a package's pyproject has
    ``[project.entry-points."minserve.logits_processors"] ban = "mypkg.rules:BanTokens"``),
    sorted by entry-point name so the order does not depend on how site-packages is listed."""
    out = []
    for ep in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - re-raised naming the plugin
            raise ValueError(f"entry point {ep.name!r} of group {group!r} ({ep.value}) failed to load: "
                             f"{type(e).__name__}: {e}") from e
        out.append(load_class(obj, base, f"entry point {ep.name!r} of group {group!r}"))
    return out
