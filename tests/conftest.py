import logging
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

logging.getLogger("minserve").setLevel(logging.ERROR)

# A test process told to take one thread (MINSERVE_TEST_THREADS=1: tests/run_suite.py, which
# `make test` runs, sets it for the parts of tests/ while another part runs beside them) or an xdist worker (one
# per core) takes one: two processes at PyTorch's default of two threads each would ask four threads
# of two cores, and OpenMP teams that wait on a descheduled thread run many times slower.
# The environment variable carries the limit into what a test starts (servers, notebook kernels);
# a test that wants a team of two asks for it explicitly (tests/test_contention.py does).
_THREADS = os.environ.get("MINSERVE_TEST_THREADS") or ("1" if os.environ.get("PYTEST_XDIST_WORKER") else "")
if _THREADS:
    os.environ["OMP_NUM_THREADS"] = _THREADS
    torch.set_num_threads(int(_THREADS))

# Each lab's exercises live beside its notebook in labs/course/ (course content, not toolkit); the
# notebooks import them as `course.labNN` from labs/, and so do the tests of those exercises.
LABS_DIR = Path(__file__).resolve().parents[1] / "labs"
if str(LABS_DIR) not in sys.path:
    sys.path.insert(0, str(LABS_DIR))


def _one_default_ssl_context() -> None:
    """Every httpx client builds an SSL context on creation (certifi's CA list parsed: ~40 ms of
    CPU here) even for the plain-HTTP servers these tests talk to; ~600 clients made it ~25 s of
    tests/ (counted 2026-12-07). Clients with the default settings share one context, built once;
    any other settings build their own as before. Where httpx is laid out otherwise (another
    version), nothing changes."""
    try:
        from httpx._transports import default as transports
    except ImportError:
        return
    build = getattr(transports, "create_ssl_context", None)
    if build is None:
        return
    shared = []

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None or not trust_env:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        if not shared:
            shared.append(build(verify=verify, cert=cert, trust_env=trust_env))
        return shared[0]

    transports.create_ssl_context = create_ssl_context


_one_default_ssl_context()


@pytest.fixture(autouse=True)
def _seed_global_rngs():
    """Every test starts from the same global random state, whatever ran before it.

    Inputs a test draws without its own generator (and library code that draws from the global
    generators: random weights of tiny-llama, sampling without a seed) then repeat from run to run
    and do not depend on test order. Tests that build inputs inline still pass their own seeded
    ``torch.Generator`` so that each input's values are fixed where they are written."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.fixture
def sdpa_reference(monkeypatch):
    """For tests where the PyTorch path is the reference for the fused C step: its attention stays
    in SDPA. By default its decode rows run the fused step's own attention
    (kernels/paged_attention.py), and a fault there would then be in both paths at once. (The
    PyTorch path itself, decode rows in C included, is checked against transformers:
    test_correctness_vs_transformers.py.)"""
    monkeypatch.setenv("MINSERVE_PREFILL_ATTENTION", "sdpa")


@pytest.fixture(scope="session")
def tiny_llm():
    from minserve import LLM
    return LLM("tiny-llama", max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=256)


@pytest.fixture(scope="session")
def tiny_llm_torch_decode():
    """tiny-llama with decode steps on the PyTorch path (the default engine uses the C kernel)."""
    from minserve import LLM
    return LLM("tiny-llama", max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=256,
               fused_decode=False)


@pytest.fixture(scope="session")
def smol_llm():
    from minserve import LLM
    return LLM("smollm2-135m", max_num_seqs=32, max_num_batched_tokens=512, kv_cache_memory="512MiB")


def generate_ids(llm, prompts, params):
    """Token ids of each prompt's answer (prompts as token-id lists); every block must be back."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(llm):
    eng = llm.llm_engine
    pool = eng.kv.pool
    assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} KV blocks still held"
    assert all(c == 0 for c in pool.ref_count)
    assert not eng.kv.block_tables and not eng.has_unfinished_requests()


def seed_kernel_cache(cache: Path, name: str = "decode") -> Path:
    """Copy this checkout's compiled ``name`` kernel into ``cache``/kernels under its own name, and
    return the copy. A test that points a fresh cache at the engine (a wheel's copy of the
    sources, a workshop's prepared cache) then loads it instead of compiling decode.c again (~20 s
    at -O3, once per such test): the file name hashes every source file, the flags, the compiler
    and the CPU (kernels/build.py), so a copy whose sources differ in any byte looks for another
    name and still compiles. Compiling into an empty cache is tested in tests/test_fused_decode.py
    (test_kernel_build_is_cached_and_keyed_by_flags)."""
    import shutil

    from minserve.kernels import build as kernel_build
    built = kernel_build.build(name)   # the checkout's own (compiled here if no test did yet)
    dest = cache / "kernels" / built.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, dest)
    return dest
