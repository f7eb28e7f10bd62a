"""The kernel sources live in the top-level kernels/ directory and import as minserve.kernels.

pyproject.toml maps the package there (setuptools package-dir) and ships the C sources as package
data. These tests check that the mapping holds everywhere the engine is imported from: the
editable install the Makefile makes, a bare checkout (a ``python`` started in the repository), and
a built wheel installed on its own, which then runs the fused decode step from its own copy of
the source (that copy hashes to the checkout's build, which the test puts in its cache).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import seed_kernel_cache
from minserve.kernels import build as kernel_build

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_under(directory: Path, name: str) -> set[str]:
    return {".".join([name, *p.parent.relative_to(directory).parts])
            for p in directory.rglob("__init__.py") if "__pycache__" not in p.parts}


def test_pyproject_lists_every_package_and_maps_the_kernels():
    """The packages are listed, not found (find cannot see kernels/), so the list must keep up."""
    tool = _pyproject()["tool"]["setuptools"]
    assert tool["package-dir"] == {"minserve.kernels": "kernels", "minserve.datasets": "datasets"}
    # minserve.datasets: data files only, and no __init__.py on purpose: a regular package named
    # datasets at the repository root would shadow Hugging Face's (lm-eval imports it).
    expected = (_packages_under(ROOT / "minserve", "minserve") | _packages_under(KERNELS, "minserve.kernels")
                | {"minserve.datasets"})
    assert not (ROOT / "datasets" / "__init__.py").exists()
    assert set(tool["packages"]) == expected, "add new packages to [tool.setuptools] packages"
    assert not (ROOT / "minserve" / "kernels").exists(), "the kernels live in the top-level kernels/"
    data = tool["package-data"]["minserve.kernels"]
    sources = sorted(KERNELS.rglob("*.c"))
    assert sources and all(any(s.relative_to(KERNELS).match(g) for g in data) for s in sources)
    # Every data file `minserve eval` and AWQ read by default ships in the wheel.
    data_root, globs = ROOT / "datasets", tool["package-data"]["minserve.datasets"]
    files = sorted([*data_root.glob("*/*.jsonl"), *data_root.glob("eval/tasks/*.yaml")])
    assert len(files) >= 5 and all(any(f.relative_to(data_root).match(g) for g in globs) for f in files)


def _import_report(cwd: Path, *python_args: str) -> dict:
    code = ("import json, minserve, minserve.kernels.build as b; "
            "print(json.dumps({'minserve': minserve.__file__, 'source_dir': str(b.SOURCE_DIR)}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, *python_args, "-c", code], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_import_from_the_repository_and_from_elsewhere(tmp_path):
    """From the repository root (the editable finder, or the checkout fallback in minserve/__init__)
    and from another directory (whatever install the interpreter has): minserve.kernels comes from
    the same copy as minserve, and in the repository that is the top-level kernels/."""
    here = _import_report(ROOT)
    assert Path(here["minserve"]).resolve() == ROOT / "minserve" / "__init__.py"
    assert Path(here["source_dir"]) == KERNELS
    elsewhere = _import_report(tmp_path)
    pkg = Path(elsewhere["minserve"]).resolve().parent
    # A checkout (its kernels/ beside the package) loads its own kernels/; a wheel its mapping.
    expected = pkg.parent / "kernels" if (pkg.parent / "kernels" / "decode.c").is_file() else pkg / "kernels"
    assert Path(elsewhere["source_dir"]) == expected
    assert (expected / "decode.c").is_file()


def test_bare_checkout_without_an_install_finds_the_kernels():
    """No site hooks (-S: no editable finder), only the repository on sys.path."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    code = (f"import sys; sys.path[:] = [''] + sys.path + {site!r}; import minserve.kernels.build as b; "
            "import minserve; print(minserve.__file__); print(b.SOURCE_DIR)")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    init, source_dir = out.stdout.strip().splitlines()[-2:]
    assert Path(init).resolve() == ROOT / "minserve" / "__init__.py" and Path(source_dir) == KERNELS


def test_the_top_level_name_kernels_is_left_to_the_installed_package(tmp_path):
    """From the repository root (``python -c``, ``python -m``) the name ``kernels`` is Hugging
    Face's kernel-hub package, which transformers 5.25+ imports, never this repository's kernels/."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("MARK = 'hub'\n")
    code = "import kernels; from kernels import MARK; print(kernels.__file__, MARK)"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, ''); {code}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(fake / "__init__.py"), "hub"]
    code = ("import sys; sys.path[:] = [''] + [p for p in sys.path if 'site-packages' not in p]\n"
            "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["missing", "kernels"]
    # minserve's own name for the directory still works beside it.
    assert _import_report(ROOT)["source_dir"] == str(KERNELS)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_kernel_cache_key_covers_the_source_not_its_location(tmp_path, monkeypatch):
    """A copy elsewhere (an installed wheel) reuses the build; an edited source gets a new one."""
    original = kernel_build.library_path("decode")
    for src in [*kernel_build.SOURCE_DIR.glob("*.c"), *kernel_build.SOURCE_DIR.glob("*.h")]:
        shutil.copy(src, tmp_path / src.name)   # decode.c and the headers it includes
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", tmp_path)
    assert kernel_build.library_path("decode") == original
    with open(tmp_path / "decode.c", "a") as f:
        f.write("\n/* edited */\n")
    assert kernel_build.library_path("decode") != original


WHEEL_SMOKE = textwrap.dedent("""
    import sys
    from pathlib import Path
    site, cache = Path(sys.argv[1]), Path(sys.argv[2])
    import minserve
    import minserve.kernels.build as build
    assert Path(minserve.__file__).resolve().is_relative_to(site), minserve.__file__
    assert build.SOURCE_DIR.is_relative_to(site), build.SOURCE_DIR
    assert (build.SOURCE_DIR / "decode.c").is_file()
    build.cache_dir = lambda: cache  # a cache of its own (models stay in the usual cache)
    # The test put the checkout's decode build in that cache: the installed copy must hash to the
    # same name (its sources, headers included, are the checkout's byte for byte), and the engine
    # loads that file rather than compiling another.
    seeded = build.library_path("decode")
    assert seeded.exists(), f"the installed sources hash to {seeded.name}, not to the checkout's build"
    from minserve import LLM, SamplingParams
    llm = LLM("tiny-llama", num_kv_blocks=32, fused_decode=True, device="cpu")
    runner = llm.llm_engine.runner
    fused, calls = runner.fused, []

    class Counting:  # counts the fused steps, so the test knows the kernel really ran
        def __getattr__(self, name):
            return getattr(fused, name)

        def __call__(self, *args, **kwargs):
            calls.append(1)
            return fused(*args, **kwargs)

    next(b for b in runner.backends if b.name == "fused-cpu").decoder = Counting()
    out = llm.generate(["Hello", "The capital"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out), out
    assert calls, "no decode step ran in the fused kernel"
    assert Path(runner.fused.library_name) == seeded, runner.fused.library_name
    assert [p.name for p in (cache / "kernels").iterdir()] == [seeded.name]
    # The gate's data and AWQ's calibration text come from the wheel too (no checkout on the path).
    from minserve.eval.data import default_data_dir, load_questions, load_texts
    from minserve.quant.awq import default_calibration_path, load_calibration
    assert default_data_dir().is_relative_to(site / "minserve" / "datasets"), default_data_dir()
    assert default_calibration_path().is_relative_to(site), default_calibration_path()
    assert len(load_texts()) >= 20 and len(load_questions()) >= 50 and load_calibration()
    assert (default_data_dir() / "tasks" / "minserve_questions.yaml").is_file()
    print("OK", minserve.__file__, build.SOURCE_DIR, len(calls))
""")


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: the fused decode kernel cannot be built")
def test_wheel_installs_and_runs_the_fused_decode_step(tmp_path):
    """Build the wheel from a copy of the project (nothing written into the repository), install it
    with --no-deps into a directory, and run a fused decode step from that copy alone."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("minserve", "kernels", "datasets"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PIP_NO_INDEX": "1"}
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                            str(src)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("minserve-*.whl")
    site = tmp_path / "site"
    inst = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    assert (site / "minserve" / "kernels" / "decode.c").is_file()
    assert not (site / "kernels").exists(), "the kernels must install as minserve.kernels only"
    assert (site / "minserve" / "datasets" / "eval" / "prose.jsonl").is_file()
    assert not (site / "datasets").exists(), "the data must install as minserve/datasets only"

    # The venv's interpreter (torch & co. from its site-packages); the wheel's copy first on the path,
    # the repository nowhere on it (cwd is tmp_path).
    seed_kernel_cache(tmp_path / "cache")   # the checkout's decode build: no second ~20 s compile
    run = subprocess.run([sys.executable, "-c", WHEEL_SMOKE, str(site), str(tmp_path / "cache")],
                         cwd=tmp_path, env=env | {"PYTHONPATH": str(site), "MINSERVE_LOG_LEVEL": "WARNING"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("OK "), run.stdout
