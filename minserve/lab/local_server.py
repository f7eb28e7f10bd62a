"""A ``minserve serve`` inside the notebook: the OpenAI-compatible app on a free local port.

Labs that look at the server side of serving (admission control, deadlines, tenants, API keys)
need a real HTTP server, yet a notebook should not have to start a process in a terminal and
wait for it. :func:`serve` builds the same app the CLI runs, :func:`minserve.server.create_app`,
around the notebook's engine and runs it with uvicorn on a background thread, on a port the
operating system picks (bound before uvicorn starts, so two notebooks never race for one)::

    srv = lab.serve(llm, admission=AdmissionConfig(interactive=ClassLimits(max_queued_requests=4)))
    run = lab.run_workload(base_url=srv.base_url, requests=reqs)    # or any OpenAI client
    srv.stop()

``with lab.serve(llm, ...) as srv:`` stops it at the end of the block.

One engine, one server at a time: the server's engine thread owns the engine while it runs, so
:func:`serve` stops a server still running on the same engine first (re-running a notebook cell
just works), and the notebook must not call ``llm.generate`` while a server holds the engine.
Stopping gives the engine back: requests still in flight are aborted (their clients get 503),
and the admission controller's ``minserve:admission_*`` series leave the engine's Prometheus
registry, so the next server on the same engine, with another admission policy, can register
its own (``create_app`` registers them there, once per app).

uvicorn's access log is off and its own messages are limited to warnings: a lab shows what the
clients saw, not one log line per request.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only: pandas is the lab extra's
    import pandas
_by_engine: dict[int, "LocalServer"] = {}
_lock = threading.Lock()


def _engine_of(target):
    eng = getattr(target, "llm_engine", target)
    if not hasattr(eng, "step") or not hasattr(eng, "add_request"):
        raise ValueError(f"serve() needs an LLM or an LLMEngine, got {type(target).__name__}")
    return eng


def _drop_admission_series(engine) -> None:
    """Take the admission series out of the engine's registry (create_app put them there) so
    another app can be created on this engine. prometheus_client has no "unregister by name",
    so the collectors are found through the registry's name index."""
    registry = getattr(getattr(engine, "metrics", None), "registry", None)
    if registry is None:
        return
    names = getattr(registry, "_names_to_collectors", {})
    collectors = {id(c): c for n, c in list(names.items()) if n.startswith("minserve:admission")}
    for c in collectors.values():
        try:
            registry.unregister(c)
        except KeyError:
            pass


class LocalServer:
    """The app for ``engine`` served on ``127.0.0.1:<port>`` by uvicorn in a daemon thread.

    ``base_url`` (no trailing slash, no ``/v1``), ``app`` (the FastAPI app), ``admission`` (its
    :class:`~minserve.server.admission.AdmissionController`: ``admission.config`` is the policy in
    force, with the engine's ``parallel_slots`` and ``kv_bytes_per_token`` filled in)."""

    def __init__(self, target, *, admission=None, auth=None, limits=None,
                 served_model_name: str | None = None, start_timeout_s: float = 60.0, routes=None):
        from minserve.server import create_app
        # ``routes`` (a RoutesConfig): ``target`` maps each route's name to its LLM or LLMEngine,
        # and the app is the routed one (docs/serving/routes.md); ``engine`` is the default route's.
        engines = None if routes is None else {n: _engine_of(t) for n, t in target.items()}
        self._target, self._engines = target, list(engines.values()) if engines else [_engine_of(target)]
        self.engine = engines[routes.default] if engines else _engine_of(target)
        with _lock:
            old = _by_engine.get(id(self.engine))
        if old is not None:
            old.stop()  # one server per engine: a re-run cell replaces the previous server
        else:
            for engine in self._engines:  # left by a server that never started
                _drop_admission_series(engine)
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine still has unfinished requests; finish or abort them "
                               "before serving it (the server's engine thread must own it alone)")
        if routes is None:
            self.app = create_app(self.engine, served_model_name=served_model_name, admission=admission,
                                  auth=auth, limits=limits)
        else:
            from minserve.server.routed_app import create_routed_app
            self.app = create_routed_app(engines, routes, served_model_name=served_model_name,
                                         admission=admission, auth=auth, limits=limits)
        self.state = self.app.state.minserve
        self.admission = self.state.admission
        self.model_name = self.state.model_name
        self.start_timeout_s = start_timeout_s
        self.router = self.state.router  # None without routes
        self._options = dict(admission=admission, auth=auth, limits=limits, routes=routes,
                             served_model_name=served_model_name, start_timeout_s=start_timeout_s)
        self.base_url: str | None = None
        self._server = self._thread = self._sock = None

    # ---- life ---------------------------------------------------------------------------------

    def start(self, port: int = 0) -> "LocalServer":
        """Serve on ``port`` (0, the default: one the OS picks)."""
        import uvicorn

        from minserve.engine.threads import release_openmp_pool
        if self.running:
            return self
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # 0: the OS picks a free port; held until uvicorn takes it
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on")
        self._server, self._sock = uvicorn.Server(config), sock
        release_openmp_pool()   # this (the notebook's) thread's OpenMP pool would slow the engine thread's steps
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="minserve-lab-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                for engine in self._engines:
                    _drop_admission_series(engine)
                raise RuntimeError("the local server did not start (see the messages above); "
                                   f"waited {self.start_timeout_s:.0f} s")
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with _lock:
            _by_engine[id(self.engine)] = self
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving: requests in flight end with 503, the engine is free again. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the local server at {self.base_url} did not stop within "
                                   f"{timeout_s:.0f} s")
        if self._sock is not None:
            self._sock.close()
        self._thread = self._server = self._sock = None
        for engine in self._engines:
            _drop_admission_series(engine)
        with _lock:
            if _by_engine.get(id(self.engine)) is self:
                del _by_engine[id(self.engine)]

    def restart(self, down_s: float = 0.0, engine=None) -> "LocalServer":
        """What a replica restart looks like to its clients: stop this server (requests in flight
        get 503, new connections are refused), stay down ``down_s`` seconds, then a new server
        with the same policy on the same port (fresh admission state, as after a real restart;
        the engine and its weights stay loaded). ``engine`` (an LLM or LLMEngine): come back on
        that one instead, as a restart with other settings does (e.g. a smaller KV budget).
        Returns the new server."""
        port = int(self.base_url.rsplit(":", 1)[1]) if self.base_url else 0
        self.stop()
        time.sleep(max(0.0, down_s))
        target = (self._target if self.router else self.engine) if engine is None else engine
        return LocalServer(target, **self._options).start(port)

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"serving at {self.base_url}" if self.running else "stopped"
        return f"LocalServer({self.model_name!r}, {state})"

    # ---- what the server saw ------------------------------------------------------------------

    def sample(self, name: str, **labels) -> float:
        """One sample of the engine's registry (what ``/metrics`` shows), 0 when absent, e.g.
        ``srv.sample("minserve:admission_rejected_total", reason="deadline",
        priority_class="interactive")``."""
        v = self.engine.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else float(v)

    def admission_counts(self) -> "pandas.DataFrame":
        """Admitted and shed requests so far, by priority class and reason (a DataFrame)."""
        import pandas as pd
        from minserve.server.admission import PRIORITY_CLASSES, REJECT_REASONS
        rows = []
        for c in PRIORITY_CLASSES:
            row = {"admitted": self.sample("minserve:admission_admitted_total", priority_class=c)}
            for r in REJECT_REASONS:
                row[f"shed: {r}"] = self.sample("minserve:admission_rejected_total", reason=r,
                                                priority_class=c)
            row["expired in queue (504)"] = self.sample("minserve:admission_deadline_expired_total",
                                                        priority_class=c)
            rows.append(pd.Series(row, name=c))
        df = pd.DataFrame(rows).astype(int)
        return df.loc[:, (df != 0).any(axis=0) | (df.columns == "admitted")]


def serve(target, *, admission=None, auth=None, limits=None, served_model_name: str | None = None,
          start_timeout_s: float = 60.0, routes=None) -> LocalServer:
    """Start :func:`minserve.server.create_app` for ``target`` (an ``LLM`` or ``LLMEngine``) on a
    free local port; returns the running :class:`LocalServer`. ``admission``
    (:class:`~minserve.server.AdmissionConfig`), ``auth`` (:class:`~minserve.server.Auth`) and
    ``limits`` are ``create_app``'s. A server still running on the same engine is stopped first.

    ``target`` may be the :class:`~minserve.lab.target.RemoteLLM` a lab gets when its target is a
    server: nothing starts then, and the :class:`SharedServer` returned is that server, with its
    own admission policy, keys and limits (the ones asked for are named once, not applied).
    ``routes`` (a :class:`~minserve.server.routes.RoutesConfig`): ``target`` is then a dict of
    route name -> LLM or LLMEngine, served as named routes (docs/serving/routes.md)."""
    from minserve.lab.target import RemoteLLM
    if isinstance(target, RemoteLLM):   # the lab's target is a server: that server, as it is
        return SharedServer(target, admission=admission, auth=auth, limits=limits)
    return LocalServer(target, admission=admission, auth=auth, limits=limits,
                       served_model_name=served_model_name, start_timeout_s=start_timeout_s,
                       routes=routes).start()


class SharedServer:
    """The lab target's server standing in for a notebook server: same ``base_url`` and
    ``model_name``, ``stop()`` does nothing (it is not ours). ``admission`` is None: the shared
    server's controller lives in its own process."""

    _said: set = set()

    def __init__(self, remote, *, admission=None, auth=None, limits=None):
        self.base_url, self.api_key = remote.base_url, remote.api_key
        self.model_name = remote.model
        self.admission = None
        asked = [n for n, v in (("admission", admission), ("auth", auth), ("limits", limits))
                 if v is not None]
        if asked and (self.base_url, tuple(asked)) not in SharedServer._said:
            SharedServer._said.add((self.base_url, tuple(asked)))
            print(f"{', '.join(asked)}: the shared server at {self.base_url} keeps its own "
                  "(a client cannot set them); requests go to it as it is.")

    def running(self) -> bool:
        return True

    def stop(self, timeout_s: float = 30.0) -> None:
        pass

    def __enter__(self) -> "SharedServer":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __repr__(self) -> str:
        return f"SharedServer({self.base_url}: the lab's target, its own admission policy)"


def stop_all() -> None:
    """Stop every server :func:`serve` started (e.g. before releasing the engine)."""
    with _lock:
        servers = list(_by_engine.values())
    for s in servers:
        s.stop()
