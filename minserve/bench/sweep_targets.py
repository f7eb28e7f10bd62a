"""What a sweep benchmarks: ``minserve serve`` processes it starts, a server that is already up, or
an engine in this process. Each kind starts one target per server-parameter combination, resets
its prefix cache before every run, and stops it afterwards.

A server the sweep starts runs on a free port in a process group of its own (one signal stops it
and anything it spawned), its output in ``server.log`` beside the combination's results; the
sweep waits for ``GET /health`` and gives up, with the log's tail as the reason, when the process
exits or the wait passes ``ready_timeout_s``. The prefix cache is reset through
``POST /reset_prefix_cache`` (minserve; vLLM only with ``VLLM_SERVER_DEV_MODE=1``): without the
reset, run 2 of a combination would find run 1's prompts cached and look faster than it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 30.0
DEFAULT_READY_TIMEOUT_S = 300.0


class StartFailed(RuntimeError):
    """The target for one server combination could not be started; the message says why."""


def free_port() -> int:
    # Released before the server binds it; another process could take it in between, which is
    # rare enough on one box, and a server command line cannot be handed an open socket.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def param_flags(params: dict) -> list[str]:
    """``{"max_num_seqs": 4, "enable_prefix_caching": False}`` -> ``--max-num-seqs 4
    --no-enable-prefix-caching`` (vLLM's and minserve's spelling of booleans)."""
    out: list[str] = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            import json
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def log_tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def reset_over_http(base_url: str) -> dict:
    """POST /reset_prefix_cache; what happened, for the run's manifest."""
    from minserve.bench.client import auth_headers
    try:
        resp = httpx.post(base_url + "/reset_prefix_cache", headers=auth_headers(), timeout=30)
    except httpx.HTTPError as e:
        return {"prefix_cache_reset": False, "note": f"{type(e).__name__}: {e}"}
    if resp.status_code == 200:
        return {"prefix_cache_reset": True}
    note = {404: "the server has no /reset_prefix_cache (vLLM: start it with VLLM_SERVER_DEV_MODE=1); "
                 "runs after the first may find their prompts cached"}.get(resp.status_code, resp.text[:300])
    return {"prefix_cache_reset": False, "note": f"HTTP {resp.status_code}: {note}"}


def cache_config(base_url: str) -> dict:
    """The labels of ``vllm:cache_config_info`` in /metrics (block size, number of KV blocks...)."""
    from minserve.bench.client import auth_headers
    try:
        text = httpx.get(base_url + "/metrics", headers=auth_headers(), timeout=10).text
    except httpx.HTTPError:
        return {}
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}


# ---- the three kinds of target -------------------------------------------------------------------

@dataclasses.dataclass
class Started:
    """One started target: where the bench points, how it is served (for the manifest)."""
    base_url: str | None
    info: dict
    pids: tuple[int, ...] = ()
    engine: object = None            # in process
    process: subprocess.Popen | None = None


class ServerProcesses:
    """Starts ``serve_cmd`` + ``--host 127.0.0.1 --port P`` + the combination's flags."""
    kind = "minserve-serve"

    def __init__(self, serve_cmd: list[str] | None, model: str | None, ready_timeout_s: float):
        self.custom = serve_cmd is not None
        self.serve_cmd = serve_cmd or [sys.executable, "-m", "minserve.cli", "serve",
                                       *([model] if model else [])]
        self.model, self.ready_timeout_s = model, ready_timeout_s

    def command(self, params: dict, port: int | str = "PORT") -> list[str]:
        return [*self.serve_cmd, "--host", "127.0.0.1", "--port", str(port), *param_flags(params)]

    def engine_config(self, params: dict) -> dict | None:
        """The full configuration ``minserve serve`` builds from these flags (defaults resolved);
        None for another server program, whose defaults only it knows."""
        if self.custom:
            return None
        from minserve.bench.manifest import config_dict
        from minserve.config import EngineConfig
        from minserve.server import cli as serve_cli
        a = serve_cli.parse_args(self.command(params, 0)[4:])
        extra = {k: v for k, v in vars(a).items() if k not in serve_cli.ENGINE_ARGS and k != "model_tag"}
        return {**config_dict(EngineConfig.from_kwargs(a.model, **serve_cli.engine_kwargs(a))),
                "server_args": {k: v for k, v in extra.items() if k not in ("host", "port")}}

    def start(self, params: dict, log_dir: Path) -> Started:
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):  # argparse prints its refusal, then exits
                config = self.engine_config(params)
        except (ValueError, SystemExit) as e:
            why = errors.getvalue().strip().splitlines()[-1:] or [str(e)]
            raise StartFailed(f"invalid server parameters {params}: {why[0]}") from None
        port = free_port()
        cmd = self.command(params, port)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        base = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy(base, proc, log_path)
        except StartFailed:
            stop_process(proc)
            raise
        info = {"kind": self.kind, "command": cmd, "base_url": base, "serve_params": params,
                "engine": config, "kv_cache": cache_config(base)}
        return Started(base, info, (proc.pid,), process=proc)

    def _wait_healthy(self, base: str, proc: subprocess.Popen, log_path: Path) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise StartFailed(f"the server exited with code {proc.returncode} before it was "
                                  f"healthy; {log_path}:\n{log_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise StartFailed(f"the server was not healthy after {self.ready_timeout_s:.0f} s; "
                                  f"{log_path}:\n{log_tail(log_path)}")
            time.sleep(HEALTH_POLL_S)

    def reset(self, started: Started) -> dict:
        return reset_over_http(started.base_url)

    def stop(self, started: Started) -> None:
        stop_process(started.process)


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM the server's process group (minserve drains, then exits), SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class ExistingServer:
    """A server that is already running (``--base-url``, e.g. vLLM): nothing to start or stop, so
    there are no server parameters to vary."""
    kind = "external"

    def __init__(self, base_url: str):
        self.base_url = base_url.rstrip("/")

    def command(self, params: dict) -> list[str]:
        return [f"(the server at {self.base_url})"]

    def start(self, params: dict, log_dir: Path) -> Started:
        if params:
            raise StartFailed("--base-url targets a running server: server parameters cannot vary")
        return Started(self.base_url, {"kind": self.kind, "base_url": self.base_url,
                                       "kv_cache": cache_config(self.base_url)})

    def reset(self, started: Started) -> dict:
        return reset_over_http(started.base_url)

    def stop(self, started: Started) -> None:
        pass


class InProcessEngines:
    """An ``LLMEngine`` in this process per combination; the server parameters are engine
    arguments (EngineConfig's fields)."""
    kind = "in-process"

    def __init__(self, model: str | None):
        if not model:
            raise ValueError("--in-process needs --model (an alias or a local model directory)")
        self.model = model

    def command(self, params: dict) -> list[str]:
        args = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return [f"LLMEngine.from_engine_args({self.model!r}{', ' + args if args else ''})"]

    def start(self, params: dict, log_dir: Path) -> Started:
        from minserve.bench.manifest import config_dict
        from minserve.engine.llm_engine import LLMEngine
        try:
            engine = LLMEngine.from_engine_args(self.model, **params)
        except (ValueError, TypeError) as e:
            raise StartFailed(f"the engine could not be built with {params}: {e}") from None
        return Started(None, {"kind": self.kind, "serve_params": params,
                              "engine": config_dict(engine.config)}, engine=engine)

    def reset(self, started: Started) -> dict:
        from minserve.server.async_engine import reset_prefix_cache
        return {"prefix_cache_reset": reset_prefix_cache(started.engine)}

    def stop(self, started: Started) -> None:
        started.engine = None  # the next combination's engine takes its memory
