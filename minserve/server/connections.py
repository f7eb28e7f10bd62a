"""The connection layer: what a client may hold before it has sent a request (issue 20, items 4, 7, 8).

uvicorn gives an idle kept-alive connection ``timeout_keep_alive`` seconds, but nothing bounds the
time a client takes to send a request head or body, and its ``limit_concurrency`` is checked only
once a head is complete. A "slowloris" client that sends a head one byte at a time therefore holds
a file descriptor forever; ~21 k of them used up the 20 000 fds of the process, after which every
accept() failed with EMFILE: /health timed out and the log grew by millions of lines.

Three defences, all below the app, in the uvicorn protocol that :func:`protocol_class` builds:

1. **A deadline for the head and for the body.** A connection must deliver a complete request head
   within ``header_timeout_s`` (from its accept, or from the previous response on a kept-alive
   connection), and the body within ``body_timeout_s`` of its head; else it is closed. Both are
   total deadlines, not idle timeouts: a byte every few seconds would reset an idle timer forever.
2. **A connection limit below the fd limit.** ``max_connections`` (default: RLIMIT_NOFILE less some
   headroom for model files, the event loop and an accept burst) is counted at accept. At the
   limit the newcomer is *not* refused: the oldest connection still waiting for its request head is
   closed instead. An attacker's sockets are exactly those, so a real client (whose head arrives
   within a millisecond of connecting) gets in, and /health keeps answering. Only when every
   connection has a request in progress is the newcomer refused, with a 503 and Connection: close.
   Accept bursts are kept small (:func:`accept_backlog`), so that they fit in the spare fds and
   cannot evict a client whose head has arrived but not yet been read.
3. **Rate-limited logs** (:class:`RateLimitFilter`): a flood of identical error lines is cut to a
   few per interval plus a count, so the disk does not fill with "Too many open files".

And :class:`ConnectionCloseMiddleware` adds ``Connection: close`` where the connection must not be
reused: after a 5xx that means the request broke (500, not the 503 of admission control), and
after a request that framed its body twice (Content-Length and Transfer-Encoding, RFC 9112 6.3).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("minserve.server.connections")

# Deadlines that a real client on a slow link still meets: nginx's client_header_timeout and
# client_body_timeout are 60 s each, but they are idle timeouts; ours are totals, and a request
# head is a few hundred bytes. A 4 MiB body (the default body limit) at 1 Mbit/s needs ~34 s.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_S = 5.0  # uvicorn's and vLLM's default


def nofile_limit() -> int:
    """The soft RLIMIT_NOFILE: how many fds this process may hold open."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return 65536 if soft == resource.RLIM_INFINITY else soft
    except (ImportError, OSError, ValueError):  # not a POSIX system: a modest guess
        return 1024


def default_max_connections(nofile: int | None = None) -> int:
    """Open connections that still leave fds for the rest of the process: the soft RLIMIT_NOFILE
    less a quarter of it, at least 128 and at most 1024 fds (the event loop's own fds, files the
    engine opens, and the sockets of accept bursts in flight: see :func:`accept_backlog`)."""
    nofile = nofile_limit() if nofile is None else nofile
    return max(16, nofile - min(1024, max(128, nofile // 4)))


def accept_backlog(max_connections: int, nofile: int | None = None) -> int:
    """The backlog to give uvicorn (its default is 2048; :func:`widen_listen_queue` restores the
    kernel's queue). asyncio accepts up to that many sockets in one go, before the protocol of
    any of them runs, so before any is counted:

    - the burst must fit in the fds that ``max_connections`` leaves free, or accept() fails with
      EMFILE after all (and asyncio stops accepting for a second); and not one burst: a socket is
      counted a loop iteration or two after its accept, an evicted one frees its fd an iteration
      after its close, so two or three bursts' worth of fds are in flight at once;
    - the burst must be well below ``max_connections``: each accepted socket may evict the oldest
      connection still waiting for its head, and a burst as large as the limit would evict a real
      client whose head has arrived but not yet been read (a loop iteration later).

    So a quarter of the smaller of the limit and the free fds, 16 to 2048."""
    nofile = nofile_limit() if nofile is None else nofile
    return min(2048, max(16, min(max_connections, nofile - max_connections) // 4))


LISTEN_QUEUE = 2048  # uvicorn's default backlog: the kernel's queue of connections not yet accepted


def widen_listen_queue(servers) -> None:
    """Give the kernel's accept queue LISTEN_QUEUE places again, after uvicorn has started with
    :func:`accept_backlog`. asyncio uses one number for both the listen() queue and its accept
    burst; the burst must be small, but a small queue drops the SYNs of real clients when it
    fills (they retry after a second). Calling listen() again on a listening socket only
    changes its queue length (Linux and the BSDs)."""
    for server in servers:
        for ts in server.sockets:  # asyncio's TransportSocket has no listen(): a dup has
            with socket.socket(fileno=socket.dup(ts.fileno())) as sock:
                sock.listen(LISTEN_QUEUE)


@dataclass(frozen=True)
class ConnectionLimits:
    """The connection-layer flags of ``minserve serve`` (docs/serving/admission.md)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    timeout_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_connections: int = field(default_factory=default_max_connections)

    def __post_init__(self) -> None:
        for name, flag in (("header_timeout_s", "--header-timeout"), ("body_timeout_s", "--body-timeout"),
                           ("timeout_keep_alive_s", "--timeout-keep-alive")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} ({flag}) must be a number of seconds > 0, got {v!r}")
        v = self.max_connections
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"max_connections (--max-connections) must be an int >= 1, got {v!r}")
        if v > nofile_limit() - 64:
            log.warning("--max-connections %d leaves under 64 of this process's %d file descriptors "
                        "(ulimit -n) for anything else: accept() may fail with EMFILE before the "
                        "limit is reached", v, nofile_limit())


class ConnectionGuard:
    """Server-wide bookkeeping shared by all connections of one server: how many are open, and
    which wait for a request head, oldest first (a dict keeps insertion order; a connection moves
    to the end each time it starts waiting again). The counters are for tests."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open = 0
        self.waiting: dict[GuardedH11Protocol, None] = {}
        self.evicted = self.refused = self.header_timeouts = self.body_timeouts = 0

    def counts(self) -> dict:
        return {"open": self.open, "waiting_for_head": len(self.waiting), "evicted": self.evicted,
                "refused": self.refused, "header_timeouts": self.header_timeouts,
                "body_timeouts": self.body_timeouts}


_REFUSAL_BODY = b"too many connections with requests in progress; retry later\n"
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
           b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSAL_BODY), _REFUSAL_BODY))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the deadlines and the connection limit of the module docstring.
    The state it watches is h11's view of the client: ``their_state`` IDLE means no complete
    request head yet, SEND_BODY a body being read, anything else a request being answered (no
    deadline then: a long generation is the app's business, not the connection layer's)."""

    guard: ConnectionGuard  # set on the subclass that protocol_class() makes, one per server

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for = ""  # "head", "body" or "" (no deadline running)
        self._counted = False

    # asyncio.Protocol interface

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        g = self.guard
        g.open += 1
        self._counted = True
        if g.open > g.limits.max_connections and not self._evict_one():
            g.refused += 1
            log.warning("connection limit of %d reached and every connection has a request in "
                        "progress: refusing a new one with 503", g.limits.max_connections)
            transport.write(REFUSAL)
            self._close()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next cycle on a kept-alive connection
        self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        super().connection_lost(exc)

    # the deadlines

    def _follow_state(self) -> None:
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._waiting_for != "head":  # a new request cycle on a kept-alive connection
                self._await_head()
        elif state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self.guard.waiting.pop(self, None)
                self._arm("body", self.guard.limits.body_timeout_s)
        else:
            self.guard.waiting.pop(self, None)
            self._disarm()

    def _await_head(self) -> None:
        self.guard.waiting.pop(self, None)
        self.guard.waiting[self] = None  # to the end: the newest waiter
        self._arm("head", self.guard.limits.header_timeout_s)

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._waiting_for = what
        self._deadline = self.loop.call_later(seconds, self._deadline_passed, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, ""

    def _deadline_passed(self, what: str) -> None:
        self._deadline = None
        g = self.guard
        if what == "head":
            g.header_timeouts += 1
            log.warning("closing a connection whose request head did not arrive within %g s "
                        "(--header-timeout)", g.limits.header_timeout_s)
        else:
            g.body_timeouts += 1
            log.warning("closing a connection whose request body did not arrive within %g s "
                        "(--body-timeout)", g.limits.body_timeout_s)
        # Nothing is written: the client is either an attacker or too slow to read it. A request
        # already handed to the app sees http.disconnect, as if the client had left.
        self._close()

    # the limit

    def _evict_one(self) -> bool:
        """Close the oldest connection still waiting for a request head (not this one)."""
        for victim in self.guard.waiting:
            if victim is not self:
                break
        else:
            return False
        self.guard.evicted += 1
        log.warning("connection limit of %d reached: closing the oldest connection that has not "
                    "sent a complete request head (--max-connections)", self.guard.limits.max_connections)
        victim._close()
        return True

    def _close(self) -> None:
        # The fd is freed only in connection_lost, a loop iteration later; count it free now, so a
        # burst of accepts in this iteration does not evict more connections than it needs to.
        self._release()
        if not self.transport.is_closing():
            self.transport.close()

    def _release(self) -> None:
        self._disarm()
        self.guard.waiting.pop(self, None)
        if self._counted:
            self._counted = False
            self.guard.open -= 1


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with its own server-wide guard (uvicorn
    makes one protocol object per connection from it)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": ConnectionGuard(limits)})


# Connection: close where the connection must not be reused


CLOSE = (b"connection", b"close")
# 503 (admission, draining) and 504 (deadline) are answers of a healthy server: the connection
# is fine for the retry. Other 5xx say this request broke somewhere; start the next one afresh.
KEEP_ALIVE_5XX = frozenset({503, 504})


class ConnectionCloseMiddleware:
    """Pure ASGI: adds ``connection: close`` to a response that must end its connection.

    It has to wrap the whole FastAPI app, outside Starlette's ServerErrorMiddleware: that is where
    the catch-all Exception handler's 500 is sent from, past any middleware added with
    ``app.add_middleware``. Without the header, uvicorn sent the 500 as keep-alive and then closed
    the socket anyway (ServerErrorMiddleware re-raises; uvicorn closes after an app exception), so
    a client that reused the connection at once got ECONNRESET. With it, h11 knows the connection
    must close, uvicorn closes it cleanly after the body, and the client does not reuse it.

    A request with both Content-Length and Transfer-Encoding is closed after its response as
    RFC 9112 6.3 asks: the two framings may have been read differently by a proxy in front (the
    request-smuggling pattern), so nothing more on that connection can be trusted."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = {name for name, _ in scope["headers"]}
        double_framed = b"content-length" in names and b"transfer-encoding" in names
        sent = {"status": None, "done": False}

        async def close_if_needed(message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = status = message["status"]
                if double_framed or (status >= 500 and status not in KEEP_ALIVE_5XX):
                    headers = [(k, v) for k, v in message.get("headers", [])
                               if k.lower() != b"connection"]
                    message = {**message, "headers": headers + [CLOSE]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, close_if_needed)
        except Exception:
            # ServerErrorMiddleware re-raises after its handler has answered (and the app's
            # handler has logged the traceback): uvicorn would log the same traceback again.
            if sent["done"] and sent["status"] is not None and sent["status"] >= 500:
                return
            raise


# Rate-limited logs


class RateLimitFilter(logging.Filter):
    """A handler filter: at most ``burst`` records per ``interval_s`` from one call site with one
    message shape (digits blanked, so "fd=17" and "fd=18" are the same line), for records at
    ``level`` or above; lower levels (the access log) pass untouched. When it starts dropping it
    says so in one line; the first line of any kind after the interval is preceded by one
    "suppressed K similar lines" line per such kind (a filter has no timer of its own). Keys are bounded (oldest forgotten), so unique messages
    cannot grow it without limit."""

    def __init__(self, handler: logging.Handler, burst: int = 10, interval_s: float = 10.0,
                 level: int = logging.WARNING, max_keys: int = 1024, clock=time.monotonic):
        super().__init__()
        self.handler, self.burst, self.interval_s, self.level = handler, burst, interval_s, level
        self.max_keys, self.clock = max_keys, clock
        # key -> [window start, lines passed, lines suppressed, the window's first record]
        self.windows: dict[tuple, list] = {}
        self.pending: dict[tuple, list] = {}  # the windows with a count still to report

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level or getattr(record, "rate_limit_note", False):
            return True
        text = record.msg if isinstance(record.msg, str) else repr(record.msg)
        shape = re.sub(r"\d+", "#", text.split("\n", 1)[0][:120])
        key = (record.name, record.levelno, record.pathname, record.lineno, shape)
        now = self.clock()
        if self.pending:  # counts of finished intervals: reported by the next line of any kind
            self._report(now)
        w = self.windows.pop(key, None)  # popped and put back: most recently used last
        if w is None or now - w[0] >= self.interval_s:
            w = [now, 0, 0, record]
        self.windows[key] = w
        if len(self.windows) > self.max_keys:
            del self.windows[next(iter(self.windows))]
        if w[1] < self.burst:
            w[1] += 1
            return True
        if w[2] == 0:
            self._note(record, "more than %d log lines like the last one in %g s: suppressing "
                       "them for the rest of the interval (a count follows)", self.burst, self.interval_s)
            self.pending[key] = w
        w[2] += 1
        return False

    def _report(self, now: float) -> None:
        for key, w in list(self.pending.items()):
            if now - w[0] >= self.interval_s:
                del self.pending[key]
                first = w[3].getMessage().split("\n", 1)[0]
                self._note(w[3], "suppressed %d log lines like this one in the last %.0f s: %s",
                           w[2], now - w[0], first[:200])

    def _note(self, like: logging.LogRecord, msg: str, *args) -> None:
        note = logging.LogRecord(like.name, like.levelno, like.pathname, like.lineno, msg, args, None)
        note.rate_limit_note = True
        # Handler.handle calls filters before it takes the handler's lock: safe from in here.
        self.handler.handle(note)


def install_log_rate_limit(**kw) -> list[RateLimitFilter]:
    """A RateLimitFilter on every handler of every logger set up so far (root's from basicConfig,
    uvicorn's, minserve's own), once each. On handlers, not loggers: a handler's filters see the
    records propagated from child loggers (asyncio's accept errors reach root's handler), a
    logger's filters would not. Call after uvicorn.Config, which sets up uvicorn's handlers."""
    added = []
    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for h in logger.handlers:
            if not any(isinstance(f, RateLimitFilter) for f in h.filters):
                f = RateLimitFilter(h, **kw)
                h.addFilter(f)
                added.append(f)
    return added
