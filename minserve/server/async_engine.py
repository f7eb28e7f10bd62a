"""The engine thread: one loop that owns the LLMEngine, fed by HTTP handlers through a queue.

Why a thread and not ``await`` in the handlers: ``engine.step()`` is a blocking forward pass
(milliseconds to seconds). Run on the event loop, it would freeze every connection, health check
and disconnect detection for that long. So the engine lives on its own thread and is touched by
nothing else: handlers put ``add`` / ``abort`` commands into a thread-safe inbox and get their
outputs back on a per-request ``asyncio.Queue``, filled with ``loop.call_soon_threadsafe`` (the
only safe way to wake an asyncio loop from another thread). Neither side ever waits on the other:
the engine thread never awaits a handler, and a handler never waits for a step to finish.

Failure policy (DESIGN: "nothing lost, clear errors"):
- ``add_request`` raising fails that one request (ValueError -> 400, anything else -> 500).
- a request failing inside a step: the engine fails it alone and lists it, with its reason, in
  ``engine.last_step_failures``; its client gets that reason, the others in the step carry on. The
  status is 400 ``unsatisfiable_constraints`` when the failure is the request's own doing (its
  constraints left no token to sample, ``engine.last_step_client_errors``), 500 otherwise.
- ``step()`` raising: the requests it listed as failed before raising get their own reasons; any
  other request the engine no longer holds (retired in that step, its outputs lost with it) gets
  the step's error; if there is neither (it raised before failing or retiring anyone, e.g. in the
  scheduler), every request the engine holds is aborted and its client told, rather than the same
  step failing forever. The loop goes on.
- a request whose deadline passes before it is done, queued, running or preempted, is aborted (its
  KV blocks are freed at once) and its client gets 504 ``deadline_exceeded`` (admission.py
  predicted it in time; it was not).
- a request the engine no longer holds but whose client never got a final output (nothing should
  do that; the sweep after every step is the guarantee) gets a 500: a stream ends with an error
  event, it never waits forever.
- :meth:`AsyncEngine.fail_all` (the drain timeout ran out, cli.py) aborts everything in flight and
  tells each client why, so streams end with an error event and ``[DONE]``, not a cut.
- anything else escaping the loop marks the engine dead (``/health`` turns 503) and fails every
  request still waiting for output, rather than leaving connections hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from minserve.engine.client import EngineClient
from minserve.engine.threads import release_openmp_pool
from minserve.outputs import RequestOutput

log = logging.getLogger("minserve.server")


class RequestFailed(Exception):
    """Delivered in place of an output: the request ended without a normal finish."""

    def __init__(self, message: str, status: int = 500, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


def _guarded(fn: Callable, *args) -> None:
    """Run an observer callback; its bug must not take the engine loop (and every request) down."""
    try:
        fn(*args)
    except Exception:
        log.exception("callback %r failed", fn)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    on_started: Callable[[], None] | None
    deadline_at: float | None = None                  # time.monotonic(); enforced until it ends
    on_expired: Callable[[], None] | None = None
    started: bool = False

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the client's loop is closed (server shutting down): nobody to tell

    def mark_started(self) -> None:
        if not self.started:
            self.started = True
            if self.on_started is not None:
                _guarded(self.on_started)


@dataclass
class _Add:
    request_id: str
    prompt: object
    params: object
    cache_salt: str | None
    priority: int
    sink: _Sink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    failure: RequestFailed


@dataclass
class _Call:
    fn: Callable
    future: concurrent.futures.Future


def reset_prefix_cache(engine) -> bool:
    """Forget every cached prefix block: ``engine.reset_prefix_cache()`` (vLLM's; it refuses,
    returning False, while any request is unfinished; engine/client.py). A sweep resets between
    runs this way, through :meth:`AsyncEngine.call` on the engine thread."""
    return engine.reset_prefix_cache()


class AsyncEngine:
    """Runs ``engine`` (an :class:`~minserve.engine.client.EngineClient`: add, abort, step and the
    read-only running-work view; nothing else of the engine is read) on a background thread. Observers, called on that thread: ``on_step(stats)``
    after each step that computed something (admission measures step times), ``on_running(work)``
    after each step and when the engine goes idle, with (prompt tokens left to compute, output
    tokens left at most) per running request, seat holders first (admission's deadline model)."""

    def __init__(self, engine: EngineClient, on_step: Callable | None = None, on_running: Callable | None = None):
        self.engine = engine
        self.on_step = on_step
        self.on_running = on_running
        self._deadlines: dict[str, float] = {}  # engine thread only: queued requests' deadlines
        self._idle_published = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sinks: dict[str, _Sink] = {}     # engine thread only
        self._thread: threading.Thread | None = None
        self.error: str | None = None          # why the loop died, if it did

    # ---- called from the HTTP side ------------------------------------------------------------

    def start(self) -> None:
        # The engine was built (and warmed up) on this thread: its OpenMP pool would slow every
        # step on the engine thread (engine/threads.py, release_openmp_pool).
        release_openmp_pool()
        self._thread = threading.Thread(target=self._run, name="minserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def submit(self, request_id: str, prompt, params, *, cache_salt: str | None = None,
               priority: int = 0, on_started: Callable[[], None] | None = None,
               deadline_at: float | None = None,
               on_expired: Callable[[], None] | None = None) -> asyncio.Queue:
        """Queue a request; returns the queue its outputs (RequestOutput or RequestFailed) arrive
        on. Must be called on the event loop that will read the queue. ``on_started`` runs on the
        engine thread when the scheduler first runs the request; if that has not happened by
        ``deadline_at`` (``time.monotonic()``), the request is aborted and ``on_expired`` runs."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), on_started, deadline_at, on_expired)
        if not self.alive:
            reason = self.error or "stopped"
            sink.queue.put_nowait(RequestFailed(f"the engine is not running ({reason})", 503))
            return sink.queue
        self._inbox.put(_Add(request_id, prompt, params, cache_salt, priority, sink))
        self._wake.set()
        return sink.queue

    def abort(self, request_id: str) -> None:
        """Ask for the request to be aborted before the next step (its blocks are freed then)."""
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def fail_all(self, failure: RequestFailed) -> None:
        """Abort every request in flight and deliver ``failure`` to each (before the next step)."""
        self._inbox.put(_FailAll(failure))
        self._wake.set()

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (the engine is touched by
        nothing else); the future holds its result or its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError(f"the engine is not running ({self.error or 'stopped'})"))
            return future
        self._inbox.put(_Call(fn, future))
        self._wake.set()
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still in flight are aborted and their clients told why."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # Clear before draining: a submit that lands after the drain sets the event again,
                # so the wait below cannot sleep through it.
                self._wake.clear()
                self._drain_inbox()
                self._expire()
                if not self.engine.has_unfinished_requests():
                    self._publish_idle()
                    self._wake.wait()
                    continue
                self._step()
                self._publish_work()
        except BaseException as e:  # a bug in the loop itself: fail loudly, never hang clients
            log.exception("engine loop died")
            self.error = f"{type(e).__name__}: {e}"
        finally:
            failure = RequestFailed("the server is shutting down" if self.error is None
                                    else f"the engine loop died: {self.error}", 503)
            self._drain_inbox(refuse=failure)
            self._fail_all(failure)

    def _drain_inbox(self, refuse: RequestFailed | None = None) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and refuse is not None:
                cmd.sink.put(refuse)
            elif isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _FailAll):
                self._fail_all(cmd.failure)
            elif isinstance(cmd, _Call):
                self._run_call(cmd, refuse)
            else:
                self.engine.abort_request(cmd.request_id)
                self._deadlines.pop(cmd.request_id, None)
                sink = self._sinks.pop(cmd.request_id, None)
                if sink is not None:  # whoever reads it (nobody, when its client left) is told
                    sink.put(RequestFailed("the request was aborted", 499, "aborted"))

    def _run_call(self, cmd: _Call, refuse: RequestFailed | None) -> None:
        if refuse is not None:
            cmd.future.set_exception(RuntimeError(refuse.message))
            return
        try:
            cmd.future.set_result(cmd.fn(self.engine))
        except Exception as e:  # the caller gets it; the loop goes on
            cmd.future.set_exception(e)

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    cache_salt=cmd.cache_salt, priority=cmd.priority)
        except ValueError as e:
            cmd.sink.put(RequestFailed(str(e), 400))
        except Exception as e:
            log.exception("add_request failed for %s", cmd.request_id)
            cmd.sink.put(RequestFailed(f"could not queue the request: {type(e).__name__}: {e}"))
        else:
            self._sinks[cmd.request_id] = cmd.sink
            if cmd.sink.deadline_at is not None:
                self._deadlines[cmd.request_id] = cmd.sink.deadline_at

    def _step(self) -> None:
        before = self.engine.last_step_stats  # identity, not len(): the list may become bounded
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_after_raise(f"engine step failed: {type(e).__name__}: {e}")
            return
        self._fail_listed()  # their error outputs find no sink below
        self._mark_started(outputs)
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by its client a moment ago, or failed above
            sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]
                self._deadlines.pop(out.request_id, None)
        for rid in self._orphans():
            log.error("request %s left the engine without a final output", rid)
            self._fail(rid, RequestFailed("the engine ended this request without an answer", 500))
        after = self.engine.last_step_stats
        if self.on_step is not None and after is not None and after is not before:
            _guarded(self.on_step, after)

    def _mark_started(self, outputs: list[RequestOutput]) -> None:
        # Running requests (some are mid-prefill and have no output yet) plus those that finished
        # within their very first step.
        rids = [*self.engine.running_work().running_ids, *(o.request_id for o in outputs)]
        for rid in rids:
            sink = self._sinks.get(rid)
            if sink is not None:
                sink.mark_started()

    def _orphans(self) -> list[str]:
        # A request with n > 1 is held while any sample is unfinished (engine/client.py).
        return [rid for rid in self._sinks if not self.engine.holds_request(rid)]

    def _expire(self) -> None:
        """Abort the requests whose deadline passed, whatever their state: the answer would come
        too late to matter, and the seat, the KV blocks and the steps are better spent on others.
        Checked before every step, so a request overruns its deadline by at most one step."""
        if not self._deadlines:
            return
        now = time.monotonic()
        for rid in [rid for rid, at in self._deadlines.items() if at <= now]:
            del self._deadlines[rid]
            sink = self._sinks.pop(rid, None)
            if sink is None:
                continue  # already ended (finished, aborted by its client)
            self.engine.abort_request(rid)
            where = ("while it ran (or waited, preempted, to run again)" if sink.started
                     else "while it still waited for a seat in the engine")
            # Counted before the client is told: whoever reads the metrics after the 504 sees it.
            if sink.on_expired is not None:
                _guarded(sink.on_expired)
            sink.put(RequestFailed(f"deadline exceeded: the deadline (x-deadline-ms / deadline_ms) "
                                   f"passed {where}, so it was aborted", 504, "deadline_exceeded"))

    def _publish_work(self) -> None:
        """Report the running work to the deadline model (admission.py, deadlines.py)."""
        if self.on_running is None:
            return
        # Running requests, then the preempted ones that wait to recompute (engine/client.py).
        work = list(self.engine.running_work().remaining)
        self._idle_published = not work
        _guarded(self.on_running, work)

    def _publish_idle(self) -> None:
        if self.on_running is not None and not self._idle_published:
            self._idle_published = True
            _guarded(self.on_running, [])

    def _fail(self, rid: str, failure: RequestFailed) -> None:
        self._deadlines.pop(rid, None)
        self._sinks.pop(rid).put(failure)

    def _fail_listed(self) -> None:
        """Tell the clients of the requests the engine failed alone in its last step, each with
        its own reason (``engine.last_step_failures``)."""
        own = getattr(self.engine, "last_step_client_errors", ())
        for rid, why in self.engine.last_step_failures.items():
            if rid in own and rid in self._sinks:  # its own constraints: a client error
                self._fail(rid, RequestFailed(f"the request cannot be completed: {why}", 400,
                                              "unsatisfiable_constraints"))
            elif rid in self._sinks:
                self._fail(rid, RequestFailed(f"the request failed in the engine: {why}", 500))

    def _fail_after_raise(self, message: str) -> None:
        """After ``step()`` raised (module docstring): the failures it listed, then the requests
        it retired without a word, else everything."""
        self._fail_listed()
        gone = self._orphans()
        if not self.engine.last_step_failures and not gone:
            # Nothing recorded, nobody retired (e.g. the scheduler raised): abort everything
            # rather than fail the same step forever.
            gone = list(self._sinks)
            self.engine.abort_request(gone)
        for rid in gone:
            self._fail(rid, RequestFailed(message, 500))

    def _fail_all(self, failure: RequestFailed) -> None:
        try:
            self.engine.abort_request(list(self._sinks))
        except Exception:
            log.exception("abort of every request failed")
        for sink in self._sinks.values():
            sink.put(failure)
        self._sinks.clear()
        self._deadlines.clear()
