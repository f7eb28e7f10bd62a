"""Versioned workload files (datasets/workloads): they load, their hashes catch edits, their
sampled lengths follow the declared distributions, and their prompts hit the drawn lengths."""

import json
import math
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from minserve.bench.workloads import (WorkloadError, canonical_sha256, load_workload, rehash,
                                      workload_dir, workload_names)

ROOT = Path(__file__).resolve().parents[1]
SINGLE = ("short_qa", "rag", "codegen", "agent")
N = 4000            # shapes per distribution check: cheap (no tokenizer), tight enough to catch a 5 % shift
Z = 4.5             # tolerance in standard errors: a false alarm about once in 150 000 checks


@pytest.fixture(scope="module")
def tokenizer():
    from minserve.models.loader import load_tokenizer, resolve_model_dir
    return load_tokenizer(resolve_model_dir("tiny-llama"))


@pytest.fixture
def copy_dir(tmp_path):
    """The workload directory copied, so a test may edit files."""
    out = tmp_path / "workloads"
    shutil.copytree(workload_dir(), out)
    return out


def edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=1))


# ---- loading and hashes --------------------------------------------------------------------

def test_the_four_workloads_and_their_mix_load_with_their_fields():
    assert set(workload_names()) == {*SINGLE, "capstone_mix"}
    for name in SINGLE:
        w = load_workload(name)
        assert w.version == "1.0.0" and w.sha256 == canonical_sha256(json.loads(w.path.read_text()))
        assert w.priority_class in ("interactive", "batch") and w.slo is not None and w.prefix is not None
        assert w.corpus["name"] == "kestrel_corpus" and len(w.resolved_sha256) == 64
    mix = load_workload("capstone_mix")
    assert [(w.name, wt) for w, wt in mix.components] == [("short_qa", 0.4), ("rag", 0.2), ("codegen", 0.2),
                                                          ("agent", 0.2)]
    assert set(mix.class_slos()) == set(SINGLE)
    agent = load_workload("agent")   # not streamed: end-to-end latency is its only objective
    assert agent.streaming is False and agent.slo.goodput() == {"e2el": 10000.0}
    assert load_workload("short_qa").slo.goodput() == {"ttft": 1000.0, "tpot": 150.0, "e2el": 8000.0}


def test_priority_classes_are_the_servers():
    from minserve.bench.workload_parts import PRIORITY_CLASSES
    from minserve.server.admission import PRIORITY_CLASSES as SERVER_CLASSES
    assert PRIORITY_CLASSES == SERVER_CLASSES


def test_arrival_processes_map_to_bench_burstiness(copy_dir):
    assert [load_workload(n).burstiness for n in SINGLE] == [1.0, 0.5, 1.0, 4.0]
    path = copy_dir / "short_qa.json"
    edit(path, lambda d: d.update(arrival={"process": "constant"}, version="1.0.1"))
    rehash(path)
    assert load_workload(path).burstiness == math.inf   # evenly spaced: arrivals.py's inf shape


def test_an_edit_without_a_version_bump_fails_loudly(copy_dir):
    path = copy_dir / "rag.json"
    edit(path, lambda d: d["prompt_tokens"].update(median=1100))
    with pytest.raises(WorkloadError, match=r"rag.json: content hash .* edited without a version bump"):
        load_workload(path)
    # Re-hashing the same version is refused too: versions.json remembers what 1.0.0 was.
    with pytest.raises(WorkloadError, match="released with other content; bump 'version'"):
        rehash(path)
    edit(path, lambda d: d.update(version="1.1.0"))
    digest = rehash(path)
    w = load_workload(path)
    assert (w.version, w.sha256, w.prompt.median) == ("1.1.0", digest, 1100.0)
    lock = json.loads((copy_dir / "versions.json").read_text())["rag"]
    assert set(lock) == {"1.0.0", "1.1.0"} and lock["1.1.0"] == digest
    # The mix pins rag 1.0.0: it refuses the bumped file until it is bumped itself.
    with pytest.raises(WorkloadError, match="pins rag version '1.0.0', the file is version 1.1.0"):
        load_workload(copy_dir / "capstone_mix.json")


def test_an_edited_corpus_fails_every_workload_that_uses_it(copy_dir):
    edit(copy_dir / "corpus.json", lambda d: d["sections"]["questions"].append("A new question?"))
    for name in SINGLE:
        with pytest.raises(WorkloadError, match="corpus.json: content hash"):
            load_workload(copy_dir / f"{name}.json")


def test_layout_and_key_order_do_not_change_the_hash(copy_dir):
    path = copy_dir / "codegen.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(doc.items()))), indent=4))
    assert load_workload(path).sha256 == doc["sha256"]


def test_bad_fields_are_named(copy_dir):
    path = copy_dir / "short_qa.json"
    edit(path, lambda d: d.update(priority_class="urgent", version="1.0.1"))
    rehash(path)
    with pytest.raises(WorkloadError, match="priority_class must be one of"):
        load_workload(path)
    edit(path, lambda d: d.update(priority_class="batch", version="1.0.2",
                                  output_tokens={"dist": "zipf", "min": 1, "max": 9}))
    rehash(path)
    with pytest.raises(WorkloadError, match=r"output_tokens.dist must be one of lognormal, uniform"):
        load_workload(path)


def test_the_workload_files_ship_in_the_wheel():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "minserve.datasets"]
    files = sorted((ROOT / "datasets" / "workloads").glob("*.json"))
    assert len(files) == 7  # four workloads, the mix, the corpus, the lock
    assert all(any(f.relative_to(ROOT / "datasets").match(g) for g in globs) for f in files)


# ---- the sampled distributions match the declared ones ----------------------------------------

def normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def declared_pmf(spec) -> dict[int, float]:
    """P(length = k) of a Lengths spec at scale 1, computed from its parameters alone."""
    lo, hi = spec.min, spec.max
    if spec.dist == "uniform":
        return {k: 1.0 / (hi - lo + 1) for k in range(lo, hi + 1)}
    if spec.dist == "constant":
        return {lo: 1.0}
    z = lambda x: math.log(x / spec.median) / spec.sigma  # round(m e^{sZ}) <= x iff Z <= z(x)
    pmf = {lo: normal_cdf(z(lo + 0.5)), hi: 1.0 - normal_cdf(z(hi - 0.5))}
    pmf.update({k: normal_cdf(z(k + 0.5)) - normal_cdf(z(k - 0.5)) for k in range(lo + 1, hi)})
    return pmf


def moments_match(sample: np.ndarray, pmf: dict[int, float]) -> list[str]:
    """Mean and variance of ``sample`` against the pmf's, within Z standard errors for n."""
    k, p = np.array(list(pmf)), np.array(list(pmf.values()))
    mu = float((k * p).sum())
    var = float(((k - mu) ** 2 * p).sum())
    mu4 = float(((k - mu) ** 4 * p).sum())
    n = len(sample)
    problems = []
    if abs(sample.mean() - mu) > Z * math.sqrt(var / n):
        problems.append(f"mean {sample.mean():.2f} vs {mu:.2f}")
    if abs(sample.var() - var) > Z * math.sqrt(max(mu4 - var ** 2, 1e-12) / n):
        problems.append(f"variance {sample.var():.1f} vs {var:.1f}")
    if sample.min() < k.min() or sample.max() > k.max():
        problems.append(f"outside [{k.min()}, {k.max()}]")
    return problems


@pytest.mark.parametrize("name", SINGLE)
def test_sampled_lengths_have_the_declared_moments(name):
    w = load_workload(name)
    shapes = w.shapes(N, seed=7)
    for column, spec in (("body_tokens", w.prompt), ("output_tokens", w.output)):
        assert moments_match(shapes[column].to_numpy(), declared_pmf(spec)) == [], (name, column)
    # The check can fail: the same sample against a median 8 % higher (or a bound moved) does.
    if w.prompt.dist == "lognormal":
        shifted = type(w.prompt)("lognormal", w.prompt.min, w.prompt.max, w.prompt.median * 1.08, w.prompt.sigma)
        assert moments_match(shapes["body_tokens"].to_numpy(), declared_pmf(shifted))


@pytest.mark.parametrize("name", SINGLE)
def test_prefix_reuse_share_and_choice_follow_the_file(name):
    w = load_workload(name)
    shapes = w.shapes(N, seed=11)
    p = w.prefix.reuse_share
    share = shapes.prefix_reused.mean()
    assert abs(share - p) <= Z * math.sqrt(p * (1 - p) / N), (share, p)
    counts = shapes.prefix_index.value_counts().reindex(range(w.prefix.count), fill_value=0)
    expected = N / w.prefix.count
    assert all(abs(c - expected) <= Z * math.sqrt(expected) for c in counts), counts.to_dict()
    assert set(shapes.prefix_tokens) == {w.prefix.tokens}


def test_the_mix_draws_its_components_by_weight():
    mix = load_workload("capstone_mix")
    shapes = mix.shapes(N, seed=3)
    for w, weight in mix.components:
        got = (shapes.workload == w.name).mean()
        assert abs(got - weight) <= Z * math.sqrt(weight * (1 - weight) / N), (w.name, got)


def test_length_scale_multiplies_medians_and_bounds():
    w = load_workload("codegen")
    shapes = w.shapes(N, seed=5, length_scale=0.25)
    assert shapes.output_tokens.min() >= round(w.output.min * 0.25)
    assert shapes.output_tokens.max() <= round(w.output.max * 0.25)
    assert abs(np.median(shapes.output_tokens) - w.output.median * 0.25) <= 4
    assert set(shapes.prefix_tokens) == {round(w.prefix.tokens * 0.25)}


# ---- the prompts ----------------------------------------------------------------------------

def test_requests_hit_the_drawn_lengths_and_carry_their_class(tokenizer):
    mix = load_workload("capstone_mix")
    reqs = mix.requests(tokenizer, 48, seed=2)
    shapes = mix.draw_shapes(48, seed=2)
    classes = {w.name: w.priority_class for w, _ in mix.components}
    for r, s in zip(reqs, shapes):
        assert abs(r.prompt_len - (s.prefix_tokens + s.body_tokens)) <= 4, (r.scenario, r.prompt_len, s)
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids)
        assert (r.expected_output_len, r.scenario, r.priority_class) == (s.output_tokens, s.workload,
                                                                          classes[s.workload])
    assert mix.requests(tokenizer, 48, seed=2) == reqs               # seeded: the same requests
    assert [r.prompt for r in mix.requests(tokenizer, 48, seed=3)] != [r.prompt for r in reqs]


def test_shared_prefixes_are_identical_and_unique_ones_differ_from_the_first_block(tokenizer):
    w = load_workload("codegen")   # reuse_share 0.8: both kinds occur
    reqs, shapes = w.requests(tokenizer, 60, seed=4), w.draw_shapes(60, seed=4)
    ids = [tokenizer(r.prompt).input_ids for r in reqs]
    block = 16
    for index in range(w.prefix.count):
        shared = [i for i, s in enumerate(shapes) if s.prefix_index == index and s.prefix_reused]
        unique = [i for i, s in enumerate(shapes) if s.prefix_index == index and not s.prefix_reused]
        assert len(shared) >= 2 and unique
        n = w.prefix.tokens - 2   # the prefix's tokens, short of the merge at its end
        assert len({tuple(ids[i][:n]) for i in shared}) == 1
        for i in unique:   # a fresh first block: no prefix-cache hit anywhere after it
            assert ids[i][:block] != ids[shared[0]][:block]


def test_prompts_are_our_own_text(tokenizer):
    corpus = json.loads((workload_dir() / "corpus.json").read_text())
    assert "Kestrel" in corpus["description"] and "written for minserve" in corpus["description"]
    prompt = load_workload("rag").requests(tokenizer, 1, seed=0)[0].prompt
    assert "[1] " in prompt and "[4] " in prompt and "Question:" in prompt
