"""What a lab runs against: the engine in this notebook (the default), or a server over HTTP.

A learner on a workshop box sets the target once, and every lab runs top to bottom against it::

    export MINSERVE_LAB_TARGET=http://box:8000     # a shared `minserve serve`, or vLLM
    export MINSERVE_LAB_API_KEY=sk-...             # sent as `Authorization: Bearer`, if it has keys

or in the first cell, ``lab.setup(target="http://box:8000", api_key="sk-...")``. Unset, empty or
``"inprocess"`` means the engine in this notebook. The lab's cells then do not branch:

- :func:`~minserve.lab.session.engine_for` returns a :class:`RemoteLLM` (a tokenizer and the
  server's address, no engine) instead of building an engine; engine arguments a lab asks for are
  the server's to set, and it says so in one line;
- :func:`~minserve.lab.workload.run_workload` given that RemoteLLM (or the target's ``base_url``)
  goes through the bench client with the key, and the live figure polls the server's
  ``/metrics`` (vLLM's names: running / waiting requests, KV usage, prefix-cache queries and hits,
  preemptions);
- a cell that reads what only an engine in this process has (block tables, step records, an
  engine built with other arguments) starts with a marker line::

      # needs the engine: the engine's step records

  Against a server the whole cell is replaced by one printed line ("skipped against http://...
  (in process only): this exercise needs the engine's step records") instead of running and
  failing; in process the marker is an ordinary comment. Inside a cell,
  ``if lab.needs_engine("the engine's block tables"):`` does the same for a part of it.

Why a marker rather than ``if`` blocks: a skipped section's later cells (its plot, its check,
its lesson) use what its first cell computed, so every one of them must be skipped alike, and an
``if`` around each would indent the lab's code for the rare case. The marker costs one line and
says in the cell itself why it cannot run against a server.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

TARGET_ENV = "MINSERVE_LAB_TARGET"
API_KEY_ENV = "MINSERVE_LAB_API_KEY"
IN_PROCESS = "inprocess"
MARKER = re.compile(r"^\s*#\s*needs the engine:\s*(?P<what>.+?)\s*$")


@dataclass(frozen=True)
class Target:
    """``base_url`` None: the engine in this process; else the server's root URL (no ``/v1``, no
    trailing slash). ``api_key``: sent as ``Authorization: Bearer`` to that server (its
    completions and its ``/metrics``)."""

    base_url: str | None = None
    api_key: str | None = None

    @property
    def in_process(self) -> bool:
        return self.base_url is None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def is_for(self, base_url: str | None) -> bool:
        """Whether ``base_url`` is this target's server (so its key goes with the request)."""
        return (self.base_url is not None and base_url is not None
                and _normalize(base_url) == self.base_url)

    def __str__(self) -> str:
        if self.in_process:
            return "the engine in this notebook"
        return f"the server at {self.base_url}" + (" (with an API key)" if self.api_key else "")


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def resolve(target: str | Target | None = None, api_key: str | None = None) -> Target:
    """The target named by ``target`` (a URL, ``"inprocess"``, or a :class:`Target`), else by
    ``$MINSERVE_LAB_TARGET``; the key is ``api_key``, else ``$MINSERVE_LAB_API_KEY``."""
    if isinstance(target, Target):
        return target if api_key is None else Target(target.base_url, api_key)
    name = target if target is not None else os.environ.get(TARGET_ENV, "")
    name = name.strip()
    key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if name.lower() in ("", IN_PROCESS, "in-process", "engine"):
        return Target(None, None)
    if not re.match(r"^https?://[^/\s]+", name):
        raise ValueError(f"target must be 'inprocess' or a server's URL like http://host:8000, got "
                         f"{name!r} (from {'setup(target=...)' if target is not None else '$' + TARGET_ENV})")
    return Target(_normalize(name), key)


_state: dict = {"target": None}


def set_target(target: str | Target | None = None, api_key: str | None = None) -> Target:
    """Resolve and record this notebook's target (what :func:`current` returns from now on)."""
    _state["target"] = resolve(target, api_key)
    return _state["target"]


def current() -> Target:
    """This notebook's target: the one :func:`~minserve.lab.session.setup` recorded, else the
    environment's."""
    return _state["target"] if _state["target"] is not None else resolve()


def headers_for(base_url: str | None) -> dict[str, str] | None:
    """The target's auth header when ``base_url`` is the target's server; None for any other
    server (the caller's own default applies, e.g. ``$OPENAI_API_KEY``)."""
    t = current()
    return t.headers() if t.is_for(base_url) else None


def key_for(base_url: str | None) -> str | None:
    t = current()
    return t.api_key if t.is_for(base_url) else None


def skip_line(what: str, target: Target | None = None) -> str:
    t = target or current()
    return f"skipped against {t.base_url} (in process only): this exercise needs {what}"


def needs_engine(what: str) -> bool:
    """True in process. Against a server: prints the one line saying what is skipped and why, and
    returns False, so ``if lab.needs_engine("the engine's block tables"):`` skips the body."""
    t = current()
    if t.in_process:
        return True
    print(skip_line(what, t))
    return False


def skip_cell(what: str) -> None:
    """What a marked cell runs instead of its body against a server."""
    print(skip_line(what))


def transform_cell(lines: list[str]) -> list[str]:
    """IPython input transformer: a cell whose first non-blank line is ``# needs the engine:
    WHAT`` becomes one printed line when the target is a server; any other cell is unchanged."""
    if current().in_process:
        return lines
    first = next((ln for ln in lines if ln.strip()), "")
    m = MARKER.match(first)
    if not m:
        return lines
    return [f"import minserve.lab.target as _minserve_target; _minserve_target.skip_cell({m['what']!r})\n"]


def install_cell_marker() -> bool:
    """Register :func:`transform_cell` with the running IPython (once); False outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    if ip is None:
        return False
    hooks = ip.input_transformers_cleanup
    if not any(getattr(h, "__name__", "") == "transform_cell" for h in hooks):
        hooks.append(transform_cell)
    return True


class RemoteLLM:
    """What :func:`~minserve.lab.session.engine_for` returns when the target is a server: the
    tokenizer of the preset's model (prompts are cut to exact token counts here, as the server
    will count them: the server must serve the same model) and the server's address. There is no
    engine behind it in this process: ``llm_engine`` says so instead of failing later."""

    def __init__(self, target: Target, model: str, engine_args: dict | None = None):
        self.target, self.model = target, model
        self.base_url, self.api_key = target.base_url, target.api_key
        self.engine_args = dict(engine_args or {})   # what the lab asked for (the server decides)
        self._tokenizer = None

    def get_tokenizer(self):
        if self._tokenizer is None:
            from minserve.models.loader import load_tokenizer, resolve_model_dir
            self._tokenizer = load_tokenizer(resolve_model_dir(self.model))
        return self._tokenizer

    @property
    def llm_engine(self):
        from minserve.lab.workload import EngineRecordsRequired
        raise EngineRecordsRequired(f"the engine at {self.base_url}")

    def __repr__(self) -> str:
        return f"RemoteLLM({self.base_url!r}, tokenizer of {self.model!r})"
