"""Processes that start together on a cold cache fill each cache entry once (minserve/paths.py's
``cache_entry_lock``): a room of notebooks opening on a fresh workshop box, or ``make test``'s parts,
used to convert SmolLM2 (~20 s of CPU) and compile decode.c (~20 s) once each, all at the same time.

Each test starts three processes at once on an empty ``MINSERVE_CACHE`` and counts how often the
work ran: once, with every process returning the same finished entry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import minserve.kernels.build as kernel_build
from minserve.paths import cache_entry_lock

ROOT = Path(__file__).resolve().parents[1]

# A conversion that takes long enough for the others to arrive while it runs, and leaves a mark
# per run in a log shared by the three processes.
CONVERT = """
import sys, time
from pathlib import Path
from minserve.models import loader

log = Path(sys.argv[1])
def convert(tmp):
    with log.open("a") as f:
        f.write("converted\\n")
    time.sleep(1.0)
    (tmp / "weights.bin").write_bytes(b"x" * 100)
print(loader._converted("demo-model", convert))
"""

BUILD = """
import minserve.kernels.build as b
print(b.build("token_ops"))
"""


def _together(code: str, cache: Path, *args: str, n: int = 3) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "MINSERVE_CACHE": str(cache), "MINSERVE_LOG_LEVEL": "INFO"}
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    assert all(d.returncode == 0 for d in done), [d.stderr[-2000:] for d in done]
    return done


def test_three_processes_convert_a_model_once(tmp_path):
    log = tmp_path / "runs.log"
    done = _together(CONVERT, tmp_path / "cache", str(log))
    assert log.read_text().splitlines() == ["converted"]
    paths = {d.stdout.strip() for d in done}
    assert paths == {str(tmp_path / "cache" / "demo-model")}
    assert (tmp_path / "cache" / "demo-model" / "weights.bin").read_bytes() == b"x" * 100
    waited = sum("waiting for another process preparing demo-model" in d.stderr for d in done)
    assert waited >= 1   # the later ones said why they sat still
    # No temporary directories left beside the entry.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".locks", "demo-model"]


def test_three_processes_compile_a_kernel_once(tmp_path):
    done = _together(BUILD, tmp_path / "cache")
    compiled = sum("compiling the token_ops kernel" in d.stderr for d in done)
    assert compiled == 1, [d.stderr for d in done]
    (path,) = {d.stdout.strip() for d in done}
    assert [p.name for p in (tmp_path / "cache" / "kernels").iterdir()] == [Path(path).name]


def test_no_lock_where_the_cache_cannot_hold_one(tmp_path, monkeypatch):
    # The cache's place is a file: no lock directory can be made, and the caller still runs (its
    # own error about the cache follows, as before the lock).
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path / "file" / "cache"))
    ran = []
    with cache_entry_lock("anything"):
        ran.append(True)
    assert ran == [True]


def test_a_lock_is_released_when_its_block_ends(tmp_path, monkeypatch):
    import fcntl
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path))
    with cache_entry_lock("entry"):
        fd = os.open(tmp_path / ".locks" / "entry.lock", os.O_RDONLY)
        try:   # held: another open file cannot take it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the lock was not held inside the block")
            except BlockingIOError:
                pass
        finally:
            os.close(fd)
    fd = os.open(tmp_path / ".locks" / "entry.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # released: taken at once
    finally:
        os.close(fd)
    assert kernel_build.cache_dir() == tmp_path


def test_a_file_system_without_flock_still_fills_the_entry(tmp_path, monkeypatch):
    # Some network mounts answer flock with ENOLCK: the caller runs without the lock, as where
    # fcntl is missing, rather than failing its build or conversion.
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    ran = []
    with cache_entry_lock("entry"):
        ran.append(True)
    assert ran == [True]
