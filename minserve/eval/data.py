"""The evaluation data that ships with the project (``datasets/eval/``, installed with the wheel as
``minserve/datasets/eval/``), and how it is read.

Two sets, both written for this project and licensed with it (datasets/eval/README.md):

- ``prose.jsonl``: 20 paragraphs of plain factual English, one ``{"id", "text"}`` per line, for
  perplexity, KL divergence and the greedy-agreement prompts;
- ``questions.jsonl``: 64 short questions with one-word or one-number answers, one
  ``{"id", "question", "answers"}`` per line (``answers``: the accepted spellings).

The same files are lm-eval tasks (``datasets/eval/tasks/*.yaml``), so our own metrics and lm-eval
read the very same data and, for the questions, the very same prompt and answer normalization
(tests/test_eval.py checks that the YAML and the constants here agree).
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from pathlib import Path

from minserve.paths import dataset_path  # its home; still importable from here

# A fixed three-shot prompt: a 135M instruct model answers in one word after it, where a bare
# question (or its chat template) gets a whole sentence that no exact match can score.
FEWSHOT = ("Answer each question with a single word or number.\n\n"
           "Question: What is the capital of Peru?\nAnswer: Lima\n\n"
           "Question: How many legs does a cat have?\nAnswer: 4\n\n"
           "Question: What color is coal?\nAnswer: black\n\n")
ANSWER_STOP = "\n"
ANSWER_MAX_TOKENS = 10
# Removed from prediction and answers before comparing, then case and punctuation are dropped:
# the rules of lm-eval's exact_match with these regexes_to_ignore, ignore_case, ignore_punctuation.
ANSWER_IGNORE = (r"(?i)\b(?:the|an?)\b", r"\s+")


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return f"{FEWSHOT}Question: {self.question}\nAnswer:"


def default_data_dir() -> Path:
    """The gate's text and questions (``datasets/eval``; in a wheel, ``minserve/datasets/eval``)."""
    return dataset_path("eval")


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the evaluation data ships in the repository's "
                                "datasets/eval/ and in the wheel as minserve/datasets/eval/ (pass "
                                "data_dir / --data-dir to point elsewhere)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_texts(data_dir: Path | None = None) -> list[str]:
    return [row["text"] for row in _jsonl(Path(data_dir or default_data_dir()) / "prose.jsonl")]


def load_questions(data_dir: Path | None = None) -> list[Question]:
    rows = _jsonl(Path(data_dir or default_data_dir()) / "questions.jsonl")
    return [Question(row["question"], tuple(row["answers"])) for row in rows]


def normalize_answer(text: str) -> str:
    for pattern in ANSWER_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower().translate(str.maketrans("", "", string.punctuation))


def is_correct(prediction: str, answers: tuple[str, ...] | list[str]) -> bool:
    """Exact match after normalization against any accepted answer; only the first line counts
    (generation stops at a newline, but a caller may pass untrimmed text)."""
    first = prediction.split(ANSWER_STOP, 1)[0]
    return normalize_answer(first) in {normalize_answer(a) for a in answers}
