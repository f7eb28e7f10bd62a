"""Issue 20 items 4, 7, 8 at the connection layer (minserve/server/connections.py): slow request
heads are closed and cannot lock out /health, a 500 ends its connection cleanly, a request framed
twice (Content-Length and Transfer-Encoding) ends its connection, and log floods are cut short.
Raw sockets throughout: what is under test is bytes on a connection, below any HTTP client."""

import asyncio
import contextlib
import logging
import resource
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from live_server import live_server

from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app
from minserve.server.cli import connection_limits, make_server, parse_args
from minserve.server.connections import (ConnectionCloseMiddleware, ConnectionLimits, GuardedH11Protocol,
                                         RateLimitFilter, accept_backlog,
                                         default_max_connections)

PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "  # never finished


def tiny_app():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=2, max_num_batched_tokens=128,
                                        num_kv_blocks=64)
    app = create_app(engine)

    async def boom():
        raise RuntimeError("a bug in a handler")

    app.add_api_route("/boom", boom)  # the catch-all Exception handler's 500
    return app


@contextlib.contextmanager
def guarded_server(app, limits: ConnectionLimits):
    """``app`` behind make_server (the protocol `minserve serve` runs), on a free port."""
    srv = make_server(app, "127.0.0.1", 0, drain_timeout_s=0.5, log_level="warning", connections=limits)
    with live_server(app, server=srv) as base:
        yield srv, int(base.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def server():
    """Short deadlines, so the tests wait half a second rather than ten."""
    limits = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, timeout_keep_alive_s=5.0,
                              max_connections=64)
    with guarded_server(tiny_app(), limits) as (srv, port):
        yield srv, port


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One response (Content-Length framed, as every response under test here is)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip().lower()
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        assert chunk, "connection closed inside a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(s: socket.socket) -> bool:
    """True when the server ends the connection (FIN) within the socket's timeout."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_partial_request_head_is_closed_after_the_header_timeout(server):
    srv, port = server
    with connect(port) as s:
        s.sendall(PARTIAL_HEAD)
        t0 = time.monotonic()
        assert closed_by_server(s)  # raises socket.timeout (after 10 s) when nothing closes it
        assert time.monotonic() - t0 >= 0.4  # not before its deadline
    assert srv.connection_guard.header_timeouts >= 1
    # a kept-alive connection gets the deadline again for its next request head
    with connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert read_response(s)[0] == 200
        s.sendall(PARTIAL_HEAD)
        assert closed_by_server(s)


def test_a_slow_body_is_closed_after_the_body_timeout(server):
    _, port = server
    with connect(port) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"prompt\": ")
        assert closed_by_server(s)


def test_b_health_answers_while_slowloris_holds_every_connection():
    limits = ConnectionLimits(header_timeout_s=60.0, max_connections=20)  # no timeout rescues it
    with guarded_server(tiny_app(), limits) as (srv, port):
        attackers = [connect(port) for _ in range(40)]
        try:
            for s in attackers:
                s.sendall(PARTIAL_HEAD)
            for _ in range(3):  # several times: each newcomer gets in by evicting the oldest waiter
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
                assert r.status_code == 200
            g = srv.connection_guard
            assert g.evicted >= 20 and g.refused == 0
            assert g.open <= limits.max_connections
        finally:
            for s in attackers:
                s.close()


def test_at_the_limit_with_every_request_in_progress_a_newcomer_gets_503():
    limits = ConnectionLimits(body_timeout_s=60.0, max_connections=2)
    with guarded_server(tiny_app(), limits) as (srv, port):
        busy = [connect(port) for _ in range(2)]
        try:
            for s in busy:  # heads complete, bodies still arriving: requests in progress
                s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\ncontent-length: 100\r\n\r\n{")
            deadline = time.monotonic() + 10
            while len(srv.connection_guard.waiting) or srv.connection_guard.open < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with connect(port) as s:
                status, headers, _ = read_response(s)
                assert status == 503 and headers.get("connection") == "close"
                assert closed_by_server(s)
            assert srv.connection_guard.refused == 1 and srv.connection_guard.evicted == 0
        finally:
            for s in busy:
                s.close()


def test_b_the_default_limit_keeps_accept_below_the_fd_limit(tmp_path):
    """The issue as reported, scaled down: a process with 256 fds, 400 slowloris sockets. Before,
    accept() failed with EMFILE from ~250 on and /health timed out; the default --max-connections
    (derived from RLIMIT_NOFILE) keeps fds free, so /health answers and no EMFILE is logged."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path / "serve.log"

    def low_fd_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    cmd = [sys.executable, "-m", "minserve.cli", "serve", "tiny-llama", "--port", str(port),
           "--num-kv-blocks", "64", "--header-timeout", "120", "--log-level", "warning"]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=low_fd_limit)
    attackers = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        for _ in range(400):
            s = connect(port)
            s.sendall(PARTIAL_HEAD)
            attackers.append(s)
        time.sleep(0.5)  # let the server accept (and evict) them all
        for _ in range(3):
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        for s in attackers:
            s.close()
        proc.terminate()
        proc.wait(30)
    log_text = log_path.read_text()
    assert "Too many open files" not in log_text and "out of system resource" not in log_text, log_text


def test_c_a_500_closes_its_connection_cleanly(server):
    _, port = server
    with connect(port) as s:
        s.sendall(b"GET /boom HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status, headers, body = read_response(s)
        assert status == 500 and b"internal error" in body
        assert headers.get("connection") == "close"
        assert s.recv(1) == b""  # an orderly close (FIN), not a reset
    with connect(port) as s:  # the server is fine: the next connection is served
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status, headers, _ = read_response(s)
        assert status == 200 and headers.get("connection") != "close"


def test_d_content_length_with_transfer_encoding_closes_the_connection(server):
    _, port = server
    with connect(port) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
                  b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"13\r\n{\"prompt\": \"hello\"}\r\n0\r\n\r\n")
        status, headers, _ = read_response(s)
        assert status == 200
        assert headers.get("connection") == "close"
        assert closed_by_server(s)


def test_503_and_504_keep_the_connection_other_5xx_close_it():
    async def answer(status, request_headers=()):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        sent = []

        async def send(message):
            sent.append(message)

        await ConnectionCloseMiddleware(app)({"type": "http", "headers": list(request_headers)},
                                             None, send)
        return (b"connection", b"close") in sent[0]["headers"]

    assert [asyncio.run(answer(s)) for s in (200, 500, 502, 503, 504)] == [False, True, True, False, False]
    both = [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")]
    assert asyncio.run(answer(200, both))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_e_the_log_filter_suppresses_repeats_and_counts_them():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    clock = Clock()
    handler.addFilter(RateLimitFilter(handler, burst=5, interval_s=10.0, clock=clock))
    logger = logging.getLogger("test.rate_limit")
    logger.propagate, logger.level = False, logging.DEBUG
    logger.addHandler(handler)

    def accept_failed(fd):  # one call site, as a real flood has
        logger.error("accept failed: fd=%d: Too many open files", fd)

    try:
        for fd in range(1000):  # different numbers, the same line
            accept_failed(fd)
        for i in range(20):
            logger.info("access line %d", i)  # below WARNING: never limited
        logger.warning("a different line")
        assert [r.getMessage() for r in records[:5]] == [
            f"accept failed: fd={fd}: Too many open files" for fd in range(5)]
        assert "suppressing" in records[5].getMessage()
        assert len(records) == 6 + 20 + 1
        clock.now = 11.0  # the next window: the count comes first, then the line
        accept_failed(7)
        assert records[-2].getMessage().startswith("suppressed 995 log lines like this one")
        assert records[-1].getMessage() == "accept failed: fd=7: Too many open files"
        for fd in range(10):  # a second flood; then the next line of another kind brings its count
            accept_failed(fd)
        clock.now = 30.0
        logger.warning("a different line")
        assert records[-2].getMessage().startswith("suppressed 6 log lines like this one")
        assert records[-1].getMessage() == "a different line"
    finally:
        logger.removeHandler(handler)


def test_f_the_flags_reach_the_server_config():
    a = parse_args(["--timeout-keep-alive", "3", "--header-timeout", "2.5", "--body-timeout", "7",
                    "--max-connections", "40"])
    limits = connection_limits(a)
    assert limits == ConnectionLimits(header_timeout_s=2.5, body_timeout_s=7.0, timeout_keep_alive_s=3.0,
                                      max_connections=40)
    app = SimpleNamespace(state=SimpleNamespace(minserve=None))  # make_server only keeps it
    srv = make_server(app, "127.0.0.1", 0, 1.0, "warning", limits)
    assert srv.config.timeout_keep_alive == 3.0
    assert issubclass(srv.config.http, GuardedH11Protocol) and srv.config.http.guard.limits is limits
    assert srv.connection_guard is srv.config.http.guard
    assert isinstance(srv.config.app, ConnectionCloseMiddleware) and srv.config.app.app is app

    defaults = connection_limits(parse_args([]))
    assert (defaults.header_timeout_s, defaults.body_timeout_s, defaults.timeout_keep_alive_s) == (10, 60, 5)
    assert defaults.max_connections == default_max_connections()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert 0 < defaults.max_connections < soft or soft == resource.RLIM_INFINITY
    assert default_max_connections(256) == 128 and default_max_connections(20000) == 18976
    # accept bursts fit in what the limit leaves free, and evict at most a quarter of the limit
    assert srv.config.backlog == accept_backlog(40) and accept_backlog(128, 256) == 32
    assert accept_backlog(512, 20000) == 128 and accept_backlog(18976, 20000) == 256
    with pytest.raises(ValueError, match="header_timeout_s"):
        connection_limits(parse_args(["--header-timeout", "0"]))
