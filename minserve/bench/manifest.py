"""The run manifest: what a benchmark result was measured *on*, recorded beside the numbers.

Two latency distributions can only be compared when the traffic, the model and the machine were
the same; everything else that differs (the engine configuration, the code, the kernels) is what
the comparison is about. So every result file carries a manifest, and :func:`comparable` names the
differences that forbid a comparison. Results without a manifest are not comparable: nothing says
what they ran.

Fields (each a dict; ``None`` where it cannot be known, with a ``note`` saying why):

- ``workload``: name, version, sha256 of the file and of everything it uses (a versioned workload
  file), or the built-in dataset and its arguments;
- ``model``: the id, the local files and their SHA-256 (hashed once, then cached by path, mtime
  and size in ``$MINSERVE_CACHE/manifest/file_hashes.json``);
- ``minserve``: version, git commit, whether the tree had uncommitted changes;
- ``kernels``: compiler, its version and flags, the CPU's ISA extensions, the prefill tile dtype;
- ``hardware``: CPU model, cores, memory, measured read bandwidth (minserve.plan.probe, measured
  once per machine), the GPU when torch sees one;
- ``engine`` / ``server``: the full engine configuration (defaults resolved) and how it was
  served; ``bench``: the load generator's options;
- ``load``: the machine's load average and the CPU other processes took during the run (see
  :class:`LoadSampler`); a busy shared machine explains a noisy result. A server the run did not
  start itself (``--base-url``) counts as another process when it runs on the same machine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

MANIFEST_VERSION = 1
NO_MANIFEST = "results without a manifest are not comparable"
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "sve2")
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".gguf", ".model", ".txt", ".bin")
_HASH_CHUNK = 1 << 20


# ---- file hashes, cached by path + mtime + size -------------------------------------------------

def _hash_cache_path() -> Path:
    from minserve.config import cache_dir
    return cache_dir() / "manifest" / "file_hashes.json"


def file_sha256(path: str | Path, cache: dict | None = None) -> str:
    """SHA-256 of a file; reused from ``cache`` while its mtime and size are unchanged."""
    path = Path(path).resolve()
    st = path.stat()
    key, stamp = str(path), [st.st_mtime_ns, st.st_size]
    if cache is not None and cache.get(key, {}).get("stamp") == stamp:
        return cache[key]["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    if cache is not None:
        cache[key] = {"stamp": stamp, "sha256": h.hexdigest()}
    return h.hexdigest()


def hash_files(files: list[Path]) -> dict[str, str]:
    """{file name: sha256}, through the on-disk cache (a read-only cache is only not updated)."""
    cache_file = _hash_cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    before = json.dumps(cache, sort_keys=True)
    out = {f.name: file_sha256(f, cache) for f in sorted(files)}
    if json.dumps(cache, sort_keys=True) != before:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=0))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # the hashes are still right; the next run computes them again
    return out


def model_info(model: str | None) -> dict:
    """The model's id, local folder and the SHA-256 of its files (weights, config, tokenizer).
    A model only the server knows (a hub id on a remote vLLM) gets ``sha256: None`` and a note."""
    if not model:
        return {"id": None, "path": None, "sha256": None, "note": "no model given"}
    from minserve.models.loader import resolve_model_dir
    try:
        folder = resolve_model_dir(model)
    except ValueError as e:
        return {"id": model, "path": None, "sha256": None, "note": f"not a local model here: {e}"}
    files = [f for f in folder.iterdir() if f.is_file() and f.suffix in MODEL_FILE_SUFFIXES]
    hashes = hash_files(files)
    combined = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
    return {"id": model, "path": str(folder), "sha256": combined, "files": hashes}


# ---- code, kernels, hardware (the same for every run of a process: computed once) ----------------

def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def minserve_info() -> dict:
    import minserve
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": minserve.__version__, "git_commit": commit,
            "git_dirty": None if status is None else bool(status),
            "python": platform.python_version(), "torch": _torch_version()}


def _torch_version() -> str | None:
    try:
        import torch
        return torch.__version__
    except ImportError:
        return None


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                present = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in present]
    except OSError:
        pass
    return []


@functools.cache
def kernel_info() -> dict:
    """How the C kernels are (or would be) built here: kernels/build.py's compiler and flags."""
    from minserve.kernels import build
    out: dict = {"isa": _cpu_flags(), "flags": list(build.FLAGS) + build.vendor_flags()}
    try:
        cc = build._compiler()
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        out.update(compiler=cc, compiler_version=version.splitlines()[0] if version else None,
                   decode_library=build.library_path("decode").name)
    except (build.KernelUnavailable, OSError, subprocess.SubprocessError) as e:
        out.update(compiler=None, note=f"kernels unavailable: {e}")
    try:
        from minserve.kernels.quant import prefill_tile_dtype
        out["prefill_tile_dtype"] = str(prefill_tile_dtype()).replace("torch.", "")
    except Exception as e:  # noqa: BLE001 - informative only
        out["prefill_tile_dtype"] = f"unknown ({type(e).__name__})"
    out["env"] = {k: v for k, v in sorted(os.environ.items())
                  if k.startswith("MINSERVE_") or k in ("OMP_NUM_THREADS", "CC")}
    return out


@functools.cache
def hardware_info() -> dict:
    """CPU, cores, memory, measured read bandwidth and the GPU (minserve.plan.probe)."""
    from minserve.plan.probe import cpu_model, this_machine
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    out = {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": affinity,
           "machine": platform.machine(), "system": platform.system(), "gpu": None}
    import torch
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    hw = this_machine()
    out.update(memory_bytes=hw.memory_bytes, read_bandwidth_bytes_per_s=hw.bandwidth_bytes_per_s,
               bandwidth_source=hw.source, torch_threads=torch.get_num_threads())
    return out


# ---- load on the machine during a run ----------------------------------------------------------

def _busy_s() -> float | None:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    v = [int(x) for x in first[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its waited-for children (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class LoadSampler:
    """The machine's load around a run: load averages before and after, and the CPU taken by
    processes other than ours (this one plus ``pids``, e.g. the server it started), in cores."""

    def __init__(self, pids: tuple[int, ...] = ()):
        self.pids = (os.getpid(), *pids)
        self.before: dict | None = None

    def _sample(self) -> dict:
        return {"t": time.monotonic(), "busy_s": _busy_s(),
                "ours_s": sum(_process_cpu_s(p) for p in self.pids), "loadavg": _loadavg()}

    def start(self) -> "LoadSampler":
        self.before = self._sample()
        return self

    def stop(self) -> dict:
        a, b = self.before, self._sample()
        seconds = b["t"] - a["t"]
        others = None
        if a["busy_s"] is not None and b["busy_s"] is not None and seconds > 0:
            others = max(0.0, (b["busy_s"] - a["busy_s"]) - (b["ours_s"] - a["ours_s"])) / seconds
        return {"seconds": round(seconds, 3), "loadavg_before": a["loadavg"], "loadavg_after": b["loadavg"],
                "ours_cores": round((b["ours_s"] - a["ours_s"]) / seconds, 3) if seconds > 0 else None,
                "others_cores": None if others is None else round(others, 3),
                "cpus": os.cpu_count()}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---- the manifest --------------------------------------------------------------------------------

def config_dict(config) -> dict:
    """An EngineConfig (or any dataclass) as JSON-safe values, every field, defaults included."""
    if not dataclasses.is_dataclass(config):  # a stand-in engine's config object
        return {k: _json_safe(v) for k, v in vars(config).items() if not k.startswith("_")}
    return {f.name: _json_safe(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _json_safe(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return config_dict(v)
    return getattr(v, "__qualname__", None) or str(v)


def build_manifest(*, workload: dict, model: str | None, engine: dict | None, server: dict,
                   bench: dict, load: dict | None, model_detail: dict | None = None) -> dict:
    """Every field of the module docstring; ``model_detail`` replaces hashing ``model`` here."""
    return {"manifest_version": MANIFEST_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "workload": workload, "model": model_detail or model_info(model),
            "minserve": minserve_info(), "kernels": kernel_info(), "hardware": hardware_info(),
            "engine": engine, "server": server, "bench": _json_safe(bench), "load": load,
            "command": sys.argv[:]}


def dataset_workload(name: str, **args) -> dict:
    """The manifest's ``workload`` for a built-in dataset (random, qa, ..., sharegpt): no file
    version, so its identity is its arguments (and the Python version, which renders the corpus)."""
    ident = {"dataset": name, **{k: _json_safe(v) for k, v in sorted(args.items())},
             "python": platform.python_version()}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return {"name": name, "version": None, "sha256": digest, "resolved_sha256": digest,
            "arguments": ident, "note": "a built-in dataset, not a versioned workload file"}


# What must be equal for two results to be compared: (section, key, what to call it).
COMPARABILITY = (
    ("workload", "name", "workload name"), ("workload", "version", "workload version"),
    ("workload", "resolved_sha256", "workload content hash"), ("model", "sha256", "model file hash"),
    ("hardware", "cpu_model", "CPU model"), ("hardware", "usable_cpus", "usable CPU cores"),
    ("hardware", "gpu", "GPU"))


def comparable(a: dict | None, b: dict | None) -> list[str]:
    """The differences that make results ``a`` and ``b`` (result dicts with a ``manifest``, or
    manifests) not comparable; an empty list when they may be compared."""
    ma, mb = (_manifest_of(x) for x in (a, b))
    if ma is None or mb is None:
        which = "neither result has one" if ma is None and mb is None else (
            f"the {'first' if ma is None else 'second'} result has none")
        return [f"{NO_MANIFEST}: {which}"]
    out = []
    for section, key, label in COMPARABILITY:
        va, vb = (ma.get(section) or {}).get(key), (mb.get(section) or {}).get(key)
        if va != vb:
            out.append(f"{label} differs: {va!r} vs {vb!r}")
        elif va is None and key == "sha256":
            out.append(f"{label} is unknown for both, so they may differ")
    return out


def _manifest_of(x: dict | None) -> dict | None:
    if not isinstance(x, dict):
        return None
    if "manifest_version" in x:
        return x
    m = x.get("manifest")
    return m if isinstance(m, dict) else None
