"""A real uvicorn server on a free port, in a thread, for tests that speak HTTP."""

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def live_server(app, timeout_s: float = 30.0, server: uvicorn.Server | None = None):
    """Serve ``app`` on 127.0.0.1; yields the base URL and stops the server on exit. ``server``:
    a uvicorn Server built elsewhere (e.g. cli.make_server's), run instead of a plain one."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for the port
    srv = server or uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()


@contextlib.contextmanager
def served(engine, **app_kwargs):
    """``engine`` behind its own app on a live server: base URL, engine, tokenizer, the app's
    state and an ``openai`` client (api key "x", so its requests are their own tenant)."""
    from types import SimpleNamespace

    import openai

    from minserve.server import create_app
    app = create_app(engine, **app_kwargs)
    with live_server(app) as base:
        yield SimpleNamespace(base=base, engine=engine, tok=engine.tokenizer, st=app.state.minserve,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0))


def post_json(srv, path: str = "/v1/completions", status: int = 200, **body) -> dict:
    """POST ``body`` to ``srv.base + path``; assert the status and return the parsed answer."""
    import httpx
    r = httpx.post(srv.base + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()
