"""The run manifest: every field is there and true, file hashes are cached by stamp, the load
arithmetic, and comparable() naming exactly the differences that forbid a comparison."""

import copy
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from minserve.bench import manifest as mf
from minserve.bench.manifest import NO_MANIFEST, build_manifest, comparable, config_dict, file_sha256

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"manifest_version", "created", "workload", "model", "minserve", "kernels", "hardware",
          "engine", "server", "bench", "load", "command"}


@pytest.fixture(scope="module")
def engine():
    from minserve.engine.llm_engine import LLMEngine
    return LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, max_num_batched_tokens=256,
                                      num_kv_blocks=64)


@pytest.fixture(scope="module")
def inprocess_result(engine):
    from minserve.bench import get_samples, run_inprocess
    samples = get_samples("random", engine.tokenizer, 3, random_input_len=16, random_output_len=4)
    return run_inprocess(engine, samples, workload={"name": "random", "version": None}, ignore_eos=True)


def test_an_inprocess_result_carries_every_field(inprocess_result, engine):
    m = inprocess_result.manifest
    assert set(m) == FIELDS and m["manifest_version"] == 1
    assert m["workload"] == {"name": "random", "version": None}
    assert m["engine"] == config_dict(engine.config) and m["engine"]["max_num_seqs"] == 4
    assert m["server"] == {"kind": "in-process"} and m["bench"]["ignore_eos"] is True
    assert set(m["load"]) == {"seconds", "loadavg_before", "loadavg_after", "ours_cores", "others_cores", "cpus"}
    assert inprocess_result.to_json()["manifest"] == m   # written into the result file


def test_model_hash_is_the_hash_of_its_files(inprocess_result, engine):
    model = inprocess_result.manifest["model"]
    folder = Path(model["path"])
    expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
                if p.suffix in mf.MODEL_FILE_SUFFIXES}
    assert model["files"] == expected and "model.safetensors" in expected
    assert model["sha256"] == hashlib.sha256(json.dumps(expected, sort_keys=True).encode()).hexdigest()
    assert mf.model_info("no-such-model")["sha256"] is None


def test_code_kernels_and_hardware(inprocess_result):
    import minserve
    from minserve.kernels import build
    m = inprocess_result.manifest
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert m["minserve"]["version"] == minserve.__version__ and m["minserve"]["git_commit"] == head
    assert isinstance(m["minserve"]["git_dirty"], bool)
    assert m["kernels"]["flags"] == build.FLAGS + build.vendor_flags() and m["kernels"]["compiler"]
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert ("avx2" in m["kernels"]["isa"]) == (" avx2" in cpuinfo)
    hw = m["hardware"]
    assert hw["logical_cpus"] == os.cpu_count() and hw["read_bandwidth_bytes_per_s"] > 1e8
    assert hw["cpu_model"] and "gpu" in hw


def test_file_hashes_are_reused_until_the_file_changes(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"abc")
    cache = {}
    real = file_sha256(f, cache)
    assert real == hashlib.sha256(b"abc").hexdigest()
    cache[str(f.resolve())]["sha256"] = "from-the-cache"        # same path, mtime and size
    assert file_sha256(f, cache) == "from-the-cache"             # not read again
    os.utime(f, ns=(1, 1))                                       # a new stamp: hashed again
    assert file_sha256(f, cache) == real


def test_the_load_sampler_separates_our_cpu_from_other_processes(monkeypatch):
    busy = iter([100.0, 103.0])        # machine busy seconds before / after
    ours = iter([10.0, 11.5])          # this process (and its server) before / after
    clock = iter([50.0, 52.0])
    monkeypatch.setattr(mf, "_busy_s", lambda: next(busy))
    monkeypatch.setattr(mf, "_process_cpu_s", lambda pid: next(ours))
    monkeypatch.setattr(mf.time, "monotonic", lambda: next(clock))
    load = mf.LoadSampler().start().stop()
    assert (load["seconds"], load["ours_cores"], load["others_cores"]) == (2.0, 0.75, 0.75)


def test_comparable_names_the_differences_that_matter(inprocess_result):
    a = inprocess_result.to_json()
    assert comparable(a, copy.deepcopy(a)) == []
    b = copy.deepcopy(a)
    b["manifest"]["engine"]["max_num_seqs"] = 64      # the variable under study: still comparable
    b["manifest"]["minserve"]["git_commit"] = "0" * 40
    assert comparable(a, b) == []
    b["manifest"]["workload"]["version"] = "2.0.0"
    b["manifest"]["model"]["sha256"] = "f" * 64
    b["manifest"]["hardware"]["cpu_model"] = "Another CPU"
    diffs = comparable(a, b)
    assert [d.split(" differs")[0] for d in diffs] == ["workload version", "model file hash", "CPU model"]
    assert "'2.0.0'" in diffs[0]


def test_results_without_a_manifest_are_not_comparable(inprocess_result):
    a = inprocess_result.to_json()
    bare = {k: v for k, v in a.items() if k != "manifest"}
    assert comparable(a, bare) == [f"{NO_MANIFEST}: the second result has none"]
    assert comparable(bare, a) == [f"{NO_MANIFEST}: the first result has none"]
    assert comparable(None, None) == [f"{NO_MANIFEST}: neither result has one"]


def test_bench_serve_writes_the_manifest_into_its_result_file(tmp_path):
    from minserve.bench.cli import main
    rc = main(["--backend", "inprocess", "--model", "tiny-llama", "--workload", "short_qa",
               "--num-prompts", "3", "--length-scale", "0.1", "--save-result", "--result-dir",
               str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"])
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    m = result["manifest"]
    assert set(m) == FIELDS and m["workload"]["name"] == "short_qa" and m["workload"]["version"] == "1.0.0"
    assert m["workload"]["num_prompts"] == 3 and m["workload"]["length_scale"] == 0.1
    assert m["bench"]["class_slos"]["short_qa"]["slo"] == {"ttft": 1000.0, "tpot": 150.0, "e2el": 8000.0}
    short_qa = result["classes"]["short_qa"]
    assert short_qa["num_requests"] == 3 and short_qa["priority_class"] == "interactive"
    assert result["request_goodput"] == pytest.approx(short_qa["request_goodput"])


def test_a_dataset_run_is_identified_by_its_arguments():
    a = mf.dataset_workload("random", random_input_len=32)
    assert a == mf.dataset_workload("random", random_input_len=32) and a["version"] is None
    assert a["sha256"] != mf.dataset_workload("random", random_input_len=64)["sha256"]


def test_build_manifest_takes_what_it_is_given():
    m = build_manifest(workload={"name": "w"}, model=None, engine=None, server={"kind": "external"},
                       bench={"request_rate": float("inf")}, load=None)
    assert set(m) == FIELDS and m["model"]["sha256"] is None and m["bench"]["request_rate"] == float("inf")
