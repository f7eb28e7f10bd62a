"""Import edges that point the wrong way stay cut (issue 23's review): a low layer must not import
a higher one to borrow a name. Read from the sources with ast (every import, at the top or inside a
function), so the test fails the day someone adds one back. And the seams that replaced them keep
one home each: the KV formula, the old import paths."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (file, modules it must not import): the edge, and where the shared thing lives now.
CUT = [
    ("minserve/engine/model_runner.py", ("minserve.plan",)),            # kv_budget_within: engine/kv_sizing.py
    ("minserve/quant/awq.py", ("minserve.eval",)),                      # dataset_path: minserve/paths.py
    ("kernels/decode.py", ("minserve.models",)),                        # DENSE: kernels/formats.py
    ("kernels/build.py", ("minserve.config",)),                         # cache_dir: minserve/paths.py
    ("minserve/server/async_engine.py", ("minserve.engine.scheduler", "minserve.engine.kv_cache")),
    ("minserve/spec/verify.py", ()),                                    # checked below: no private names
]


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("path,forbidden", CUT)
def test_the_cut_edges_stay_cut(path, forbidden):
    found = [m for m, _ in imports(ROOT / path) if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not found, f"{path} imports {found}"


def test_verification_uses_only_the_samplers_public_functions():
    private = [(m, n) for m, names in imports(ROOT / "minserve/spec/verify.py") for n in names
               if m == "minserve.engine.sampler" and n.startswith("_")]
    assert not private
    assert any(m == "minserve.engine.sampler" for m, _ in imports(ROOT / "minserve/spec/verify.py"))


def test_paths_imports_nothing_of_minserve():
    assert not [m for m, _ in imports(ROOT / "minserve/paths.py") if m.startswith("minserve")]


def test_the_kv_formula_has_one_home_and_the_old_names_reach_it():
    from minserve.engine import kv_cache, kv_sizing
    from minserve.lab import capacity
    from minserve.plan import budget
    assert capacity.kv_bytes_per_token is kv_sizing.kv_bytes_per_token
    assert budget.kv_budget_within is kv_sizing.kv_budget_within
    assert kv_cache.plan_kv_cache is kv_sizing.plan_kv_cache
    assert kv_cache.kv_cache_bytes_per_token is kv_sizing.kv_cache_bytes_per_token
    # SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64.
    assert kv_sizing.kv_bytes_per_token(30, 3, 64, 4) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_sizing.kv_bytes_per_token(30, 3, 64, 1, scale_bytes=4) == 2 * 30 * 3 * (64 + 4) == 12240


def test_moved_names_still_import_from_their_old_modules():
    from minserve import config, paths
    from minserve.attention import fused_cpu
    from minserve.engine.fused_step import FusedCpuExecutor
    from minserve.eval import data
    from minserve.kernels.formats import DENSE
    from minserve.models import weights
    assert config.cache_dir is paths.cache_dir and data.dataset_path is paths.dataset_path
    assert weights.DENSE == DENSE == "dense"
    assert fused_cpu.FusedCpuBackend is FusedCpuExecutor is fused_cpu.FusedCpuExecutor
    with pytest.raises(AttributeError):
        fused_cpu.NoSuchName
