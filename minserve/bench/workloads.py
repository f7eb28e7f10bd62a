"""Versioned workload files (``datasets/workloads/*.json``) -> the requests of one benchmark run.

A workload file pins down everything about the traffic except how much of it there is: the shape
of prompts and answers (length distributions in tokens), how requests arrive (Poisson, gamma
burstiness or constant gaps; the *rate* is a parameter of the run), whether the application
streams, how requests share prompt prefixes (system prompts, tool manuals), the priority class it
is served in and the SLO it is judged by. Its text comes from ``corpus.json`` beside it, written
for this project. ``datasets/README.md`` documents every field.

Why versions and hashes: a result is only comparable with another if both ran the same traffic.
Each file carries a semantic ``version`` and a ``sha256`` of its canonical form (sorted keys, no
whitespace, the ``sha256`` field left out); :func:`load_workload` recomputes it, so a file edited
without bumping its version (and re-hashing) fails loudly instead of quietly changing every later
result. ``versions.json`` beside the files records the hash each released version had, so a
version cannot be re-hashed in place either. ``python -m minserve.bench.workloads rehash FILE``
writes both after a deliberate change.

Sampling is seeded and split in two streams: the *shape* stream (which mix component, which
prefix, body and output lengths) and the *text* stream (which question, which passage). So
:meth:`Workload.shapes` (no tokenizer: what a notebook shows before any run) draws exactly the
lengths that :meth:`Workload.requests` then fills with text.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minserve.bench.datasets import SampleRequest
from minserve.bench.workload_parts import (PRIORITY_CLASSES, SLO, Body, Lengths, Shape, SharedPrefix,
                                           WorkloadError, need_field)

if TYPE_CHECKING:
    import pandas as pd

ARRIVALS = ("poisson", "gamma", "constant")
_SEMVER = re.compile(r"^\d+\.\d+\.\d+$")
LOCK_FILE = "versions.json"


def workload_dir() -> Path:
    from minserve.eval.data import dataset_path
    return dataset_path("workloads")


def workload_names() -> list[str]:
    """The workloads that ship with minserve (every file but the corpus and the lock)."""
    return sorted(p.stem for p in workload_dir().glob("*.json")
                  if p.name != LOCK_FILE and _read(p).get("sections") is None)


def canonical_sha256(doc: dict) -> str:
    """SHA-256 of ``doc`` without its ``sha256`` field, serialized canonically, so layout and key
    order do not matter, only content does."""
    body = {k: v for k, v in doc.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise WorkloadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise WorkloadError(f"{path}: must hold one JSON object")
    return doc


def _check_hash(path: Path, doc: dict) -> str:
    """The file's hash, after checking it against its ``sha256`` field and the lock file."""
    actual = canonical_sha256(doc)
    fix = (f"bump 'version' (now {doc.get('version')!r}) and run `python -m minserve.bench."
           f"workloads rehash {path}`")
    if doc.get("sha256") != actual:
        raise WorkloadError(f"{path}: content hash {actual[:12]}... does not match the file's "
                            f"sha256 {str(doc.get('sha256'))[:12]}...: the file was edited without "
                            f"a version bump; {fix}")
    lock = path.parent / LOCK_FILE
    if lock.is_file():
        released = _read(lock).get(doc.get("name"), {})
        if doc.get("version") not in released:
            raise WorkloadError(f"{path}: version {doc.get('version')!r} of {doc.get('name')!r} is "
                                f"not in {lock.name}; run `python -m minserve.bench.workloads "
                                f"rehash {path}` to release it")
        if released[doc["version"]] != actual:
            raise WorkloadError(f"{path}: version {doc['version']} of {doc['name']!r} was released "
                                f"with another content hash ({lock.name}); {fix}")
    return actual


# ---- the workload ------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    version: str
    sha256: str                 # the file's own hash
    resolved_sha256: str        # over the file and everything it uses (corpus, components)
    path: Path
    description: str
    arrival: str
    burstiness: float           # the gamma shape bench's --burstiness takes (inf: constant)
    prompt: Lengths | None = None
    output: Lengths | None = None
    streaming: bool = True
    priority_class: str = "interactive"
    slo: SLO | None = None
    prefix: SharedPrefix | None = None
    body: Body | None = None
    corpus: dict | None = None  # {"name", "version", "sha256", "sections"}
    components: list[tuple["Workload", float]] = field(default_factory=list)  # a mix

    @property
    def is_mix(self) -> bool:
        return bool(self.components)

    def classes(self) -> dict[str, "Workload"]:
        """The single workloads whose requests this one sends, by name (itself unless a mix)."""
        return {w.name: w for w, _ in self.components} if self.is_mix else {self.name: self}

    def class_slos(self) -> dict[str, dict]:
        """Per class: its priority class, streaming flag and SLO as bench goodput keys (ms)."""
        return {n: {"priority_class": w.priority_class, "streaming": w.streaming,
                    "slo": w.slo.goodput() if w.slo else {}} for n, w in self.classes().items()}

    def describe(self) -> dict:
        """Name, version and hashes (the manifest's ``workload`` entry)."""
        out = {"name": self.name, "version": self.version, "sha256": self.sha256,
               "resolved_sha256": self.resolved_sha256, "file": self.path.name,
               "arrival": self.arrival, "burstiness": self.burstiness}
        if self.corpus:
            out["corpus"] = {k: self.corpus[k] for k in ("name", "version", "sha256")}
        if self.is_mix:
            out["components"] = [{"name": w.name, "version": w.version, "weight": wt,
                                  "resolved_sha256": w.resolved_sha256} for w, wt in self.components]
        return out

    # ---- sampling --------------------------------------------------------------------------

    def draw_shapes(self, n: int, seed: int = 0, length_scale: float = 1.0) -> list[Shape]:
        if n < 0 or not length_scale > 0:
            raise ValueError(f"need n >= 0 and length_scale > 0, got {n}, {length_scale}")
        rng = np.random.default_rng([seed, 0])   # the shape stream (module docstring)
        if not self.is_mix:
            return [self._shape(rng, length_scale) for _ in range(n)]
        weights = np.array([wt for _, wt in self.components], dtype=float)
        picks = rng.choice(len(self.components), size=n, p=weights / weights.sum())
        return [self.components[int(i)][0]._shape(rng, length_scale) for i in picks]

    def _shape(self, rng: np.random.Generator, scale: float) -> Shape:
        index, reused, p_tokens = None, False, 0
        if self.prefix is not None:
            index = int(rng.integers(self.prefix.count))
            reused = bool(rng.random() < self.prefix.reuse_share)
            p_tokens = max(1, round(self.prefix.tokens * scale))
        return Shape(self.name, index, reused, p_tokens, self.prompt.sample(rng, scale),
                     self.output.sample(rng, scale))

    def shapes(self, n: int, seed: int = 0, length_scale: float = 1.0) -> "pd.DataFrame":
        """The drawn lengths of ``n`` requests, one row each (no tokenizer, no text)."""
        import pandas as pd
        return pd.DataFrame([vars(s) for s in self.draw_shapes(n, seed, length_scale)])

    def requests(self, tokenizer, n: int, seed: int = 0,
                 length_scale: float = 1.0) -> list[SampleRequest]:
        """``n`` requests with text, ready for the bench client or the in-process runner."""
        from minserve.bench.workload_text import PromptBuilder
        text_rng = np.random.default_rng([seed, 1])
        builders: dict[str, PromptBuilder] = {}
        out = []
        for i, shape in enumerate(self.draw_shapes(n, seed, length_scale)):
            w = self.classes()[shape.workload]
            b = builders.get(w.name) or builders.setdefault(w.name, PromptBuilder(w, tokenizer))
            prompt = b.prompt(shape, text_rng)
            out.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), shape.output_tokens,
                                     str(i), w.name, w.priority_class))
        return out


def _arrival(d: dict, where: str) -> tuple[str, float]:
    process = need_field(d, "process", where)
    if process not in ARRIVALS:
        raise WorkloadError(f"{where}.process must be one of {', '.join(ARRIVALS)}, got {process!r}")
    if process == "gamma":
        k = d.get("burstiness")
        if not (isinstance(k, (int, float)) and k > 0):
            raise WorkloadError(f"{where}: gamma needs burstiness > 0 (1 = Poisson), got {k!r}")
        return process, float(k)
    return process, (1.0 if process == "poisson" else math.inf)


def _load_corpus(path: Path, pin: dict, where: str) -> dict:
    file = path.parent / need_field(pin, "file", where)
    doc = _read(file)
    digest = _check_hash(file, doc)
    if doc.get("version") != pin.get("version"):
        raise WorkloadError(f"{where}: pins {file.name} version {pin.get('version')!r}, the file is "
                            f"version {doc.get('version')!r}")
    return {"name": doc.get("name"), "version": doc["version"], "sha256": digest,
            "sections": doc.get("sections", {})}


def _resolve(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        return p
    candidate = workload_dir() / f"{name_or_path}.json"
    if not candidate.is_file():
        raise WorkloadError(f"workload {str(name_or_path)!r} is neither a file nor one of "
                            f"{', '.join(workload_names())}")
    return candidate


def load_workload(name_or_path: str | Path) -> Workload:
    """A workload by name (``short_qa``, ``capstone_mix``...) or path, hash-checked."""
    path = _resolve(name_or_path)
    doc = _read(path)
    where = path.name
    for key in ("name", "version"):
        need_field(doc, key, where)
    if not _SEMVER.match(str(doc["version"])):
        raise WorkloadError(f"{where}: version must be MAJOR.MINOR.PATCH, got {doc['version']!r}")
    digest = _check_hash(path, doc)
    arrival, burstiness = _arrival(need_field(doc, "arrival", where), f"{where}: arrival")
    common = dict(name=doc["name"], version=doc["version"], sha256=digest, path=path,
                  description=doc.get("description", ""), arrival=arrival, burstiness=burstiness)
    if "components" in doc:
        return _mix(doc, path, common)
    corpus = _load_corpus(path, need_field(doc, "corpus", where), f"{where}: corpus")
    w = Workload(**common, resolved_sha256="", corpus=corpus,
                 prompt=Lengths.parse(need_field(doc, "prompt_tokens", where), f"{where}: prompt_tokens"),
                 output=Lengths.parse(need_field(doc, "output_tokens", where), f"{where}: output_tokens"),
                 streaming=bool(need_field(doc, "streaming", where)),
                 priority_class=need_field(doc, "priority_class", where),
                 slo=SLO.parse(need_field(doc, "slo", where), f"{where}: slo"),
                 prefix=SharedPrefix.parse(doc.get("shared_prefix"), f"{where}: shared_prefix"),
                 body=Body.parse(need_field(doc, "body", where), f"{where}: body"))
    if w.priority_class not in PRIORITY_CLASSES:
        raise WorkloadError(f"{where}: priority_class must be one of {PRIORITY_CLASSES}, got "
                            f"{w.priority_class!r}")
    _check_sections(w, where)
    w.resolved_sha256 = _combined({"workload": digest, "corpus": corpus["sha256"]})
    return w


def _check_sections(w: Workload, where: str) -> None:
    used = [w.body.passage] + [f["pick"] for f in w.body.fields.values() if "pick" in f]
    if w.prefix:
        used += [w.prefix.headers, w.prefix.fill]
    missing = [s for s in used if not w.corpus["sections"].get(s)]
    if missing:
        raise WorkloadError(f"{where}: corpus {w.corpus['name']} has no section(s) {missing}")
    if w.prefix and len(w.corpus["sections"][w.prefix.headers]) < w.prefix.count:
        raise WorkloadError(f"{where}: shared_prefix.count {w.prefix.count} needs as many headers "
                            f"in section {w.prefix.headers!r}")


def _mix(doc: dict, path: Path, common: dict) -> Workload:
    where = path.name
    parts = []
    for i, c in enumerate(need_field(doc, "components", where)):
        part = load_workload(path.parent / f"{need_field(c, 'workload', where)}.json")
        if part.version != c.get("version"):
            raise WorkloadError(f"{where}: components[{i}] pins {part.name} version "
                                f"{c.get('version')!r}, the file is version {part.version}")
        if part.is_mix or not float(c.get("weight", 0)) > 0:
            raise WorkloadError(f"{where}: components[{i}] must be a single workload with weight > 0")
        parts.append((part, float(c["weight"])))
    if not parts:
        raise WorkloadError(f"{where}: components must list at least one workload")
    resolved = _combined({"workload": common["sha256"], "components": [w.resolved_sha256 for w, _ in parts]})
    return Workload(**common, resolved_sha256=resolved, components=parts)


def _combined(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ---- rehash: the one deliberate way to change a workload -----------------------------------------

def rehash(path: str | Path) -> str:
    """Write ``path``'s content hash into its ``sha256`` field and release its version in the lock
    file beside it. Refuses when that version was already released with other content."""
    path = Path(path)
    doc = _read(path)
    digest = canonical_sha256(doc)
    lock_path = path.parent / LOCK_FILE
    lock = _read(lock_path) if lock_path.is_file() else {}
    released = lock.setdefault(doc["name"], {})
    if released.get(doc["version"], digest) != digest:
        raise WorkloadError(f"{path}: version {doc['version']} of {doc['name']!r} was released with "
                            "other content; bump 'version' first")
    released[doc["version"]] = digest
    doc["sha256"] = digest
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    lock_path.write_text(json.dumps(lock, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return digest


def main(argv: list[str] | None = None) -> int:
    """``python -m minserve.bench.workloads {check,rehash} FILE...``"""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python -m minserve.bench.workloads {check,rehash} FILE...\n"
             "  check   load each file, verifying its sha256 and released version\n"
             "  rehash  after a deliberate edit and a version bump: write sha256, release the version")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) < 2 or argv[0] not in ("check", "rehash"):
        print(usage, file=sys.stderr)
        return 2
    try:
        for f in (a for a in argv[1:] if Path(a).name != LOCK_FILE):
            if argv[0] == "rehash":
                print(f"{f}: sha256 {rehash(f)}")
                continue
            doc = _read(Path(f))
            if doc.get("sections") is not None:  # the corpus: its hash alone
                _check_hash(Path(f), doc)
            else:
                load_workload(f)
            print(f"{f}: ok ({doc.get('name')} {doc.get('version')})")
    except WorkloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
