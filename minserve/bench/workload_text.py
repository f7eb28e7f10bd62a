"""The text of a workload's requests: shared prefixes and bodies cut to the drawn token counts.

A prompt is ``prefix + body``. The prefix (when the workload has shared prefixes) is built once per
prefix index and never from the run's random streams: every request that reuses prefix 2 starts
with byte-identical text, in every run, which is what lets a prefix cache skip it. A request that
does not reuse a prefix gets one of the same length that starts with a session number of its own,
so its first KV block already differs and nothing after it can hit. The body fills the workload's
template; ``{passage}`` takes whatever tokens the template leaves of the drawn body length.

Counting: the whole prompt is counted as the server counts it (special tokens included), so the
beginning-of-sequence token belongs to the prefix when there is one, else to the body. BPE may
merge across a cut, so a prompt lands within a few tokens of prefix + body, never exactly.
"""

from __future__ import annotations

import numpy as np

from minserve.bench.corpus import Corpus, Paragraph
from minserve.bench.workload_parts import Shape


class TextCorpus(Corpus):
    """:class:`~minserve.bench.corpus.Corpus`'s exact-length cutting over one section of our own
    text instead of the standard library's documentation. Passages wrap within the section."""

    def __init__(self, tokenizer, name: str, paragraphs: list[str]):
        self.tokenizer, self.modules = tokenizer, (name,)
        self.paragraphs = [Paragraph(name, p) for p in paragraphs]
        self.functions = {name: [name]}


class PromptBuilder:
    """Builds the prompts of one single workload with one tokenizer; caches its prefixes."""

    def __init__(self, workload, tokenizer):
        self.w, self.tokenizer = workload, tokenizer
        sections = workload.corpus["sections"]
        self.sections = {name: TextCorpus(tokenizer, name, list(paras)) for name, paras in sections.items()}
        self._prefixes: dict[tuple[int, int], str] = {}

    def _section(self, name: str) -> TextCorpus:
        return self.sections[name]

    def shared_prefix(self, index: int, tokens: int) -> str:
        """Prefix ``index`` at ``tokens`` tokens (as a whole prompt: BOS included)."""
        key = (index, tokens)
        if key not in self._prefixes:
            p = self.w.prefix
            header = self._section(p.headers).paragraphs[index].text
            fill = self._section(p.fill)
            # A fixed generator per prefix index: the same text in every run and for every seed.
            rest = fill.passage(np.random.default_rng(index), tokens)
            self._prefixes[key] = fill.cut(header + "\n\n" + rest, self._room(tokens)) + "\n\n"
        return self._prefixes[key]

    def _room(self, tokens: int) -> int:
        """Tokens of text a prefix of ``tokens`` holds: less the special tokens and the closing
        blank line (which separates it from the body and keeps BPE from merging across)."""
        closing = len(self.tokenizer("\n\n", add_special_tokens=False).input_ids)
        return max(tokens - int(self.tokenizer.num_special_tokens_to_add()) - closing, 1)

    def unique_prefix(self, index: int, tokens: int, rng: np.random.Generator) -> str:
        """A prefix as long as shared prefix ``index`` that no other request shares."""
        session = f"Session {int(rng.integers(10**8)):08d}.\n"
        shared = self.shared_prefix(index, tokens)
        return self._section(self.w.prefix.fill).cut(session + shared, self._room(tokens)) + "\n\n"

    def body(self, tokens: int, rng: np.random.Generator, counted_alone: bool) -> str:
        """The body at about ``tokens`` tokens; ``counted_alone``: it is the whole prompt (BOS)."""
        spec = self.w.body
        values = {}
        for name, source in spec.fields.items():
            if "pick" in source:
                options = self._section(source["pick"]).paragraphs
                values[name] = options[int(rng.integers(len(options)))].text
            else:
                lo, hi = source["int"]
                values[name] = str(int(rng.integers(lo, hi + 1)))
        passages = self._section(spec.passage)
        empty = spec.template.format(passage="", **values)
        overhead = passages.count(empty) if counted_alone else len(passages.encode(empty))
        budget = max(tokens - overhead, 0)
        if spec.passages == 1:
            text = passages.passage(rng, budget)
        else:  # numbered pieces, each from its own random start: retrieved documents
            labels = [f"[{i + 1}] " for i in range(spec.passages)]
            left = max(budget - len(passages.encode("\n\n".join(labels))), 0)
            shares = [left // spec.passages + (i < left % spec.passages) for i in range(spec.passages)]
            text = "\n\n".join(label + passages.passage(rng, n) for label, n in zip(labels, shares))
        return spec.template.format(passage=text, **values)

    def prompt(self, shape: Shape, rng: np.random.Generator) -> str:
        prefix = ""
        if shape.prefix_index is not None:
            prefix = (self.shared_prefix(shape.prefix_index, shape.prefix_tokens) if shape.prefix_reused
                      else self.unique_prefix(shape.prefix_index, shape.prefix_tokens, rng))
        return prefix + self.body(shape.body_tokens, rng, counted_alone=not prefix)
