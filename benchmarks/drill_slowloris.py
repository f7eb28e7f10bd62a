"""Slowloris drill: many connections that never finish their request head, against a running server,
while /health and a few small completions show whether real clients still get in (issue 20 item 4).

Each attack socket sends the start of a request head and then one more byte now and then, never
the blank line that ends it. A server without a header deadline holds every such socket forever,
until its file descriptors run out; ``minserve serve`` closes them after ``--header-timeout`` and,
at ``--max-connections``, closes the oldest of them to let a newcomer in. The drill reconnects
every attack socket the server closes, so the pressure stays on for the whole run.

It starts nothing: point it at a server that is already up.

    .venv/bin/minserve serve --port 8123 --max-connections 512 &
    .venv/bin/python benchmarks/drill_slowloris.py --base-url http://127.0.0.1:8123 --connections 2000

``slowloris_drill()`` is the function a soak benchmark calls; it returns the figures as a dict.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import resource
import select
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx

HEAD_START = b"GET /health HTTP/1.1\r\nHost: drill\r\nX-Slowloris: "
TICK_S = 0.5  # each attack socket sends one more byte this often: slow, but never silent


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE toward ``wanted`` (at most the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Attack:
    """``connections`` slow sockets: open, drip a byte each per tick, notice closes, reopen. It runs
    in a process of its own (see :func:`_attack_process`): in a thread its busy loop would hold
    the GIL against the probes, and the probes would measure the drill instead of the server."""

    def __init__(self, host: str, port: int, connections: int, stop, ready):
        self.addr, self.connections = (host, port), connections
        self.socks: list[socket.socket] = []
        self.opened = self.closed_by_server = self.connect_failures = 0
        self.stop, self.ready = stop, ready

    def _open_one(self) -> None:
        try:
            s = socket.create_connection(self.addr, timeout=5)
            s.sendall(HEAD_START)
            s.setblocking(False)
        except OSError:
            self.connect_failures += 1
            return
        self.opened += 1
        self.socks.append(s)

    def run(self) -> dict:
        while len(self.socks) < self.connections and not self.stop.is_set():
            self._open_one()
        self.ready.set()
        while not self.stop.is_set():
            t0 = time.monotonic()
            alive = []
            # A socket the server closed reads as readable (EOF or reset); a live one never does:
            # the server sends nothing to a request head that has not ended.
            for i in range(0, len(self.socks), 500):  # select() takes fds below 1024 only: poll
                batch = self.socks[i:i + 500]
                poller = select.poll()
                for s in batch:
                    poller.register(s, select.POLLIN | select.POLLERR | select.POLLHUP)
                gone = {fd for fd, _ in poller.poll(0)}
                for s in batch:
                    if s.fileno() in gone or not self._drip(s):
                        self.closed_by_server += 1
                        s.close()
                    else:
                        alive.append(s)
            self.socks = alive
            while len(self.socks) < self.connections and not self.stop.is_set():
                self._open_one()  # keep the pressure on
            self.stop.wait(max(0.0, TICK_S - (time.monotonic() - t0)))
        counts = {"attack_opened": self.opened, "attack_open_at_end": len(self.socks),
                  "attack_closed_by_server": self.closed_by_server,
                  "attack_connect_failures": self.connect_failures}
        for s in self.socks:
            s.close()
        return counts

    @staticmethod
    def _drip(s: socket.socket) -> bool:
        try:
            s.send(b"a")
            return True
        except BlockingIOError:
            return True
        except OSError:
            return False


def _attack_process(host, port, connections, stop, ready, results) -> None:
    results.put(Attack(host, port, connections, stop, ready).run())


def _probe(request, every_s: float, stop: threading.Event, out: dict) -> None:
    """Call ``request()`` (an httpx request) every ``every_s`` until ``stop``: the latency of each
    200 goes to out["latencies"], anything else is counted by kind in out["failures"]."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            status = request().status_code
            failure = None if status == 200 else f"HTTP {status}"
        except httpx.HTTPError as e:
            failure = type(e).__name__
        if failure is None:
            out["latencies"].append(time.perf_counter() - t0)
        else:
            out["failures"][failure] += 1
        stop.wait(every_s)


def slowloris_drill(base_url: str, connections: int, seconds: float) -> dict:
    """Hold ``connections`` slowloris sockets against ``base_url`` for ``seconds`` (after opening
    them), probing /health (new connection every 0.1 s) and small completions (one a second).
    Latencies in ms; ``*_failures`` counts probes that did not get a 200 within their timeout."""
    base_url = base_url.rstrip("/")
    fd_limit = raise_fd_limit(connections + 256)
    if fd_limit < connections + 64:
        connections = max(1, fd_limit - 64)  # leave this process fds for its own probes
    url = urlsplit(base_url)
    model = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]

    ctx = multiprocessing.get_context("fork")  # the child inherits the raised fd limit
    attack_stop, attack_ready, attack_results = ctx.Event(), ctx.Event(), ctx.Queue()
    attacker = ctx.Process(target=_attack_process, daemon=True,
                           args=(url.hostname, url.port or 80, connections, attack_stop, attack_ready,
                                 attack_results))
    stop = threading.Event()
    health: dict = {"latencies": [], "failures": collections.Counter()}
    completions: dict = {"latencies": [], "failures": collections.Counter()}
    # A new connection for each probe, as a load balancer's health check makes: what is tested is
    # whether a newcomer gets accepted and answered, not a warm kept-alive connection.
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 8}
    probes = [threading.Thread(target=_probe, daemon=True, args=(
                  lambda: httpx.get(base_url + "/health", timeout=5), 0.1, stop, health)),
              threading.Thread(target=_probe, daemon=True, args=(
                  lambda: httpx.post(base_url + "/v1/completions", json=body, timeout=30), 1.0, stop,
                  completions))]
    t0 = time.monotonic()
    attacker.start()
    for t in probes:  # from the start: the ramp counts too
        t.start()
    attack_ready.wait(120)
    ramp_s = time.monotonic() - t0
    time.sleep(seconds)
    stop.set()
    attack_stop.set()
    counts = attack_results.get(timeout=60)
    attacker.join(30)
    for t in probes:
        t.join(60)

    def ms(v):
        return None if v is None else round(v * 1000, 1)

    h = health["latencies"]
    return {
        "base_url": base_url, "connections": connections, "seconds": seconds, "ramp_s": round(ramp_s, 2),
        **counts,
        "health_probes": len(h) + sum(health["failures"].values()),
        "health_failures": sum(health["failures"].values()), "health_failure_kinds": dict(health["failures"]),
        "health_p50_ms": ms(statistics.median(h)) if h else None,
        "health_p99_ms": ms(percentile(h, 0.99)), "health_max_ms": ms(max(h)) if h else None,
        "completions": len(completions["latencies"]) + sum(completions["failures"].values()),
        "completions_ok": len(completions["latencies"]),
        "completions_failure_kinds": dict(completions["failures"]),
        "completions_max_ms": ms(max(completions["latencies"])) if completions["latencies"] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    print(json.dumps(slowloris_drill(a.base_url, a.connections, a.seconds), indent=2))


if __name__ == "__main__":
    main()
