"""Scenario workloads: the request shapes of one internal assistant, built from real text.

Four request types stress different parts of a serving engine, so each gets its own shape:

========  ==================================  ====================  =========================
name      prompt tokens                       output tokens          what it stresses
========  ==================================  ====================  =========================
qa        lognormal median 64, s=0.4,         median 48, s=0.5,      interactive latency
          clip [40, 192]                      clip [8, 160]
rag       lognormal median 1024, s=0.35,      median 64, s=0.5,      prefill and KV capacity
          clip [512, 2048]                    clip [16, 256]
code      lognormal median 96, s=0.4,         median 384, s=0.4,     decode time, long-lived
          clip [48, 256]                      clip [128, 1024]       sequences
agent     1024 shared + lognormal median 160, median 32, s=0.4,      prefix reuse (the 1024
          s=0.4, clip [64, 512]               clip [8, 96]           instruction tokens are
                                                                     identical in every request)
mix       qa 40 %, rag 20 %, code 20 %, agent 20 % (chosen per request)
========  ==================================  ====================  =========================

"lognormal median m, s" means ``round(m * exp(s * z))`` with ``z ~ N(0, 1)``, then clipped. Token
counts are those of the benchmark's tokenizer; the prompt text is cut so its token count lands on
the drawn length (within a couple of tokens: BPE may merge across a cut). ``length_scale``
multiplies every median, clip bound and the agent prefix (e.g. 0.25 for a laptop CPU); a prompt is
never shorter than its template (~30 tokens).

Text comes from :mod:`minserve.bench.corpus` (the standard library's documentation), wrapped in
our own question and task templates. Everything is drawn from ``numpy.random.default_rng(seed)``,
so the same seed, tokenizer and Python version give the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from minserve.bench.corpus import Corpus


@dataclass(frozen=True)
class LengthDist:
    """Lognormal token counts: median, shape ``sigma`` and clip bounds [lo, hi]."""
    median: int
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, scale: float = 1.0) -> int:
        z = rng.standard_normal()
        value = round(self.median * scale * float(np.exp(self.sigma * z)))
        return int(min(max(value, round(self.lo * scale), 1), max(round(self.hi * scale), 1)))


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt: LengthDist   # for agent: the changing state only (the shared prefix comes on top)
    output: LengthDist
    build: Callable[["_Builder", int], str]


QUESTIONS = (
    "What does {module}.{func} do, and when would I reach for it?",
    "Which arguments does {module}.{func} accept, and which are optional?",
    "What does {module}.{func} return when it succeeds?",
    "Can {module}.{func} be called safely from several threads at once?",
    "Show one short line of code that calls {module}.{func}.",
    "Which exceptions can {module}.{func} raise, and why?",
    "How is {module}.{func} better than writing the same logic by hand?",
)
CODE_TASKS = (
    "Write a Python module that wraps {module}.{func} with input validation, type hints, logging "
    "and a small command-line interface, then add pytest tests for its edge cases.",
    "Implement a class that caches the results of {module}.{func} with a size limit and an "
    "eviction policy. Include docstrings and unit tests.",
    "Write an asyncio helper built on {module}.{func} with retries and timeouts, plus tests.",
    "Turn a script that calls {module}.{func} in a loop into a small reusable library with a "
    "clean API, documentation and tests.",
)
AGENT_GOALS = (
    "archive the build logs of job {n} and remove files older than a week",
    "find every configuration file changed by job {n} and copy it to the backup folder",
    "check that the output directory of job {n} matches the expected file pattern",
    "move the artifacts of job {n} into a dated release directory",
)
AGENT_HEADER = (
    "You are an operations agent that manages files on a build server. Follow the rules and use "
    "only the functions documented in the manual below as tools. Reply with exactly one tool call "
    'per turn, as JSON: {"tool": "<module>.<function>", "args": {...}}. Never delete files '
    "outside the job's own directory.\n\nTOOL MANUAL\n\n")
AGENT_MANUAL_MODULES = ("shutil", "pathlib", "glob", "fnmatch")
AGENT_PREFIX_TOKENS = 1024


class _Builder:
    """Fills templates with corpus text so the whole prompt hits a token target."""

    def __init__(self, corpus: Corpus, rng: np.random.Generator, scale: float):
        self.corpus, self.rng, self.scale = corpus, rng, scale
        self._agent_prefix: str | None = None

    def question(self) -> str:
        module, func = self.corpus.pick_function(self.rng)
        template = QUESTIONS[int(self.rng.integers(len(QUESTIONS)))]
        return template.format(module=module, func=func)

    def fill(self, template: str, target: int, **fields) -> str:
        """``template`` with ``{passage}`` sized so the prompt is ``target`` tokens."""
        overhead = self.corpus.count(template.format(passage="", **fields))
        passage = self.corpus.passage(self.rng, target - overhead)
        return template.format(passage=passage, **fields)

    def agent_prefix(self) -> str:
        # Built once per workload and never from the rng: every request (and every run with the
        # same scale) shares these exact tokens, which is what lets a prefix cache skip them.
        if self._agent_prefix is None:
            n = round(AGENT_PREFIX_TOKENS * self.scale) - self.corpus.count(AGENT_HEADER)
            manual = self.corpus.fixed_text(AGENT_MANUAL_MODULES, max(n - 2, 1))
            self._agent_prefix = AGENT_HEADER + manual + "\n\n"
        return self._agent_prefix


def _qa(b: _Builder, target: int) -> str:
    return b.fill("Answer in one or two sentences.\nQuestion: {question}\nContext: {passage}\n"
                  "Answer:", target, question=b.question())


def _rag(b: _Builder, target: int, num_docs: int = 4) -> str:
    head = "Answer the question using only the retrieved documents, citing them by number.\n\n"
    tail = "Question: {question}\nAnswer:".format(question=b.question())
    labels = [f"Document [{j + 1}]:\n" for j in range(num_docs)]
    budget = target - b.corpus.count(head + "\n\n".join(labels) + "\n\n" + tail)
    docs = [lab + b.corpus.passage(b.rng, budget // num_docs) for lab in labels]
    return head + "\n\n".join(docs) + "\n\n" + tail


def _code(b: _Builder, target: int) -> str:
    module, func = b.corpus.pick_function(b.rng)
    task = CODE_TASKS[int(b.rng.integers(len(CODE_TASKS)))].format(module=module, func=func)
    return b.fill("{task}\nNotes from the documentation:\n{passage}\nAnswer with code only.\n",
                  target, task=task)


def _agent(b: _Builder, target: int) -> str:
    prefix = b.agent_prefix()
    step, job = int(b.rng.integers(1, 40)), int(b.rng.integers(1000, 9999))
    goal = AGENT_GOALS[int(b.rng.integers(len(AGENT_GOALS)))].format(n=job)
    state = b.fill("### Step {step}\nTask: {goal}\nLast observation:\n{passage}\n\nNext tool call:",
                   target, step=step, goal=goal)
    return prefix + state


SCENARIOS: dict[str, Scenario] = {
    "qa": Scenario("qa", LengthDist(64, 0.4, 40, 192), LengthDist(48, 0.5, 8, 160), _qa),
    "rag": Scenario("rag", LengthDist(1024, 0.35, 512, 2048), LengthDist(64, 0.5, 16, 256), _rag),
    "code": Scenario("code", LengthDist(96, 0.4, 48, 256), LengthDist(384, 0.4, 128, 1024), _code),
    "agent": Scenario("agent", LengthDist(160, 0.4, 64, 512), LengthDist(32, 0.4, 8, 96), _agent),
}
MIX_WEIGHTS: dict[str, float] = {"qa": 0.4, "rag": 0.2, "code": 0.2, "agent": 0.2}


def scenario_names(name: str, n: int, rng: np.random.Generator,
                   weights: dict[str, float] | None = None) -> list[str]:
    """Which scenario each of ``n`` requests belongs to (``mix`` draws by ``weights``)."""
    if name in SCENARIOS:
        return [name] * n
    if name != "mix":
        raise ValueError(f"scenario must be one of {sorted(SCENARIOS) + ['mix']}, got {name!r}")
    w = weights or MIX_WEIGHTS
    keys = sorted(w)
    p = np.array([w[k] for k in keys], dtype=float)
    return [keys[i] for i in rng.choice(len(keys), size=n, p=p / p.sum())]


def build_prompt(builder: _Builder, scenario: Scenario) -> tuple[str, int]:
    """(prompt text, output length) for one request of ``scenario``."""
    target = scenario.prompt.sample(builder.rng, builder.scale)
    output_len = scenario.output.sample(builder.rng, builder.scale)
    return scenario.build(builder, target), output_len
