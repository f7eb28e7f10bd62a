"""Workshop mode: an absolute KV budget on CUDA, a prepared cache that sessions only read, and the
doctor's checks."""

import contextlib
import io
import os
import stat
from pathlib import Path

import pytest
import torch

from conftest import seed_kernel_cache
from minserve import LLM, SamplingParams
from minserve.cli import main
from minserve.config import EngineConfig
from minserve.engine import kv_cache
from minserve.kernels import build as kernel_build
from minserve.models.registry import ModelConfig
from minserve.models.tiny import TINY_CONFIG
from minserve.plan import get_hardware, probe
from minserve.workshop import doctor

TINY = ModelConfig.from_hf(TINY_CONFIG)
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny-llama in fp32: 2 x layers x kv_heads x head_dim x 4 bytes


# ---- kv_cache_memory on CUDA ---------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU with 10 GiB free, without a GPU: plan_kv_cache only asks torch how much is free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))


def test_kv_cache_memory_is_absolute_on_cuda(fake_gpu):
    given = kv_cache.plan_kv_cache(TINY, EngineConfig(device="cuda", kv_cache_memory="1GiB"))
    assert given.num_blocks == 2**30 // (PER_TOKEN * 16)  # not a share of the 10 GiB free
    share = kv_cache.plan_kv_cache(TINY, EngineConfig(device="cuda", gpu_memory_utilization=0.5))
    assert share.num_blocks == 5 * 2**30 // (PER_TOKEN * 16)
    blocks = kv_cache.plan_kv_cache(TINY, EngineConfig(device="cuda", num_kv_blocks=7, kv_cache_memory="1GiB"))
    assert blocks.num_blocks == 7  # num_kv_blocks still wins
    with pytest.raises(ValueError, match=r"kv_cache_memory='11GiB' .* must be <= the free memory"):
        kv_cache.plan_kv_cache(TINY, EngineConfig(device="cuda", kv_cache_memory="11GiB"))


def test_cpu_default_is_unchanged():
    cfg = EngineConfig(device="cpu")
    assert cfg.kv_cache_memory is None and cfg.kv_cache_memory_bytes == 2**30
    assert kv_cache.plan_kv_cache(TINY, cfg).num_blocks == 2**30 // (PER_TOKEN * 16)
    assert kv_cache.plan_kv_cache(TINY, EngineConfig(device="cpu", kv_cache_memory=2**20)).num_blocks == 128
    with pytest.raises(ValueError, match="kv_cache_memory must be > 0"):
        EngineConfig(kv_cache_memory=0)


# ---- prepare, then read only ---------------------------------------------------------------

def _snapshot(root: Path) -> dict:
    """Every path under root with its size, mtime and mode: any write shows up as a difference."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
            for p in [root, *root.rglob("*")]}


def _chmod_tree(root: Path, remove: int = 0, add: int = 0) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod((p.stat().st_mode & ~remove) | add)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A cache prepared through the CLI (tiny-llama and every C kernel), probe faked (slow).
    The checkout's kernel builds are put in first: prepare finds them there rather than compiling
    decode.c again (~20 s), and must still report each as its kernel step."""
    root = tmp_path_factory.mktemp("prepared") / "cache"
    seeded = {name: seed_kernel_cache(root, name) for name in kernel_build.kernel_names()}
    mp = pytest.MonkeyPatch()
    mp.setattr(probe, "measure", lambda: {"key": probe.machine_key(), "memory_bytes": 2**33,
                                          "bandwidth_bytes_per_s": 2e10, "fp32_flops_per_s": 1e11,
                                          "bf16_flops_per_s": 1e11, "w8a8_ops_per_s": None,
                                          "w4a8_ops_per_s": None, "measured_at": "test"})
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        assert main(["prepare", "--cache-dir", str(root), "--model", "tiny-llama"]) == 0
    mp.undo()
    for name, path in seeded.items():
        kernel_row = next(ln for ln in report.getvalue().splitlines() if f"kernel {name} " in ln)
        assert " ok " in kernel_row and str(path) in kernel_row, report.getvalue()
    yield root
    _chmod_tree(root, add=stat.S_IWUSR)  # let pytest clean up


def test_prepare_makes_a_cache_everyone_can_read(prepared, capsys):
    assert (prepared / "tiny-llama-v2-seed0" / ".minserve-complete").is_file()
    assert list((prepared / "probe").glob("*.json"))
    for name in ("decode", "prefill_attention", "quant", "token_ops", "nucleus"):   # not only decode
        assert list((prepared / "kernels").glob(f"lib{name}-*.so")), name
    for p in [prepared, *prepared.rglob("*")]:  # other accounts (the participants) can read it
        mode = p.stat().st_mode
        assert mode & stat.S_IROTH and (not p.is_dir() or mode & stat.S_IXOTH), p


def test_read_only_prepared_cache_is_only_read(prepared, monkeypatch):
    """Sessions must load the model and the kernel from a cache they cannot write. The tests run
    as root in CI, and root ignores permission bits, so `chmod a-w` alone proves nothing there:
    the real check is that nothing under the cache was created or modified (size, mtime, mode)."""
    _chmod_tree(prepared, remove=stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    before = _snapshot(prepared)
    monkeypatch.setenv("MINSERVE_CACHE", str(prepared))
    monkeypatch.setattr(probe, "_MEMO", {})
    monkeypatch.setattr(probe, "measure", lambda: pytest.fail("the prepared probe was not reused"))
    kernel_build.load.cache_clear()  # forget a library loaded from another cache by earlier tests
    try:
        llm = LLM("tiny-llama", num_kv_blocks=16, device="cpu", fused_decode=True)
        assert str(llm.llm_engine.runner.fused.library_name).startswith(str(prepared))
        out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        assert get_hardware("this").bandwidth_bytes_per_s == 2e10
        run = doctor.run_checks(short=True)
        assert "read-only" in next(c for c in run if c.check == "model cache").detail or os.geteuid() == 0
        kernels = next(c for c in run if c.check == "C kernels")
        assert kernels.status == "ok" and kernels.detail.startswith("all "), kernels
    finally:
        kernel_build.load.cache_clear()
    assert _snapshot(prepared) == before


def test_unwritable_unprepared_cache_says_what_to_do(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")  # a cache under a regular file cannot be created, even by root
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(ValueError, match="not writable.*minserve prepare"):
        LLM("tiny-llama", num_kv_blocks=8)
    # A read-only kernel directory without this CPU's build (os.access faked: root may write anywhere).
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path / "ro"))
    kernels = tmp_path / "ro" / "kernels"
    kernels.mkdir(parents=True)
    real_access = os.access  # (shutil.which uses it too: only the kernel directory is read-only)
    monkeypatch.setattr(kernel_build.os, "access", lambda p, mode: Path(p) != kernels and real_access(p, mode))
    with pytest.raises(kernel_build.KernelUnavailable, match="read-only.*minserve prepare"):
        kernel_build.build("decode")
    assert list(kernels.iterdir()) == []


# ---- doctor --------------------------------------------------------------------------------

def test_doctor_rows(monkeypatch, tmp_path):
    monkeypatch.setenv("MINSERVE_CACHE", str(tmp_path / "empty"))
    rows = doctor.run_checks(short=True)
    names = [r.check for r in rows]
    assert names[:8] == ["python", "torch", "CPU", "C compiler", "C kernels", "model cache", "memory",
                         "lab packages"]
    assert all(r.status in ("ok", "warn", "fail") for r in rows)
    assert not (tmp_path / "empty").exists()  # the short form writes nothing
    cache = rows[5]
    assert cache.status == "warn" and cache.fix == "minserve prepare"
    # Unprepared and read-only: a participant cannot load the model at all.
    monkeypatch.setattr(doctor, "_writable", lambda path: False)
    cache = doctor._model_cache(short=True)
    assert cache.status == "fail" and "minserve prepare --cache-dir" in cache.fix
    assert "fix" in doctor.format_checks([cache], short=True)


def test_doctor_names_the_kernels_a_read_only_cache_lacks(monkeypatch, tmp_path):
    """Only decode prepared, the cache read-only: the row names every other kernel, and the fix."""
    cache = tmp_path / "cache"
    seed_kernel_cache(cache, "decode")
    monkeypatch.setenv("MINSERVE_CACHE", str(cache))
    monkeypatch.setattr(doctor, "_writable", lambda path: False)
    row = doctor._kernels(short=True)
    others = [n for n in kernel_build.kernel_names() if n != "decode"]
    assert row.status == "warn" and row.fix.startswith("minserve prepare"), row
    assert all(n in row.detail for n in others) and "decode," not in row.detail, row.detail
    monkeypatch.setattr(doctor, "_writable", lambda path: True)
    row = doctor._kernels(short=True)
    assert row.status == "ok" and f"1 of {len(others) + 1} built" in row.detail, row


@pytest.mark.parametrize("flags,says", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "AVX-512; AMX tiles"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX-512; bf16 dot products, no AMX tiles"),
    ({"avx2"}, "AVX2; no bf16 dot products: dtype=\"bfloat16\" is emulated")])
def test_doctor_says_what_the_cpu_multiplies_with(monkeypatch, flags, says):
    from minserve.kernels import build
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    row = doctor._cpu(short=True)
    assert row.status == "ok" and says in row.detail


def test_doctor_contains_crashing_checks_and_sets_the_exit_code(monkeypatch, capsys):
    def broken(short):
        raise RuntimeError("boom")
    monkeypatch.setattr(doctor, "CHECKS", (doctor._python, broken))
    rows = doctor.run_checks()
    assert rows[1].status == "fail" and "boom" in rows[1].detail and doctor.failed(rows)
    assert main(["doctor", "--short"]) == 1
    assert "boom" in capsys.readouterr().out
    monkeypatch.setattr(doctor, "CHECKS", (doctor._python,))
    assert main(["doctor"]) == 0
    assert list(doctor.checks_frame(doctor.run_checks()).columns) == ["status", "detail", "fix"]


def test_doctor_memory_thresholds(monkeypatch):
    g = 2**30
    for avail, status in ((0.5 * g, "fail"), (2 * g, "warn"), (8 * g, "ok")):
        monkeypatch.setattr(doctor, "_meminfo", lambda a=avail: {"MemAvailable": int(a), "MemTotal": 16 * g})
        row = doctor._memory(short=True)
        assert row.status == status and (row.fix != "") == (status != "ok")
